"""One parser for optimizer options, whether they come as ``optim_args`` text or as Python keywords.

``TrainingArguments(optim_args="embedding_state=8bit,nonfinite=skip")`` and
``create_optimizer(model, "adam8bit", embedding_state="8bit", nonfinite="skip")`` go through the same
table, so a key accepted in one place is accepted in the other, with the same meaning and checks.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["Option", "OPTIONS", "parse_options", "parse_optim_args", "check_hyperparams", "check_group", "check_unique",
           "check_flags", "check_step", "refuse_sparse", "check_saved"]

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


@dataclass(frozen=True)
class Option:
    """One accepted option: its type, default, allowed values and a line of help."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple = ()
    optional: bool = False  # None is a valid value
    check: Callable[[Any], bool] | None = None
    check_text: str = ""
    none_words: tuple[str, ...] = ("none",)  # text that means None, where None is valid
    help_none: str = "unset"  # what None means, in messages

    def coerce(self, value: Any, source: str) -> Any:
        """Convert ``value`` (text from optim_args, or a Python value) to this option's type, or raise."""
        where = f"{source}: option {self.name!r}"
        # "none" is None only where None is allowed; elsewhere it may be a choice (compensation=none)
        if value is None or (self.optional and isinstance(value, str) and value.strip().lower() in self.none_words):
            if self.optional:
                return None
            raise ValueError(f"{where} cannot be None")
        if self.type is bool:
            if isinstance(value, bool):
                out = value
            elif isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
                out = value.strip().lower() in _TRUE
            else:
                raise ValueError(f"{where} must be true or false, got {value!r}")
        elif self.type in (int, float):
            if isinstance(value, bool):
                raise ValueError(f"{where} must be a number, got {value!r}")
            try:
                out = self.type(value.strip() if isinstance(value, str) else value)
            except (TypeError, ValueError):
                raise ValueError(f"{where} must be {'an integer' if self.type is int else 'a number'}, got {value!r}") from None
            if self.type is int and isinstance(value, float) and value != out:
                raise ValueError(f"{where} must be an integer, got {value!r}")
            if self.type is float and not math.isfinite(out):
                raise ValueError(f"{where} must be a finite number, got {value!r}")
        else:
            out = str(value).strip()
        if self.choices and out not in self.choices:
            nothing = f" (or {' / '.join(map(repr, self.none_words))}: {self.help_none})" if self.optional else ""
            raise ValueError(f"{where} must be one of {list(self.choices)}{nothing}, got {value!r}")
        if self.check is not None and not self.check(out):
            raise ValueError(f"{where} {self.check_text}, got {value!r}")
        return out

    def check_value(self, value: Any, where: str) -> None:
        """Refuse ``value`` as this option's value in a param group (a Python value: text is not converted there),
        naming the value and what is valid."""
        number = self.type is float and isinstance(value, (int, float))
        fits = isinstance(value, bool) == (self.type is bool) and (isinstance(value, self.type) or number or (
            value is None and self.optional))
        try:
            fits = fits and self.coerce(value, where) == value
        except ValueError:
            fits = False
        if not fits:
            kind = f"one of {list(self.choices)}" if self.choices else f"a {self.type.__name__}"
            raise ValueError(f"{where}: invalid {self.name}={value!r}: expected {kind}"
                             f"{' or None' if self.optional else ''}{'; it ' + self.check_text if self.check_text else ''}")


def _positive(x) -> bool:
    return x > 0


OPTIONS: dict[str, Option] = {
    o.name: o
    for o in [
        # "auto" as the accelerate plugin always took it, so that every entry point gives one verdict
        Option("backend", str, None, "force a backend instead of the registry's choice", ("bnb", "torchao", "torch"),
               optional=True, none_words=("none", "auto"), help_none="the registry's choice"),
        Option("decay_embeddings", bool, True, "apply weight decay to embedding matrices (transformers does)"),
        Option("nonfinite", str, "raise", "what a step does with an inf/NaN gradient", ("raise", "skip", "ignore")),
        Option("embedding_state", str, "32bit", "state precision of embedding matrices: 32-bit, or the name's quantized "
               "state (8bit for the 8-bit names, 4bit for adam4bit)", ("32bit", "8bit", "4bit")),
        Option("min_8bit_size", int, 4096, "tensors with fewer elements keep 32-bit state", check=_positive, check_text="must be > 0"),
        Option("compensation", str, "auto", "how an update reaches bf16/fp16 weights (auto: the name's default, "
               "measured per family; no-op on fp32 weights)", ("auto", "kahan", "stochastic", "none")),
        Option("gradient_release", bool, False, "step each tensor inside backward and free its gradient "
               "(hf_efficient.release: one gradient alive at a time; no accumulation, clipping or fp16 scaler)"),
        Option("budget_gb", float, None, "hf_eff_auto: memory budget instead of the device's free memory", optional=True,
               check=_positive, check_text="must be > 0"),
    ]
}


def _unknown_key_error(key: str, accepted: list[str], source: str, name: str) -> ValueError:
    close = difflib.get_close_matches(key, accepted, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(f"{source}: unknown option {key!r} for {name!r}.{hint} Accepted: {', '.join(sorted(accepted))}")


def parse_options(name: str, accepted: tuple[str, ...] | Mapping[str, Option], given: Mapping[str, Any],
                  source: str = "options") -> dict:
    """Validate ``given`` against the options ``accepted`` by optimizer ``name``; fill in defaults.

    Args:
        name: optimizer short name, for messages.
        accepted: option keys this optimizer takes (in :data:`OPTIONS`), or key -> Option (a spec's ``accepted``,
            its family's own options included).
        given: raw values (text from optim_args or Python values).
        source: where the values came from, named in errors (``optim_args``, ``create_optimizer``, a file).
    """
    table = accepted if isinstance(accepted, Mapping) else {k: OPTIONS[k] for k in accepted}
    out = {k: o.default for k, o in table.items()}
    for key, value in given.items():
        if key not in table:
            raise _unknown_key_error(key, list(table), source, name)
        out[key] = table[key].coerce(value, source)
    return out


def parse_optim_args(text: str | None) -> dict[str, str]:
    """Split ``"a=1, b=x"`` into ``{"a": "1", "b": "x"}``; malformed pieces raise with the piece named."""
    if not text:
        return {}
    out: dict[str, str] = {}
    for piece in text.split(","):
        piece = piece.strip()
        if not piece:
            continue
        key, sep, value = piece.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"optim_args: {piece!r} is not of the form key=value (text was {text!r})")
        key = key.strip()
        if key in out:
            raise ValueError(f"optim_args: {key!r} is given twice (text was {text!r})")
        out[key] = value.strip()
    return out


def _number(value) -> bool:
    """A plain real number: not a bool, not a tensor (a tensor lr is refused everywhere, consistently)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_hyperparams(*, lr: float, betas: tuple[float, float] | None = None, eps: float | None = None,
                      weight_decay: float = 0.0) -> None:
    """Refuse hyperparameters no optimizer should accept, naming the value (shared by every optimizer).

    Infinite ``lr`` / ``weight_decay`` and ``eps <= 0`` are refused as well as negative values: one step with any
    of them makes weights non-finite (``eps = 0`` divides by a zero second moment).
    """
    if not _number(lr) or not 0.0 <= lr < math.inf:
        raise ValueError(f"Invalid learning rate lr={lr!r}: it must be a finite number >= 0")
    if betas is not None:
        if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
            raise ValueError(f"Invalid betas={betas!r}: expected a pair (beta1, beta2), e.g. betas=(0.9, 0.999)")
        for i, b in enumerate(betas):
            if not _number(b) or not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta{i + 1}={b!r} in betas={tuple(betas)!r}: each must be in [0, 1)")
    if eps is not None and (not _number(eps) or not 0.0 < eps < math.inf):
        raise ValueError(f"Invalid eps={eps!r}: it must be a finite number > 0 (it keeps the update finite where the "
                         "second moment is 0)")
    if not _number(weight_decay) or not 0.0 <= weight_decay < math.inf:
        raise ValueError(f"Invalid weight_decay={weight_decay!r}: it must be a finite number >= 0")


def check_unique(named, existing=(), owner: str = "") -> None:
    """Refuse a parameter listed twice (in one group, across groups, or already in the optimizer): it would be
    stepped twice per step (torch only warns), and a kernel updating both copies at once races.

    Args:
        named: (name, tensor) pairs to add; a name is a noun phrase ("parameter 'encoder.weight'").
        existing: (name, tensor) pairs already in the optimizer.
        owner: optimizer named first in the message.
    """
    seen = {id(p): n for n, p in existing}
    for name, p in named:
        if id(p) in seen:
            shape = tuple(p.shape) if hasattr(p, "shape") else None
            raise ValueError(f"{owner + ': ' if owner else ''}{name} (shape {shape}) is the same tensor as "
                             f"{seen[id(p)]}: it would be updated twice per step, by kernels racing on it. List each "
                             "parameter once (a tied weight is listed once; model.parameters() does that)")
        seen[id(p)] = name


def check_flags(group: dict, implemented, owner: str) -> None:
    """Refuse group flags that change the math (``maximize``, ``amsgrad``) where the optimizer does not implement
    them (``implemented``: the keys it does): it would silently ignore them."""
    for key in ("maximize", "amsgrad"):
        if group.get(key, False) and key not in implemented:
            fix = "Negate the loss instead (loss = -objective) and drop the 'maximize' key" if key == "maximize" \
                else "Use hf_eff_adamw"
            raise ValueError(f"{owner} got {key}={group[key]!r} in a param group, which it does not implement (it "
                             f"would be ignored). {fix}")


def check_group(optimizer, param_group, owner: str, check: Callable[[dict], None] | None = None):
    """``param_group`` ready for ``Optimizer.add_param_group``, or a ValueError before anything changed: the one group
    check of this package's optimizer classes (construction, later groups and loaded groups refuse the same values).

    Every hyperparameter the group has through :func:`check_hyperparams`, ``maximize`` / ``amsgrad`` refused, no
    parameter twice (a generator is read once, here); ``check(group)`` adds the family's own checks. ``optimizer``:
    the optimizer the group joins (its defaults complete the group, its groups count for duplicates), or None for a
    complete group alone (a saved one, whose parameters are ids).
    """
    if not isinstance(param_group, dict):
        return param_group  # torch's own TypeError
    defaults, groups = (optimizer.defaults, optimizer.param_groups) if optimizer is not None else ({}, [])
    params = param_group.get("params")
    if params is not None and not isinstance(params, set):  # a set: torch's own TypeError (unordered)
        params = [params] if hasattr(params, "shape") else list(params)
        param_group = {**param_group, "params": params}
        check_unique(((f"parameter {i} of the new param group", p) for i, p in enumerate(params)),
                     [(f"parameter {i} of param group {gi}", p) for gi, g in enumerate(groups)
                      for i, p in enumerate(g["params"])], owner)
    group = {**defaults, **param_group}
    check_flags(group, (), owner)
    has_eps = "eps" in (defaults if optimizer is not None else group)  # Lion has none (bnb's stores an unused 0.0)
    check_hyperparams(lr=group["lr"], betas=group.get("betas"), eps=group["eps"] if has_eps else None,
                      weight_decay=group.get("weight_decay", 0.0))
    if check is not None:
        check(group)
    return param_group


def check_step(step, where: str) -> None:
    """A saved ``step``: a whole number >= 0, or a one-element tensor holding one (torch accepts a Python number)."""
    value = step.item() if hasattr(step, "numel") and step.numel() == 1 else step
    # a tensor, a bool, complex, text, nan, inf, < 0, or a fraction (steps are counted, never interpolated)
    if not _number(value) or not 0 <= value < math.inf or value != int(value):
        shown = f"a tensor of shape {tuple(step.shape)}" if hasattr(value, "shape") else repr(value)
        raise ValueError(f"{where} has step {shown}: a step count must be a whole number >= 0 or a one-element "
                         "tensor holding one; the checkpoint is corrupt or was edited. Nothing was loaded")


# |first moment| of any real state is below this: it is an average of past gradients (AdamW, Lion: |m| <= max |g|;
# Adafactor: of updates clipped to an RMS of clip_threshold), and the guard refuses a gradient of magnitude 2**64
# or more (its square overflows fp32: guard.OVERFLOW). Second moments need no bound of their own: finite is already
# below 2**128, that bound's square.
FIRST_MOMENT_BOUND = 2.0**64


def check_saved_tensor(value, key: str, where: str, *, signed: bool, first_moment: bool = False) -> None:
    """A saved floating-point state tensor (a moment, a per-block absmax of one, a Kahan buffer): finite, >= 0 unless
    ``signed``, and below :data:`FIRST_MOMENT_BOUND` in magnitude where it is (the absmax of) a ``first_moment``.
    An edited checkpoint beyond these would move the weights by absurd amounts on the first step."""
    problem = None
    if not bool(value.isfinite().all()):
        problem = "non-finite values"
    elif not signed and bool((value < 0).any()):
        problem = "negative values, which a second moment or an absmax never holds"
    elif first_moment and bool((value.abs() >= FIRST_MOMENT_BOUND).any()):
        problem = (f"values of magnitude {value.abs().max().item():.3g}, beyond what any first moment reaches (an "
                   "average of past gradients, each below 2**64 or refused by the nonfinite guard)")
    if problem is not None:
        raise ValueError(f"{where} has {key} holding {problem}: training from it would move the weights by absurd "
                         "amounts or make them non-finite; the checkpoint is corrupt or was edited. Resume from an "
                         "earlier checkpoint, or start the optimizer afresh. Nothing was loaded")


def refuse_sparse(optimizer, owner: str) -> None:
    """Refuse sparse gradients before any tensor is updated: a step is done whole or not at all."""
    for gi, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if p.grad is not None and p.grad.is_sparse:
                raise RuntimeError(f"{owner} does not support sparse gradients (parameter {i} of param group {gi}, "
                                   f"shape {tuple(p.shape)}); nothing was updated. Use dense gradients (e.g. "
                                   "nn.Embedding(..., sparse=False)) or torch.optim.SparseAdam for that parameter")


def run_closure(closure):
    """torch's closure protocol: ``closure()`` recomputes the loss and gradients, with grad enabled (a step runs
    under no_grad); None without a closure."""
    if closure is None:
        return None
    import torch

    with torch.enable_grad():
        return closure()


def start_step(optimizer, closure, owner: str):
    """What every step of this package's optimizers does first: :func:`run_closure`, then :func:`refuse_sparse`.
    Returns the closure's loss (None without one)."""
    loss = run_closure(closure)
    refuse_sparse(optimizer, owner)
    return loss


def check_saved(optimizer, state_dict, family: str, check_family_keys: Callable | None = None) -> None:
    """Before ``load_state_dict`` changes anything: every saved ``step`` (:func:`check_step`) and, given the family's
    own group check, every saved group completed with the optimizer's defaults (:func:`check_group`). A ValueError
    names the parameter or group; nothing was loaded."""
    where = f"{family}.load_state_dict"
    if isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict):
        groups = state_dict.get("param_groups")
        listed = {i for g in groups if isinstance(g, dict) for i in g.get("params", ())} if isinstance(
            groups, list) else set()
        for i, saved in state_dict["state"].items():
            # a parameter's state is a dict; other keys (a hook's flag) are torch's to carry as they are
            if i in listed and not isinstance(saved, dict):
                raise ValueError(f"{where}: the state of parameter {i} is a {type(saved).__name__}, not a dict of "
                                 "state tensors: the checkpoint is corrupt; nothing was loaded")
            if isinstance(saved, dict) and "step" in saved:
                check_step(saved["step"], f"{where}: parameter {i}")
    if check_family_keys is not None and isinstance(state_dict, dict) and isinstance(
            state_dict.get("param_groups"), list):
        for gi, g in enumerate(state_dict["param_groups"]):
            try:
                check_group(None, {**optimizer.defaults, **g, "params": ()}, family, check_family_keys)
            except ValueError as e:
                raise ValueError(f"{where}: saved param group {gi}: {e}; nothing was loaded") from e
