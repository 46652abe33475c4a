"""The one table of optimizer names, and :func:`resolve`, which picks a backend for a device.

Rule: a name lists its backends; each backend says which device types it serves from which package
version. For a device, the first backend in the name's preference order for that device type that is
installed and serves it wins; ``backend=...`` forces one and fails loudly if it cannot serve.
"""

from __future__ import annotations

import difflib
import logging
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import backends
from .optional import install_hint, version_of

__all__ = ["Backend", "OptimizerSpec", "Resolution", "SPECS", "PREFIX", "get_spec", "resolve", "available_optimizers"]

logger = logging.getLogger(__name__)
PREFIX = "hf_eff_"


@dataclass(frozen=True)
class Backend:
    """An implementation of a name: which package provides it, which devices it serves, how to build it."""

    name: str  # "bnb" | "torchao" | "torch"
    package: str | None  # pip package providing it; None: torch / this package
    min_version: dict[str, str]  # device type ("cuda", "cpu", "*": any) -> oldest package version serving it
    build: Callable  # backends.build_*(groups, *, hyper..., options, fp32_state_params, device)
    needs: Callable[[str], str | None] | None = None  # device type -> why it cannot run here, or None

    def serves(self, device_type: str) -> bool:
        return device_type in self.min_version or "*" in self.min_version

    def why_not(self, device_type: str) -> str | None:
        """None if usable on ``device_type`` here, else the reason (not installed, too old, wrong device)."""
        if not self.serves(device_type):
            return f"{self.name} does not serve {device_type} (serves {', '.join(self.min_version)})"
        if self.needs is not None and (missing := self.needs(device_type)):
            return f"{self.name} {missing}"
        if self.package is None:
            return None
        have = version_of(self.package)
        if have is None:
            return f"{self.name} needs {self.package}, which is not installed ({install_hint(self.package)})"
        need = self.min_version.get(device_type, self.min_version.get("*"))
        if need and have < type(have)(need):
            return f"{self.name} serves {device_type} from {self.package} {need}, installed is {have}"
        return None


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer name: its family, nominal state bytes per parameter, options and backends."""

    name: str
    family: str
    state_bytes: float
    notes: str
    backends: dict[str, Backend]
    prefer: dict[str, tuple[str, ...]]  # device type or "default" -> backend names, best first
    options: tuple[str, ...]
    uses_betas: bool = True
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
    fallback: tuple[str, str] | None = None  # (device type it needs, name to run elsewhere)

    @property
    def trainer_name(self) -> str:
        return PREFIX + self.name

    def order(self, device_type: str) -> tuple[str, ...]:
        return self.prefer.get(device_type, self.prefer["default"])


@dataclass(frozen=True)
class Resolution:
    """What :func:`resolve` decided: the name that runs, its backend, the class built, and why."""

    name: str
    backend: str
    optimizer_cls: type
    reason: str
    spec: OptimizerSpec = field(repr=False)
    device: str = "cpu"


_ANY = {"*": None}
_TORCH_ADAMW = Backend("torch", None, _ANY, backends.build_torch_adamw)
_BNB_8BIT = Backend("bnb", "bitsandbytes", {"cuda": "0.43", "cpu": "0.50"}, backends.build_bnb_adamw8bit)
_BNB_PAGED = Backend("bnb", "bitsandbytes", {"cuda": "0.43"}, backends.build_bnb_paged_adamw8bit)
_TORCH_8BIT = Backend("torch", None, _ANY, backends.build_torch_adamw8bit, needs=backends.compiler_missing)
_TORCHAO_8BIT = Backend("torchao", "torchao", {"cuda": "0.10", "cpu": "0.10"}, backends.build_torchao_adamw8bit)
_TORCH_ADAFACTOR = Backend("torch", None, _ANY, backends.build_adafactor)
_TORCH_BF16 = Backend("torch", None, _ANY, backends.build_adamw_bf16)

# Why torchao is a backend only when forced: its AdamW8bit rounds a small second moment to exactly 0 while the
# first moment stays non-zero, and a later zero gradient then moves the weight by lr * m / eps (4.2 against 0.0017
# for fp32 AdamW in tests/test_adamw8bit.py's case). bitsandbytes and our kernel keep a non-zero floor.
TORCHAO_FLAW = ("torchao's AdamW8bit stores small second moments as exactly 0, so a later zero gradient (dead "
                "units, masked tokens, unused embedding rows) moves those weights by lr * exp_avg / eps, thousands of "
                "times too far")
_COMMON = ("backend", "decay_embeddings", "nonfinite")
_8BIT = _COMMON + ("embedding_state", "min_8bit_size")

SPECS: dict[str, OptimizerSpec] = {
    s.name: s
    for s in [
        OptimizerSpec("adamw", "adamw", 8.0, "AdamW, state in the parameters' dtype (8 B/param on fp32, 4 on bf16/fp16); torch's fused kernel "
                      "where the device has one, else foreach",
                      {"torch": _TORCH_ADAMW}, {"default": ("torch",)}, _COMMON,
                      dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64)),
        OptimizerSpec("adam8bit", "adamw8bit", 2.03,
                      "AdamW math, blockwise 8-bit state; embeddings and tensors < min_8bit_size keep 32-bit state",
                      {"torch": _TORCH_8BIT, "bnb": _BNB_8BIT, "torchao": _TORCHAO_8BIT},
                      # measured (scripts/bench_step.py): on CPU our C kernel is over 10x faster than
                      # bitsandbytes' CPU kernel; on CUDA bitsandbytes' kernels are the reference. torchao is never
                      # chosen automatically: see TORCHAO_FLAW
                      {"cuda": ("bnb", "torch"), "default": ("torch", "bnb")}, _8BIT),
        OptimizerSpec("paged_adam8bit", "adamw8bit", 2.03, "as adam8bit, state paged to host memory (CUDA)",
                      {"bnb": _BNB_PAGED}, {"default": ("bnb",)}, _8BIT, fallback=("cuda", "adam8bit")),
        OptimizerSpec("adafactor", "adafactor", 0.0,
                      "factored second moment (row + column statistics); lr is the step size",
                      {"torch": _TORCH_ADAFACTOR}, {"default": ("torch",)},
                      _COMMON + ("beta1", "decay_rate", "clip_threshold"), uses_betas=False),
        OptimizerSpec("adamw_bf16", "adamw_bf16", 6.0,
                      "AdamW on bf16 params: bf16 m, v and Kahan compensation; no fp32 master copy",
                      {"torch": _TORCH_BF16}, {"default": ("torch",)}, _COMMON + ("compensation",)),
    ]
}
# hf_eff_auto is no optimizer of its own: create_optimizer picks one of the above from the model's predicted
# footprint (memory.choose_auto) and passes on the options that name takes.
SPECS["auto"] = OptimizerSpec(
    "auto", "auto", float("nan"), "the most accurate of adamw > adamw_bf16 (bf16 models) > adam8bit > adafactor "
    "whose predicted params + grads + state fit free memory (or budget_gb)", {}, {"default": ()},
    tuple(sorted({o for s in SPECS.values() for o in s.options} - {"backend"})) + ("budget_gb",))


def available_optimizers() -> list[str]:
    """Every Trainer name this package registers, sorted."""
    return sorted(s.trainer_name for s in SPECS.values())


def get_spec(name: str) -> OptimizerSpec:
    """The spec of a short (``"adam8bit"``) or Trainer (``"hf_eff_adam8bit"``) name, or a ValueError listing all."""
    key = name.value if hasattr(name, "value") else str(name)
    short = key[len(PREFIX):] if key.startswith(PREFIX) else key
    if short in SPECS:
        return SPECS[short]
    names = available_optimizers()
    close = difflib.get_close_matches(key if key.startswith(PREFIX) else PREFIX + key, names, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"Unknown hf_efficient optimizer {key!r}.{hint} Registered names: {', '.join(names)}. "
                     "Short names without the 'hf_eff_' prefix ('adam8bit') work in create_optimizer, resolve, "
                     "estimate_memory and the accelerate plugin; TrainingArguments(optim=...) needs the full "
                     "hf_eff_ name.")


_logged: set[tuple] = set()


def _log_once(res: Resolution) -> None:
    key = (res.name, res.backend, res.device)
    if key not in _logged:
        _logged.add(key)
        logger.info("hf_efficient: %s%s on %s -> backend %s (%s)", PREFIX, res.name, res.device, res.backend, res.reason)


def resolve(name: str, device: str | torch.device = "cpu", backend: str | None = None, *,
            log: bool = True) -> Resolution:
    """Pick the backend that runs ``name`` on ``device``, by the table above, and log the choice once.

    ``log=False`` is for questions rather than choices (memory estimates, ``hf-efficient list``): a user
    should see which backend trains their model, not one for every name an estimate looked at.

    Raises:
        ValueError: unknown name, or a forced ``backend`` the name does not have or that cannot serve the device.
        ImportError: a forced backend whose package is missing (names the pip extra).
        RuntimeError: no backend of the name serves the device here (says what would).
    """
    spec = get_spec(name)
    dev = torch.device(device).type
    if not spec.backends:
        raise ValueError(f"{spec.trainer_name} has no backend of its own: create_optimizer / Trainer choose a name "
                         "for it from the model (hf_efficient.memory.choose_auto); resolve that name instead")
    if spec.fallback and dev != spec.fallback[0]:
        msg = (f"{spec.trainer_name} pages optimizer state through {spec.fallback[0]} unified memory; "
               f"on {dev} it runs as {PREFIX}{spec.fallback[1]} instead")
        if (spec.name, dev) not in _logged:
            _logged.add((spec.name, dev))
            warnings.warn(msg, stacklevel=2)
        res = resolve(spec.fallback[1], dev, backend, log=log)
        return Resolution(res.name, res.backend, res.optimizer_cls, f"{msg}; {res.reason}", res.spec, dev)
    if backend is not None:
        if backend not in spec.backends:
            raise ValueError(f"backend={backend!r} is not a backend of {spec.trainer_name}; it has: "
                             f"{', '.join(spec.backends)}")
        chosen, why_not = spec.backends[backend], spec.backends[backend].why_not(dev)
        if why_not is not None:
            if chosen.package and version_of(chosen.package) is None:
                raise ImportError(f"{spec.trainer_name} with backend={backend!r} needs {chosen.package}, which is "
                                  f"not installed: {install_hint(chosen.package)}")
            raise ValueError(f"backend={backend!r} cannot run {spec.trainer_name} on {dev}: {why_not}. "
                             f"{_what_would_work(spec, dev)}")
        reason = f"forced by backend={backend!r}"
        if backend == "torchao" and (spec.name, dev, "torchao") not in _logged:
            _logged.add((spec.name, dev, "torchao"))
            logger.warning("hf_efficient: %s with backend='torchao' (forced): %s. backend='torch' or 'bnb' do not "
                           "have this flaw.", spec.trainer_name, TORCHAO_FLAW)
    else:
        reasons = []
        for b in spec.order(dev):
            why_not = spec.backends[b].why_not(dev)
            if why_not is None:
                chosen = spec.backends[b]
                break
            reasons.append(why_not)
        else:
            raise RuntimeError(f"No backend of {spec.trainer_name} can run on {dev} here: {'; '.join(reasons)}. "
                               f"{_what_would_work(spec, dev)}")
        pkg = f"{chosen.package} {version_of(chosen.package)}" if chosen.package else "torch " + torch.__version__
        skipped = f"; skipped: {'; '.join(reasons)}" if reasons else ""
        reason = f"first of {' > '.join(spec.order(dev))} usable on {dev} ({pkg}){skipped}"
    res = Resolution(spec.name, chosen.name, chosen.build.optimizer_cls(), reason, spec, dev)
    if log:
        _log_once(res)
    return res


def _what_would_work(spec: OptimizerSpec, dev: str) -> str:
    options = []
    for b in spec.backends.values():
        if b.serves(dev):
            need = b.min_version.get(dev, b.min_version.get("*"))
            options.append(f"backend={b.name} with {b.package}>={need}" if b.package else f"backend={b.name}")
    if options:
        return "What would work: " + ", or ".join(options) + "."
    served = sorted({d for b in spec.backends.values() for d in b.min_version})
    return f"{spec.trainer_name} runs on: {', '.join(served)}; move the model there or choose another name."
