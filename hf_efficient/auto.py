"""``hf_eff_auto``: the most accurate optimizer name whose predicted footprint fits the memory, chosen per model.

Built on :mod:`hf_efficient.memory`'s predictions (the same per-tensor counts :func:`~hf_efficient.estimate_memory`
makes), so the choice and ``hf-efficient estimate`` agree. The choice is logged at INFO with every candidate's
bytes; when nothing fits, the smallest is chosen and a WARNING says so (the Trainer's line says the choice and
:meth:`AutoChoice.why` at WARNING either way: it depends on the free memory). On a sharded model (FSDP2 DTensor
parameters, or ``world_size``/``sharding`` given) each candidate is sized per rank, and a name that cannot train
under that sharding (the registry's ``fsdp2`` / ``deepspeed`` facts) is no candidate.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .memory import MB, Described, MemoryEstimate, UnsupportedSharding, describe_params, predict
from .options import parse_options
from .registry import AUTO_CANDIDATES, PREFIX, get_spec

__all__ = ["choose_auto", "AutoChoice", "free_memory_bytes", "AUTO_MARGIN", "AUTO_ORDER", "AUTO_ORDER_BF16"]

logger = logging.getLogger(__name__)


AUTO_MARGIN = 0.2  # share of the available memory left for activations, the allocator and the CUDA context
# most accurate first; adam4bit (1.06 B/param of state) where 8-bit state (2.03) does not fit: AdamW's math, coarser
# moments (tests/test_adamw4bit.py's tracking), still ahead of Adafactor's factored second moment and no first
AUTO_ORDER = ("adamw", "adam8bit", "adam4bit", "adafactor")
# bf16 models: hf_eff_adamw keeps fp32 moments and writes the weights compensated (8 B/param, 10 under Kahan), so it
# leads; adamw_bf16 (bf16 moments and Kahan buffer, 6 B/param) is the next most accurate where adamw does not fit
AUTO_ORDER_BF16 = AUTO_CANDIDATES  # the registry's list (its options are those auto takes)


@dataclass(frozen=True)
class AutoChoice:
    """What ``hf_eff_auto`` chose, from which candidates, against how much memory."""

    name: str
    options: dict[str, Any]  # the options given, minus those the chosen name does not take
    available_bytes: int
    usable_bytes: int
    source: str  # where available_bytes came from
    candidates: tuple[MemoryEstimate, ...]
    fits: bool

    @property
    def chosen(self) -> MemoryEstimate:
        return next(c for c in self.candidates if c.name == PREFIX + self.name)

    def summary(self) -> str:
        return f"{PREFIX}auto chose {PREFIX}{self.name}, {self.why()}"

    def why(self) -> str:
        """Why this name: the first (most accurate) that fits, against what memory, and what each candidate needs."""
        rows = "; ".join(f"{c.name} needs {_gb(c.total_bytes)} (params {_gb(c.param_bytes)} + grads "
                         f"{_gb(c.grad_bytes)} + state {_gb(c.state_bytes)})" for c in self.candidates)
        verdict = "the first that fits" if self.fits else "the smallest; NONE FITS, expect out-of-memory"
        first = self.candidates[0]
        where = f" per rank of {first.world_size} ({first.sharding})" if first.sharding else ""
        return (f"{verdict}{where}: usable {_gb(self.usable_bytes)} = {1 - AUTO_MARGIN:.0%} of "
                f"{_gb(self.available_bytes)} ({self.source}); {rows}")


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / MB:.2f} MiB"  # binary, as in every message


def free_memory_bytes(device: torch.device | str) -> int:
    """Free memory of ``device``: ``torch.cuda.mem_get_info`` on CUDA, MemAvailable (or psutil) on CPU."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            import psutil

            return int(psutil.virtual_memory().available)
        except ImportError:
            pass
    raise RuntimeError(f"cannot read the free memory of {device}: give it with optim_args='budget_gb=...'")


def choose_auto(model, options: Mapping[str, Any] | None = None, *, device: torch.device | str | None = None,
                param_dtype: torch.dtype | str | None = None, source: str = "options", world_size: int | None = None,
                sharding: str | None = None) -> AutoChoice:
    """Pick the most accurate name whose predicted params + grads + state fit the memory, and log why.

    Candidates, best first: adamw > adam8bit > adam4bit > adafactor; for bf16 models adamw > adamw_bf16 > adam8bit >
    adam4bit > adafactor (every name writes bf16 weights compensated; adamw_bf16 saves adamw's fp32 moments at the cost of
    bf16 ones, :data:`AUTO_ORDER_BF16`). The memory is ``budget_gb`` when
    given, else the device's free memory plus the bytes of the model's parameters already on it;
    :data:`AUTO_MARGIN` of it is kept free because activations are unknown here. When nothing fits, the
    smallest is chosen and the warning says so. ``world_size``/``sharding`` (as
    :func:`~hf_efficient.estimate_memory` takes them) size every candidate per rank, for a model that will be
    sharded after the optimizer is built; a model already sharded (DTensor parameters) says so itself.
    """
    described = describe_params(model, param_dtype, device)
    if world_size is not None or sharding is not None:
        described = described._replace(world_size=1 if world_size is None else world_size, sharding=sharding)
    return choose_from(described, dict(options or {}), source)


def choose_from(described: Described, given: dict, source: str) -> AutoChoice:
    """:func:`choose_auto` for a model already described (:func:`~hf_efficient.memory.describe_params`)."""
    tensors, dev = described.tensors, described.device
    auto = get_spec("auto")
    opts = parse_options(auto.name, auto.accepted, given, source=source)
    if opts["budget_gb"] is not None:
        available, where = int(opts["budget_gb"] * 2**30), f"budget_gb={opts['budget_gb']}"
    else:
        free = free_memory_bytes(dev)
        held = _held_bytes(described)
        available, where = free + held, f"free on {dev} {_gb(free)} + parameters already there {_gb(held)}"
    usable = int(available * (1 - AUTO_MARGIN))
    train = [t for t in tensors if t.trainable]
    bf16 = sum(t.elements for t in train if t.dtype == torch.bfloat16) * 2 > sum(t.elements for t in train)
    candidates, refused = [], []
    for name in AUTO_ORDER_BF16 if bf16 else AUTO_ORDER:
        mine = _options_for(name, given)
        try:
            candidates.append(predict(tensors, name, dev, options=mine, world_size=described.world_size,
                                      sharding=described.sharding))
        except UnsupportedSharding as e:  # not a candidate under this sharding: said in the log line
            refused.append(str(e))
    if not candidates:
        raise ValueError(f"{PREFIX}auto has no candidate under sharding={described.sharding!r}: " + "; ".join(refused))
    fitting = [c for c in candidates if c.total_bytes <= usable]
    best = fitting[0] if fitting else min(candidates, key=lambda c: c.total_bytes)
    name = best.name.removeprefix(PREFIX)
    choice = AutoChoice(name, _options_for(name, given), available, usable,
                        where, tuple(candidates), bool(fitting))
    logger.log(logging.INFO if choice.fits else logging.WARNING, "%s", choice.summary())  # nothing fits: a warning
    return choice


def _options_for(name: str, given: dict) -> dict:
    """The options ``name`` takes of those given; a quantized ``embedding_state`` (``8bit``, ``4bit``: the embeddings
    quantized like the rest) in the name's own codec."""
    spec = get_spec(name)
    mine = {k: v for k, v in given.items() if k in spec.options}
    if mine.get("embedding_state", "32bit") != "32bit":
        mine["embedding_state"] = f"{spec.facts.codec.BITS}bit"
    return mine


def _held_bytes(described: Described) -> int:
    """Bytes this process' parameters already occupy where they train (per rank when sharded), else 0."""
    if not described.resident:
        return 0
    return predict(described.tensors, "adamw", described.device, world_size=described.world_size,
                   sharding=described.sharding).param_bytes

