"""Where the Accelerate plugin's values come from: one parser per field kind, and the layers that feed them.

Precedence, later winning: field defaults < YAML file (``HF_EFF_CONFIG`` or ``config_file=``) < ``HF_EFF_*``
environment variables (and ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``) < keyword arguments. Every value from
every source is checked by its field's parser, and an error names the source (file and key, or variable).

A layer maps field name -> (raw value, source); :func:`merge_layers` parses and stacks them.
"""

from __future__ import annotations

import difflib
import logging
import os
from contextlib import contextmanager
from dataclasses import Field, field
from typing import Any, Callable, Mapping, Sequence

from ..options import OPTIONS, check_hyperparams, parse_optim_args
from ..registry import get_spec
from .schedules import SCHEDULERS

__all__ = ["ENV_PREFIX", "ACCELERATE_GA_ENV", "option_field", "at_least", "yaml_layer", "env_layer",
           "file_layer", "keyword_layer", "merge_layers", "config_path"]

logger = logging.getLogger(__name__)
ENV_PREFIX = "HF_EFF_"
ACCELERATE_GA_ENV = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"
CORE_FIELDS = ("backend", "decay_embeddings", "gradient_release")  # plugin fields that are also core options (may sit in optim_args)

Layer = dict  # field name -> (raw value, source)


# --------------------------------------------------------------------------------------------- parsers
# One parser per field kind; each takes (value, where) and returns the typed value or raises naming `where`.

def text(value, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: expected a non-empty string, got {value!r}")
    return value.strip()


def _number(kind: type, value, where: str):
    if isinstance(value, bool):
        raise ValueError(f"{where}: expected {'an integer' if kind is int else 'a number'}, got {value!r}")
    try:
        out = kind(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected {'an integer' if kind is int else 'a number'}, got {value!r}") from None
    if kind is int and isinstance(value, float) and value != out:
        raise ValueError(f"{where}: expected an integer, got {value!r}")
    return out


@contextmanager
def _named(where: str):
    """Re-raise a core check's ValueError with ``where`` (the file and key, or the variable) in front."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def hyper(key: str) -> Callable:
    """Parser for lr / weight_decay / eps: a float, checked by the core's check_hyperparams."""
    def parse(value, where):
        out = _number(float, value, where)
        with _named(where):
            check_hyperparams(**{"lr": 0.0, key: out})
        return out
    return parse


def betas(value, where):
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or len(items) != 2:
        raise ValueError(f"{where}: betas must be two numbers 'beta1,beta2', got {value!r}")
    out = tuple(_number(float, b, where) for b in items)
    with _named(where):
        check_hyperparams(lr=0.0, betas=out)
    return out


def at_least(lo: int) -> Callable:
    def parse(value, where):
        out = _number(int, value, where)
        if out < lo:
            raise ValueError(f"{where}: must be an integer >= {lo}, got {value!r}")
        return out
    return parse


def ratio(value, where):
    out = _number(float, value, where)
    if not 0.0 <= out < 1.0:
        raise ValueError(f"{where}: warmup_ratio must be in [0, 1), got {value!r}")
    return out


def optim_name(value, where):
    name = text(value, where)
    with _named(where):
        return get_spec(name).name


def core_option(key: str) -> Callable:
    """Parser for a field that is also a core option (backend, decay_embeddings): the core's own coercion."""
    def parse(value, where):
        return OPTIONS[key].coerce(value, where)
    return parse


def scheduler(value, where):
    out = text(value, where)
    if out not in SCHEDULERS:
        close = difflib.get_close_matches(out, SCHEDULERS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{where}: unknown lr_scheduler_type {out!r}.{hint} Choose from: {', '.join(SCHEDULERS)}")
    return out


def optim_args(value, where) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):
        with _named(where):
            return parse_optim_args(value)
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items()}
    raise ValueError(f"{where}: optim_args must be 'key=value,...' text or a mapping, got {value!r}")


def config_path(value, where):
    out = text(value, where)
    if os.path.isdir(out):
        raise ValueError(f"{where}: config file {out!r} is a directory: give the path of a YAML file of "
                         "EfficientOptimPlugin fields")
    if not os.path.isfile(out):
        raise ValueError(f"{where}: config file {out!r} does not exist")
    return out


def option_field(default, help: str, parse: Callable):
    """A plugin field: help text, its default and its parser in the metadata.

    The dataclass default is None, meaning "not given", so a later source can tell an explicit value from a
    default; the real default is filled in by :func:`merge_layers`.
    """
    return field(default=None, metadata={"help": f"{help} (default: {default!r})", "default": default, "parse": parse})


# ---------------------------------------------------------------------------------------------- layers
# TrainingArguments' names for our fields, so a Trainer user's key gets a precise hint.
_TRAINER_NAMES = {"learning_rate": "lr", "adam_beta1": "betas", "adam_beta2": "betas", "adam_epsilon": "eps",
                  "optimizer": "optim", "lr_scheduler": "lr_scheduler_type"}


def _suggest(key: str, known: list[str], cutoff: float = 0.6) -> str | None:
    if key.lower() in _TRAINER_NAMES:
        return _TRAINER_NAMES[key.lower()]
    close = difflib.get_close_matches(key, known, n=1, cutoff=cutoff)
    return close[0] if close else None


def yaml_layer(path: str, known: Sequence[str]) -> Layer:
    """The fields set in the YAML file ``path``; an unknown key is refused with the closest known one."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    except UnicodeDecodeError as e:  # YAML is UTF-8 (or UTF-16/32 with a BOM); a locale default would guess
        raise ValueError(f"{path}: not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} at offset {e.start}): "
                         "save the config file as UTF-8") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a mapping of EfficientOptimPlugin fields, got {type(data).__name__}")
    for key in data:
        if key not in known:
            close = _suggest(str(key), list(known))
            hint = f" Did you mean {close!r}?" if close else ""
            raise ValueError(f"{path}: unknown key {key!r}.{hint} Known keys: {', '.join(known)}")
    return {k: (v, f"{path}: {k}") for k, v in data.items()}


def env_layer(known: Sequence[str]) -> Layer:
    """The fields set by ``HF_EFF_<FIELD>`` variables (and Accelerate's accumulation variable, which must agree)."""
    variables = {ENV_PREFIX + name.upper(): name for name in known}
    layer = {}
    for var, value in os.environ.items():
        if var in variables:
            layer[variables[var]] = (value, var)
        elif var.startswith(ENV_PREFIX) and var != ENV_PREFIX + "CONFIG":
            # other tools may own HF_EFF_* names too: only a near miss of ours is worth a warning
            trainer_name = _TRAINER_NAMES.get(var[len(ENV_PREFIX):].lower())
            close = ENV_PREFIX + trainer_name.upper() if trainer_name else _suggest(var, list(variables), cutoff=0.85)
            if close:
                logger.warning("hf_efficient: ignoring unknown variable %s (did you mean %s?)", var, close)
    # `accelerate launch --gradient_accumulation_steps N` exports this; it must agree with ours if both are set.
    if os.environ.get(ACCELERATE_GA_ENV):
        acc = (os.environ[ACCELERATE_GA_ENV], ACCELERATE_GA_ENV)
        ours = layer.get("gradient_accumulation_steps")
        if ours is not None and at_least(1)(ours[0], ours[1]) != at_least(1)(*acc):
            raise ValueError(f"{ours[1]}={ours[0]} and {ACCELERATE_GA_ENV}={acc[0]} disagree: set one of them")
        layer.setdefault("gradient_accumulation_steps", acc)
    return layer


def file_layer(config_file: str | None, known: Sequence[str]) -> tuple[str | None, Layer]:
    """The YAML layer of ``config_file``, else of ``$HF_EFF_CONFIG``, else none; and the file's checked path."""
    where = "EfficientOptimPlugin(config_file=...)"
    if config_file is None and os.environ.get(ENV_PREFIX + "CONFIG"):
        config_file, where = os.environ[ENV_PREFIX + "CONFIG"], ENV_PREFIX + "CONFIG"
    if config_file is None:
        return None, {}
    path = config_path(config_file, where)
    return path, yaml_layer(path, known)


def keyword_layer(explicit: Mapping[str, Any], owner: str = "EfficientOptimPlugin") -> Layer:
    return {k: (v, f"{owner}({k}=...)") for k, v in explicit.items()}


def _lift_core_options(layer: Layer, parsers: Mapping[str, Callable]) -> Layer:
    """``backend`` / ``decay_embeddings`` written inside optim_args set the field, at that source's rank."""
    if "optim_args" not in layer:
        return layer
    raw, src = layer["optim_args"]
    args = optim_args(raw, src)
    out = dict(layer)
    for key in CORE_FIELDS:
        if key in args:
            value = args.pop(key)
            if key in layer and parsers[key](*layer[key]) != parsers[key](value, src):
                raise ValueError(f"{src} sets {key}={value!r} but {layer[key][1]} sets {key}={layer[key][0]!r}")
            out[key] = (value, f"{src} ({key})")
    out["optim_args"] = (args, src)
    return out


def merge_layers(fields: Sequence[Field], layers: Sequence[Layer]):
    """Parse every layer's values with their field's parser and stack them over the fields' defaults.

    Returns:
        ``(values, sources, optim_args)``: field -> value, field -> source ("default" where none set it), and
        optim_args key -> (value, source) (optim_args keys merge across layers instead of replacing each other).
    """
    parsers = {f.name: f.metadata["parse"] for f in fields}
    values = {f.name: f.metadata["default"] for f in fields}
    sources = {k: "default" for k in values}
    args: dict[str, tuple[Any, str]] = {}
    for layer in layers:
        for key, (raw, src) in _lift_core_options(layer, parsers).items():
            value = parsers[key](raw, src)
            if key == "optim_args":
                args.update({k: (v, src) for k, v in value.items()})
            else:
                values[key], sources[key] = value, src
    return values, sources, args
