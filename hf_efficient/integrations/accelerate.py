"""Accelerate integration: the optimizer chosen in config, exact gradient accumulation, checked distributed set-ups.

A custom loop run with ``accelerate launch train.py`` needs three calls::

    plugin = EfficientOptimPlugin()                   # HF_EFF_* variables, a YAML file, keywords
    accelerator = plugin.create_accelerator()         # gradient accumulation wired in
    model, optimizer, train_dl, scheduler = plugin.prepare(accelerator, model, train_dl, num_training_steps=1000)
    for window in accumulation_windows(accelerator, train_dl):   # one window = one optimizer step
        for batch in window:
            with accelerator.accumulate(model):
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                accelerator.backward(window.scale(summed_token_loss(logits, batch["labels"])))
                optimizer.step(); scheduler.step(); optimizer.zero_grad()

Why windows: with token-level losses, micro-batches hold different numbers of target tokens, so the mean of
per-micro-batch means is not the big batch's mean. A window counts the target tokens of all its micro-batches
on all processes first; each micro-batch's *summed* loss is then divided by that count (as transformers'
Trainer does with ``num_items_in_batch``), which makes the accumulated gradient equal the big batch's.

Config precedence, later winning: field defaults < YAML file (``HF_EFF_CONFIG`` or ``config_file=``) <
``HF_EFF_*`` environment variables (and ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``) < keyword arguments.
Every value from every source is checked, and an error names the source (file and key, or variable).
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from dataclasses import dataclass, field, fields
from itertools import islice
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.nn.functional as F

from ..factory import build_optimizer, optimizer_info
from ..options import OPTIONS, check_hyperparams, parse_optim_args, parse_options
from ..registry import PREFIX, get_spec
from .distributed import check_deepspeed, check_fsdp

__all__ = ["EfficientOptimPlugin", "AccumulationWindow", "accumulation_windows", "summed_token_loss",
           "check_distributed_support", "choose_backend", "SCHEDULERS"]

logger = logging.getLogger(__name__)
ENV_PREFIX = "HF_EFF_"
ACCELERATE_GA_ENV = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"

# Schedulers that need nothing beyond warm-up and total steps (transformers' names; the fallback has fewer).
_HF_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                  "inverse_sqrt")
_TORCH_SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")


def _have_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


SCHEDULERS = _HF_SCHEDULERS if _have_transformers() else _TORCH_SCHEDULERS
_NEED_TOTAL = {"linear", "cosine", "cosine_with_restarts", "polynomial"}


# --------------------------------------------------------------------------------------------- coercion
# One parser per field kind; each takes (value, where) and returns the typed value or raises naming `where`.

def _text(value, where: str) -> str:
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


def _hyper(key: str):
    """Parser for lr / weight_decay / eps: a float, checked by the core's shared check_hyperparams."""
    def parse(value, where):
        out = _number(float, value, where)
        try:
            check_hyperparams(**{"lr": 0.0, key: out})
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        return out
    return parse


def _betas(value, where):
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or len(items) != 2:
        raise ValueError(f"{where}: betas must be two numbers 'beta1,beta2', got {value!r}")
    out = tuple(_number(float, b, where) for b in items)
    try:
        check_hyperparams(lr=0.0, betas=out)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return out


def _at_least(lo: int):
    def parse(value, where):
        out = _number(int, value, where)
        if out < lo:
            raise ValueError(f"{where}: must be an integer >= {lo}, got {value!r}")
        return out
    return parse


def _ratio(value, where):
    out = _number(float, value, where)
    if not 0.0 <= out < 1.0:
        raise ValueError(f"{where}: warmup_ratio must be in [0, 1), got {value!r}")
    return out


def _optim(value, where):
    try:
        return get_spec(_text(value, where)).name
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _core_option(key: str):
    """Parser for a field that is also a core option (backend, decay_embeddings): the core's own coercion."""
    def parse(value, where):
        if key == "backend" and isinstance(value, str) and value.strip().lower() == "auto":
            return None
        return OPTIONS[key].coerce(value, where)
    return parse


def _scheduler(value, where):
    out = _text(value, where)
    if out not in SCHEDULERS:
        close = difflib.get_close_matches(out, SCHEDULERS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{where}: unknown lr_scheduler_type {out!r}.{hint} Choose from: {', '.join(SCHEDULERS)}")
    return out


def _optim_args(value, where) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            return parse_optim_args(value)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items()}
    raise ValueError(f"{where}: optim_args must be 'key=value,...' text or a mapping, got {value!r}")


def _path(value, where):
    out = _text(value, where)
    if os.path.isdir(out):
        raise ValueError(f"{where}: config file {out!r} is a directory: give the path of a YAML file of "
                         "EfficientOptimPlugin fields")
    if not os.path.isfile(out):
        raise ValueError(f"{where}: config file {out!r} does not exist")
    return out


# TrainingArguments' names for our fields, so a Trainer user's key gets a precise hint.
_TRAINER_NAMES = {"learning_rate": "lr", "adam_beta1": "betas", "adam_beta2": "betas", "adam_epsilon": "eps",
                  "optimizer": "optim", "lr_scheduler": "lr_scheduler_type"}


def _suggest(key: str, known: list[str], cutoff: float = 0.6) -> str | None:
    if key.lower() in _TRAINER_NAMES:
        return _TRAINER_NAMES[key.lower()]
    close = difflib.get_close_matches(key, known, n=1, cutoff=cutoff)
    return close[0] if close else None


def _opt(default, help: str, parse: Callable):
    # Dataclass default None means "not given", so a later source can tell an explicit value from a default.
    return field(default=None, metadata={"help": f"{help} (default: {default!r})", "default": default, "parse": parse})


# ----------------------------------------------------------------------------------------------- plugin

@dataclass
class EfficientOptimPlugin:
    """The optimizer, its schedule and gradient accumulation of an Accelerate loop, set in config, not code.

    Each field can come from a YAML file (``HF_EFF_CONFIG=path`` or ``config_file=``), an environment variable
    ``HF_EFF_<FIELD>`` (``HF_EFF_OPTIM``, ``HF_EFF_LR``, ...), or a keyword; later sources win, and
    ``plugin.sources`` says where each value came from. Defaults match ``TrainingArguments``.

    Example:
        ```bash
        HF_EFF_OPTIM=adam8bit HF_EFF_GRADIENT_ACCUMULATION_STEPS=4 accelerate launch train.py
        ```
        ```python
        from hf_efficient.integrations.accelerate import EfficientOptimPlugin, accumulation_windows

        plugin = EfficientOptimPlugin(lr=3e-4)           # keywords override the file and the environment
        accelerator = plugin.create_accelerator()
        model, optimizer, train_dl, scheduler = plugin.prepare(accelerator, model, train_dl,
                                                               num_training_steps=1000)
        ```
    """

    optim: str = _opt("adamw", "optimizer name, short ('adam8bit') or Trainer ('hf_eff_adam8bit')", _optim)
    lr: float = _opt(5e-5, "peak learning rate", _hyper("lr"))
    weight_decay: float = _opt(0.0, "decoupled weight decay of the decay group (norms and biases get none)",
                               _hyper("weight_decay"))
    betas: tuple = _opt((0.9, 0.999), "Adam betas; text 'beta1,beta2' in the environment", _betas)
    eps: float = _opt(1e-8, "Adam epsilon", _hyper("eps"))
    decay_embeddings: bool = _opt(True, "whether embedding matrices are decayed (transformers does)",
                                  _core_option("decay_embeddings"))
    backend: str = _opt(None, "force 'bnb', 'torchao' or 'torch'; None or 'auto': the registry's choice",
                        _core_option("backend"))
    gradient_accumulation_steps: int = _opt(1, "micro-batches per optimizer step (per process)", _at_least(1))
    lr_scheduler_type: str = _opt("linear", f"one of {', '.join(SCHEDULERS)}", _scheduler)
    warmup_steps: int = _opt(0, "linear warm-up, in optimizer steps", _at_least(0))
    warmup_ratio: float = _opt(0.0, "warm-up as a fraction of num_training_steps (instead of warmup_steps)", _ratio)
    optim_args: dict = _opt({}, "backend options, as optim_args text 'k=v,...' or a mapping "
                                "(embedding_state, min_8bit_size, ...)", _optim_args)
    config_file: str = field(default=None, metadata={
        "help": "YAML file of these fields (default: $HF_EFF_CONFIG, else none)", "parse": _path})

    def __post_init__(self):
        self.sources: dict[str, str] = {}
        self._optim_args_sources: dict[str, str] = {}
        explicit = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        layers = []
        path = explicit.get("config_file")
        where = "EfficientOptimPlugin(config_file=...)"
        if path is None and os.environ.get(ENV_PREFIX + "CONFIG"):
            path, where = os.environ[ENV_PREFIX + "CONFIG"], ENV_PREFIX + "CONFIG"
        if path is not None:
            path = _path(path, where)
            layers.append(self._yaml_layer(path))
        layers.append(self._env_layer())
        layers.append({k: (v, f"EfficientOptimPlugin({k}=...)") for k, v in explicit.items() if k != "config_file"})

        values = {f.name: f.metadata["default"] for f in fields(self) if f.name != "config_file"}
        self.sources = {k: "default" for k in values}
        optim_args: dict[str, tuple[Any, str]] = {}
        for layer in layers:
            for key, (raw, src) in self._lift_core_options(layer).items():
                value = _field_parser(key)(raw, src)
                if key == "optim_args":
                    optim_args.update({k: (v, src) for k, v in value.items()})
                else:
                    values[key], self.sources[key] = value, src
        for key, value in values.items():
            object.__setattr__(self, key, value)
        self.config_file = path
        self.optim_args = {k: v for k, (v, _) in optim_args.items()}
        self._optim_args_sources = {k: s for k, (_, s) in optim_args.items()}
        self._check_combination()

    # -- sources ----------------------------------------------------------------------------------------
    @staticmethod
    def _yaml_layer(path: str) -> dict:
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
        known = [f.name for f in fields(EfficientOptimPlugin) if f.name != "config_file"]
        for key in data:
            if key not in known:
                close = _suggest(str(key), known)
                hint = f" Did you mean {close!r}?" if close else ""
                raise ValueError(f"{path}: unknown key {key!r}.{hint} Known keys: {', '.join(known)}")
        return {k: (v, f"{path}: {k}") for k, v in data.items()}

    @staticmethod
    def _env_layer() -> dict:
        known = {ENV_PREFIX + f.name.upper(): f.name for f in fields(EfficientOptimPlugin) if f.name != "config_file"}
        layer = {}
        for var, value in os.environ.items():
            if var in known:
                layer[known[var]] = (value, var)
            elif var.startswith(ENV_PREFIX) and var != ENV_PREFIX + "CONFIG":
                # other tools may own HF_EFF_* names too: only a near miss of ours is worth a warning
                trainer_name = _TRAINER_NAMES.get(var[len(ENV_PREFIX):].lower())
                close = ENV_PREFIX + trainer_name.upper() if trainer_name else _suggest(var, list(known), cutoff=0.85)
                if close:
                    logger.warning("hf_efficient: ignoring unknown variable %s (did you mean %s?)", var, close)
        # `accelerate launch --gradient_accumulation_steps N` exports this; it must agree with ours if both are set.
        if os.environ.get(ACCELERATE_GA_ENV):
            acc = (os.environ[ACCELERATE_GA_ENV], ACCELERATE_GA_ENV)
            ours = layer.get("gradient_accumulation_steps")
            if ours is not None and _at_least(1)(ours[0], ours[1]) != _at_least(1)(*acc):
                raise ValueError(f"{ours[1]}={ours[0]} and {ACCELERATE_GA_ENV}={acc[0]} disagree: set one of them")
            layer.setdefault("gradient_accumulation_steps", acc)
        return layer

    @staticmethod
    def _lift_core_options(layer: dict) -> dict:
        """``backend`` / ``decay_embeddings`` written inside optim_args set the field, at that source's rank."""
        if "optim_args" not in layer:
            return layer
        raw, src = layer["optim_args"]
        args = _optim_args(raw, src)
        out = dict(layer)
        for key in ("backend", "decay_embeddings"):
            if key in args:
                value = args.pop(key)
                if key in layer and _field_parser(key)(layer[key][0], layer[key][1]) != _field_parser(key)(value, src):
                    raise ValueError(f"{src} sets {key}={value!r} but {layer[key][1]} sets {key}={layer[key][0]!r}")
                out[key] = (value, f"{src} ({key})")
        out["optim_args"] = (args, src)
        return out

    def _check_combination(self) -> None:
        spec = get_spec(self.optim)
        by_source: dict[str, dict] = {}
        for key, value in self.optim_args.items():
            by_source.setdefault(self._optim_args_sources[key], {})[key] = value
        for src, given in by_source.items():  # the core's parser, once per source so errors name it
            parse_options(spec.name, spec.options, given, source=f"{src} (optim_args)")
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError(f"warmup_steps={self.warmup_steps} ({self.sources['warmup_steps']}) and warmup_ratio="
                             f"{self.warmup_ratio} ({self.sources['warmup_ratio']}) are both set: keep one")
        if self.lr_scheduler_type == "constant" and (self.warmup_steps or self.warmup_ratio):
            raise ValueError(f"lr_scheduler_type='constant' ({self.sources['lr_scheduler_type']}) ignores warm-up: "
                             "use 'constant_with_warmup', or drop the warm-up")

    def describe(self) -> str:
        """One line per field with its value and source, for logs."""
        rows = [f"{k}={getattr(self, k)!r} ({s})" for k, s in self.sources.items() if k != "optim_args"]
        rows += [f"optim_args.{k}={v!r} ({self._optim_args_sources[k]})" for k, v in self.optim_args.items()]
        return "; ".join(rows)

    # -- set-up -------------------------------------------------------------------------------------------
    def create_accelerator(self, **kwargs):
        """An ``Accelerator`` accumulating ``gradient_accumulation_steps`` micro-batches per optimizer step.

        Accumulation is counted in :func:`accumulation_windows` (``sync_with_dataloader=False``), so a short
        last window still steps, at the right boundary. Other keywords go to ``Accelerator``. Unsupported
        distributed combinations are refused here, before a model is loaded.
        """
        from accelerate import Accelerator
        from accelerate.utils import GradientAccumulationPlugin

        for key in ("gradient_accumulation_steps", "gradient_accumulation_plugin"):
            if key in kwargs:
                raise ValueError(f"create_accelerator({key}=...): set gradient_accumulation_steps on the plugin "
                                 f"(or {ENV_PREFIX}GRADIENT_ACCUMULATION_STEPS) so the loss scaling agrees with it")
        ga = GradientAccumulationPlugin(num_steps=self.gradient_accumulation_steps, sync_with_dataloader=False)
        accelerator = Accelerator(gradient_accumulation_plugin=ga, **kwargs)
        self._check_accelerator(accelerator)
        if accelerator.is_main_process:
            logger.info("hf_efficient accelerate config: %s", self.describe())
        return accelerator

    def _check_accelerator(self, accelerator) -> tuple[str | None, str]:
        """Refuse an unsupported set-up; return the backend to force (None: the registry's) and why."""
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world > 1 and accelerator.num_processes != world:
            # Accelerate joins processes only through a backend it knows for the device: without a GPU, gloo.
            fix = ("under DeepSpeed without a GPU, name the backend: create_accelerator(kwargs_handlers=["
                   "InitProcessGroupKwargs(backend='gloo')]) (and DS_ACCELERATOR=cpu)"
                   if accelerator.distributed_type.value == "DEEPSPEED" else
                   "without a GPU set ACCELERATE_USE_CPU=true (or create_accelerator(cpu=True))")
            raise RuntimeError(
                f"launched as {world} processes (WORLD_SIZE={world}) but Accelerate runs this one as "
                f"{accelerator.num_processes} of {accelerator.distributed_type.value}: the processes would train "
                f"independently. Fix: {fix}.")
        chosen = choose_backend(self.optim, self.backend, self._core_options(), accelerator.state, accelerator.device,
                                plugin_ga=(self.gradient_accumulation_steps, self.sources["gradient_accumulation_steps"]))
        if accelerator.gradient_accumulation_steps != self.gradient_accumulation_steps:
            raise ValueError(
                f"the Accelerator accumulates {accelerator.gradient_accumulation_steps} micro-batches but the plugin "
                f"says gradient_accumulation_steps={self.gradient_accumulation_steps} "
                f"({self.sources['gradient_accumulation_steps']}): create it with plugin.create_accelerator()")
        if accelerator.gradient_state.sync_with_dataloader:
            raise ValueError("the Accelerator was made with sync_with_dataloader=True, which steps when the loader "
                             "is exhausted, before a prefetched window is done: use plugin.create_accelerator()")
        return chosen

    def _core_options(self) -> dict:
        # backend only when forced: hf_eff_auto has no backend option (the name it picks resolves its own)
        forced = {} if self.backend is None else {"backend": self.backend}
        return {**self.optim_args, "decay_embeddings": self.decay_embeddings, **forced}

    def create_optimizer(self, model, backend: str | None = None) -> torch.optim.Optimizer:
        """The optimizer alone (decay groups, backend by the registry), for a loop that prepares it itself."""
        options = self._core_options()
        if backend is not None:
            options["backend"] = backend
        sources = sorted(set(self._optim_args_sources.values()))
        source = "EfficientOptimPlugin" + (f" optim_args from {', '.join(sources)}" if sources else "")
        return build_optimizer(model, self.optim, options, source=source, lr=self.lr, weight_decay=self.weight_decay,
                               betas=self.betas, eps=self.eps)

    def create_scheduler(self, optimizer, num_training_steps: int | None, steps_per_update: int = 1):
        """The LR schedule over ``num_training_steps`` optimizer steps.

        ``steps_per_update``: how often the scheduler is stepped per optimizer step. Accelerate's prepared
        scheduler steps ``num_processes`` times (unless ``split_batches``), so lengths are stretched by it and the
        learning rate after k optimizer steps is the same for any number of processes.
        """
        kind = self.lr_scheduler_type
        if num_training_steps is None and (kind in _NEED_TOTAL or self.warmup_ratio):
            raise ValueError(f"lr_scheduler_type={kind!r}{' with warmup_ratio' if self.warmup_ratio else ''} needs "
                             "num_training_steps (optimizer steps): pass it to plugin.prepare()")
        if num_training_steps is not None:
            num_training_steps = _at_least(1)(num_training_steps, "num_training_steps")
        warmup = self.warmup_steps or math.ceil(self.warmup_ratio * (num_training_steps or 0))
        self.resolved_warmup_steps = warmup
        total = None if num_training_steps is None else num_training_steps * steps_per_update
        warmup *= steps_per_update
        if _have_transformers():
            from transformers import get_scheduler

            return get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=total)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, _lambda_schedule(kind, warmup, total))

    def prepare(self, accelerator, model, *dataloaders, num_training_steps: int | None = None):
        """Build optimizer and scheduler for ``model`` and pass everything through ``accelerator.prepare``.

        Returns:
            ``model, optimizer, *dataloaders, scheduler``, prepared (the order ``accelerator.prepare`` would
            give for ``prepare(model, optimizer, *dataloaders, scheduler)``).
        """
        backend, why = self._check_accelerator(accelerator)
        if getattr(accelerator.state, "fsdp_plugin", None) is None and accelerator.device_placement:
            model = model.to(accelerator.device)  # resolve the backend (and fused kernels) for the real device
        optimizer = self.create_optimizer(model, backend=backend)
        split = accelerator.split_batches or not accelerator.step_scheduler_with_optimizer
        scheduler = self.create_scheduler(optimizer, num_training_steps,
                                          steps_per_update=1 if split else accelerator.num_processes)
        fp32_flags = _fp32_state_flags(optimizer)
        prepared = accelerator.prepare(model, optimizer, *dataloaders, scheduler)
        _restore_fp32_state_ids(prepared[1], fp32_flags)
        _drop_stale_param_names(prepared[1])
        info = optimizer_info(prepared[1])
        if accelerator.is_main_process:
            logger.info("hf_efficient: %s%s -> backend %s (%s%s); schedule %s over %s steps, %d warm-up; "
                        "gradient accumulation %d x %d processes", PREFIX, info.resolution.name,
                        info.resolution.backend, info.resolution.reason, f"; {why}" if why else "",
                        self.lr_scheduler_type, num_training_steps, self.resolved_warmup_steps,
                        self.gradient_accumulation_steps, accelerator.num_processes)
        return prepared


def _field_parser(name: str) -> Callable:
    return EfficientOptimPlugin.__dataclass_fields__[name].metadata["parse"]


def _lambda_schedule(kind: str, warmup: int, total: int | None) -> Callable[[int], float]:
    """transformers' schedules that the plugin offers without it (same formulas)."""
    def f(step: int) -> float:
        if step < warmup and kind != "constant":
            return step / max(1, warmup)
        if kind.startswith("constant"):
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))  # cosine, half a cycle
    return f


# The optimizer wrappers that keep 32-bit state for chosen parameters know them by id(); FSDP2 preparation
# swaps every parameter for a DTensor in place (same group, same position), so the ids are re-taken after it.
def _fp32_state_flags(optimizer) -> list[list[bool]] | None:
    ids = getattr(optimizer, "_fp32_ids", None)
    if not ids:
        return None
    return [[id(p) in ids for p in g["params"]] for g in optimizer.param_groups]


def _restore_fp32_state_ids(optimizer, flags) -> None:
    if flags is None:
        return
    inner = optimizer
    while not hasattr(inner, "_fp32_ids") and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    inner._fp32_ids = {id(p) for g, fl in zip(inner.param_groups, flags) for p, keep in zip(g["params"], fl) if keep}


def _drop_stale_param_names(optimizer) -> None:
    """Forget ``param_names`` of groups whose parameters a wrapper replaced (DeepSpeed ZeRO: one flat partition
    per group). They no longer name the group's tensors, and a checkpoint matched by them would be refused as
    corrupt; without them it is matched by position, as torch does."""
    inner = optimizer
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    for g in inner.param_groups:
        if len(g.get("param_names", g["params"])) != len(g["params"]):
            del g["param_names"]


# ------------------------------------------------------------------------------------ distributed support
# The tables and checks live in integrations/distributed.py (the Trainer asks them too); here they read an
# Accelerator's state.

def choose_backend(name: str, backend: str | None, options: Mapping, state, device,
                   plugin_ga: tuple[int, str] | None = None) -> tuple[str | None, str]:
    """The backend to force for this distributed set-up (None: leave it to the registry), and why.

    No set-up needs another backend than the registry's: under FSDP2 the only 8-bit backend that runs on
    DTensor shards is torchao, which is never chosen for a user (see ``distributed.FSDP2_INSTEAD``), so
    :func:`check_distributed_support` refuses there instead of switching.
    """
    check_distributed_support(name, backend, options, state, plugin_ga, device=device)
    return backend, ""


def _dist_type(state) -> str:
    t = getattr(state, "distributed_type", "NO")
    return getattr(t, "value", str(t)).upper()


def check_distributed_support(name: str, backend: str | None, options: Mapping, state,
                              plugin_ga: tuple[int, str] | None = None, device="cpu") -> None:
    """Raise ValueError, saying what to use instead, if ``name``/``backend`` cannot run under ``state``.

    Args:
        name: optimizer name; backend: the forced backend, or None for the registry's choice on ``device``.
        options: core options (``embedding_state``, ...); state: ``accelerator.state`` or anything with
            ``distributed_type`` and ``fsdp_plugin`` / ``deepspeed_plugin``.
        plugin_ga: (gradient_accumulation_steps, its source), compared with a DeepSpeed config's.
    """
    dist = _dist_type(state)
    if dist == "FSDP":
        check_fsdp(name, backend, version=getattr(getattr(state, "fsdp_plugin", None), "fsdp_version", 1),
                   device=device)
    elif dist == "DEEPSPEED":
        ds = getattr(state, "deepspeed_plugin", None)
        check_deepspeed(name, backend, options, getattr(ds, "deepspeed_config", None), device=device,
                        offload=getattr(ds, "offload_optimizer_device", None), plugin_ga=plugin_ga,
                        config_ga=getattr(ds, "gradient_accumulation_steps", "auto"))


# ---------------------------------------------------------------------------------- exact accumulation

@dataclass
class AccumulationWindow:
    """The micro-batches of one optimizer step, with the target-token count of the whole step.

    Attributes:
        batches: this process's micro-batches.
        num_items: target tokens in the window, summed over every micro-batch on every process.
        factor: what :meth:`scale` multiplies a summed loss by.
    """

    batches: list
    num_items: int
    factor: float

    def __iter__(self) -> Iterator:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)

    def scale(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The loss to give ``accelerator.backward`` for a micro-batch whose loss, summed over tokens, is ``loss_sum``.

        Accelerate divides by the accumulation steps and DDP/FSDP/DeepSpeed average over processes; this
        undoes both and divides by the window's token count, so the update uses the big batch's token mean.
        """
        return loss_sum * self.factor


def _count_labels(labels_key: str, ignore_index: int) -> Callable[[Any], torch.Tensor]:
    def count(batch):
        return (batch[labels_key] != ignore_index).sum()
    return count


def accumulation_windows(accelerator, dataloader: Iterable, *, labels_key: str = "labels", ignore_index: int = -100,
                         count: Callable[[Any], int | torch.Tensor] | None = None) -> Iterator[AccumulationWindow]:
    """Group ``dataloader`` into windows of ``gradient_accumulation_steps`` micro-batches, one per optimizer step.

    Each window's target tokens are counted over all its micro-batches on all processes (one all-reduce per
    window) before the first backward, and ``accelerator.accumulate`` is told to synchronise on the window's
    last micro-batch, so a short last window still makes a correct step.

    Args:
        accelerator: from :meth:`EfficientOptimPlugin.create_accelerator` (``sync_with_dataloader=False``).
        dataloader: the prepared training loader (all processes must yield the same number of batches,
            Accelerate's default ``even_batches``).
        labels_key, ignore_index: targets are ``batch[labels_key] != ignore_index``.
        count: a different count per batch, e.g. ``lambda b: (b["labels"][:, 1:] != -100).sum()`` for a causal
            LM that shifts labels inside the model.
    """
    if accelerator.gradient_state.sync_with_dataloader:
        raise ValueError("accumulation_windows prefetches a window, so the Accelerator must not sync on the end of "
                         "the dataloader: create it with EfficientOptimPlugin.create_accelerator() (or "
                         "GradientAccumulationPlugin(num_steps=N, sync_with_dataloader=False))")
    count = count or _count_labels(labels_key, ignore_index)
    steps = accelerator.gradient_accumulation_steps
    it = iter(dataloader)
    while batches := list(islice(it, steps)):
        local = sum(torch.as_tensor(count(b), dtype=torch.long, device=accelerator.device) for b in batches)
        total = int(accelerator.reduce(local, reduction="sum")) if accelerator.num_processes > 1 else int(local)
        # accumulate() syncs when its counter reaches a multiple of `steps`: start it so that happens on our last.
        accelerator.step = steps - len(batches)
        yield AccumulationWindow(batches, total, accelerator.num_processes * steps / max(total, 1))


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy summed (not averaged) over the target tokens of a batch, in fp32, for :meth:`AccumulationWindow.scale`."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=ignore_index,
                           reduction="sum")
