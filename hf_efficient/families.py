"""The optimizer families' facts: the registry's half that the optimizer classes read too.

A :class:`Family` states what every name of one optimizer family shares: its per-parameter state (keys, formats,
which are the 8-bit moments), which families convert into each other, distributed support and why not, and its
``compensation=auto``. :mod:`hf_efficient.registry` builds its names on these; the classes in ``optim/`` read their
moments and their default compensation from here. This module imports torch only, so that both can import it
without an import cycle (the registry's builders import the classes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .optim.quant8 import BLOCK

__all__ = ["PREFIX", "StateKey", "Family", "FAMILIES", "PLAIN", "ADAMW", "ADAMW8BIT", "ADAFACTOR", "ADAMW_BF16",
           "LION8BIT", "AUTO", "rows_of_blocks", "keeps_8bit_state"]

PREFIX = "hf_eff_"  # of every Trainer name


@dataclass(frozen=True)
class StateKey:
    """One tensor of a family's per-parameter state, in the canonical layout (checkpoints).

    Formats: ``step`` (the step count); ``param`` (floating point, the parameter's shape); ``codes`` (8-bit
    codes of the parameter's shape with ``<key>_absmax``, or floating point where the tensor keeps 32-bit
    state); ``absmax`` (float32, one per ``quant8.BLOCK`` elements); ``row`` / ``col`` (floating point, a
    matrix's shape less its last / second-to-last dimension).
    """

    format: str
    signed: bool = False  # may hold negative values (first moments, compensation); else >= 0
    label: str = ""  # its name in conversion messages ("Kahan compensation")


_STEP_KEY = StateKey("step")


@dataclass(frozen=True)
class Family:
    """What every name of one optimizer family shares: state, conversions, distributed support, compensation.

    Names of one family (``adam8bit`` and ``paged_adam8bit``) share one Family; backends hold what differs per
    implementation (build, layout, memory rule, FSDP2 support).
    """

    name: str
    state: dict[str, StateKey]  # canonical keys its optimizers may hold
    required: Callable[[torch.Tensor, dict], set[str]]  # (param, its saved group) -> keys its state always holds
    # (the absmax of each 8-bit code tensor is required by the codec, not listed here)
    math: str  # families of one math convert moments into each other ("adamw": adamw, adamw8bit, adamw_bf16)
    param_dtype: torch.dtype = torch.float32  # the parameter dtype it is made for (bench and convergence runs)
    marks: frozenset[str] = frozenset()  # keys only its state holds: how an untagged checkpoint is recognised
    moment_dtype: Callable[[torch.Tensor], torch.dtype] | None = None  # dtype of moments converted in (None: fp32)
    check_state: Callable | None = None  # (state, param, where, trainer name) -> raise ValueError: its own checks
    deepspeed: str | None = None  # why it cannot train under ZeRO (None: it can)
    # option -> (the value ZeRO needs, why: "cannot ... . Set optim_args <option>=<value> to ...")
    deepspeed_options: dict[str, tuple[str, str]] = field(default_factory=dict)
    uses_eps: bool = True  # Lion has none (bitsandbytes' Lion stores an unused eps=0.0 in its groups)
    flags: tuple[str, ...] = ()  # group flags that change the math (maximize, amsgrad) its optimizers implement
    # how updates reach bf16/fp16 weights under compensation=auto, and the default of the family's classes: on
    # scripts/convergence.py's bf16-model runs stochastic rounding met every family's target as well as Kahan, and it
    # costs no memory where Kahan keeps a bf16 buffer per weight (docs/results/convergence.md has the losses)
    compensation: str = "stochastic"

    def __reduce__(self):  # a singleton (its rules are closures): pickled by name, as a copy of an optimizer is
        return _family, (self.name,)

    @property
    def quantized(self) -> bool:
        """Holds blockwise 8-bit state (codes with absmaxes)."""
        return any(k.format == "codes" for k in self.state.values())

    @property
    def moments(self) -> tuple[tuple[str, bool], ...]:
        """Its 8-bit moments, in state order, as (key, signed): what its kernels step and its layouts relabel."""
        return tuple((k, s.signed) for k, s in self.state.items() if s.format == "codes")



# --- 8-bit eligibility: the one rule the 8-bit optimizers step by and the memory estimator counts by -------------

def rows_of_blocks(shape) -> bool:
    """Whether each row (``shape[1:]``) of a tensor of global ``shape`` is whole blocks of ``BLOCK`` elements: then
    every Shard(0) shard of it is whole blocks, on any mesh."""
    return len(shape) >= 2 and shape[0] > 0 and math.prod(shape) // shape[0] % BLOCK == 0


def keeps_8bit_state(shape, *, sharded: bool, min_8bit_size: int, keep_32bit: bool = False) -> bool:
    """Whether a tensor of global ``shape`` keeps blockwise 8-bit state in this package's 8-bit families: at least
    ``min_8bit_size`` elements and not kept 32-bit by policy (embeddings, ``fp32_state_params``); an FSDP2 (Shard(0))
    tensor also needs rows of whole blocks, so that no block straddles two ranks. Read from the global shape only, so
    the answer does not change with the mesh."""
    if keep_32bit or math.prod(shape) < min_8bit_size:
        return False
    return not sharded or rows_of_blocks(shape)


# --- families ------------------------------------------------------------------------------------------------

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_MOMENTS = {"step", "exp_avg", "exp_avg_sq"}


def _kahan(p, group, default=None) -> set[str]:
    """``kahan_comp`` where a saved group compensates bf16/fp16 weights by Kahan summation (``default``: what a group
    without the key ran with: AdamWBF16 always had it; the other families gained it later, and resume from zero)."""
    return {"kahan_comp"} if group.get("compensation", default) == "kahan" and p.dtype in _LOW_PRECISION else set()


def _adamw_required(p, group) -> set[str]:
    return _MOMENTS | ({"max_exp_avg_sq"} if group.get("amsgrad") else set()) | _kahan(p, group)


def _adamw_bf16_required(p, group) -> set[str]:
    return _MOMENTS | _kahan(p, group, "kahan")


def _adamw_bf16_dtype(p) -> torch.dtype:
    """bf16 state for bf16 and fp16 weights (fp16's range underflows (1 - beta2) * grad**2); else the weight's."""
    return torch.bfloat16 if p.dtype in _LOW_PRECISION else p.dtype


def _adafactor_required(p, group) -> set[str]:
    need = {"step"} | ({"exp_avg_sq_row", "exp_avg_sq_col"} if p.dim() >= 2 else {"exp_avg_sq"})
    return need | ({"exp_avg"} if group.get("beta1") is not None else set()) | _kahan(p, group)


def _adafactor_check(st: dict, p, where: str, trainer_name: str) -> None:
    if p.dim() >= 2 and "exp_avg_sq" in st:
        *rows, cols = p.shape
        raise ValueError(f"{where} has a full exp_avg_sq (shape {tuple(getattr(st['exp_avg_sq'], 'shape', ()))}); "
                         f"Adafactor keeps a matrix's second moment factored, as exp_avg_sq_row of shape {tuple(rows)} "
                         f"and exp_avg_sq_col of shape {tuple(p.shape[:-2]) + (cols,)}: this state was written by "
                         f"another optimizer (AdamW-like). Resume with the optimizer that wrote it, or start "
                         f"{trainer_name} afresh (remove optimizer.pt from the checkpoint)")


_M, _V = StateKey("param", signed=True, label="first moment"), StateKey("param", label="second moment")
_KAHAN = StateKey("param", signed=True, label="Kahan compensation")  # optim/compensation.py, bf16/fp16 weights
ADAMW = Family("adamw", {"step": _STEP_KEY, "exp_avg": _M, "exp_avg_sq": _V, "max_exp_avg_sq": _V,
                         "kahan_comp": _KAHAN},
               _adamw_required, "adamw", flags=("maximize", "amsgrad"))
ADAMW8BIT = Family(
    "adamw8bit", {"step": _STEP_KEY, "exp_avg": StateKey("codes", signed=True), "exp_avg_sq": StateKey("codes"),
                  "exp_avg_absmax": StateKey("absmax"), "exp_avg_sq_absmax": StateKey("absmax"), "kahan_comp": _KAHAN},
    lambda p, group: _MOMENTS | _kahan(p, group), "adamw",
    deepspeed_options={"embedding_state": (
        "8bit", "cannot keep 32-bit state for embeddings and small tensors, as it does by default "
                "(embedding_state=32bit): ZeRO hands the optimizer one flat partition per param group. Set optim_args "
                "embedding_state=8bit to accept 8-bit state everywhere")})
ADAFACTOR = Family(
    "adafactor", {"step": _STEP_KEY, "exp_avg": _M, "exp_avg_sq": _V, "exp_avg_sq_row": StateKey("row"),
                  "exp_avg_sq_col": StateKey("col"), "kahan_comp": _KAHAN},
    _adafactor_required, "adafactor",
    marks=frozenset({"exp_avg_sq_row", "exp_avg_sq_col"}), check_state=_adafactor_check,
    deepspeed="ZeRO flattens each param group into one 1-D partition, so nothing is left to factor: it trains, but "
              "keeps a full fp32 second moment (4 bytes per parameter instead of << 1)")
ADAMW_BF16 = Family(
    "adamw_bf16", {"step": _STEP_KEY, "exp_avg": _M, "exp_avg_sq": _V, "kahan_comp": _KAHAN},
    _adamw_bf16_required, "adamw", param_dtype=torch.bfloat16,
    compensation="kahan",  # the name made for bf16 + Kahan (stochastic met its target too: convergence.md)
    marks=frozenset({"kahan_comp"}), moment_dtype=_adamw_bf16_dtype,
    deepspeed="ZeRO keeps fp32 master partitions and steps those (with bf16 enabled too), so there are no bf16 "
              "weights for its compensated update: it trains as plain fp32 AdamW (the same weights as "
              f"{PREFIX}adamw), without the memory it exists to save")
LION8BIT = Family(
    "lion8bit", {"step": _STEP_KEY, "exp_avg": StateKey("codes", signed=True), "exp_avg_absmax": StateKey("absmax"),
                 "kahan_comp": _KAHAN},
    lambda p, group: {"step", "exp_avg"} | _kahan(p, group), "lion",
    deepspeed_options=ADAMW8BIT.deepspeed_options, uses_eps=False)
AUTO = Family("auto", {}, lambda p, group: set(), "auto")
FAMILIES: dict[str, Family] = {f.name: f for f in (ADAMW, ADAMW8BIT, ADAFACTOR, ADAMW_BF16, LION8BIT)}


def _family(name: str) -> Family:
    return AUTO if name == AUTO.name else FAMILIES[name]


PLAIN = ADAMW  # the state torch's own optimizers write: what an untagged state without marks is read as
