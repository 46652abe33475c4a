"""What a family declares about itself: its per-parameter state, the keys it always holds, its math, its options.

A :class:`Family` is declared in its family's module (``optim/lion8bit.py`` declares ``LION8BIT``) and read by its
class (moments, codec, default compensation), by the registry (its names are built on it) and, through the registry,
by checkpoints, memory rules and the distributed checks. Each of its state tensors is a :class:`StateKey`; quantized
state names its codec (a module such as :mod:`.quant8`, with :class:`Codec`'s attributes), so that block sizes,
bytes and canonical layouts are asked of the codec, never assumed.

Layering: this module imports torch, :mod:`..options` and ``optim/`` only, like every module of ``optim/``; the
rest of the package imports ``optim/`` (see docs/contributing.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

from ..options import Option
from .compensation import LOW_PRECISION

__all__ = ["PREFIX", "Codec", "StateKey", "Family", "STEP", "FIRST_MOMENT", "SECOND_MOMENT", "KAHAN", "codes",
           "kahan_keys", "rows_of_blocks", "keeps_quantized_state", "codes_bytes"]

PREFIX = "hf_eff_"  # of every Trainer name


@runtime_checkable
class Codec(Protocol):
    """What the package asks of a blockwise codec (a module: :mod:`.quant8`; a 4-bit one alike).

    ``BLOCK`` elements share one fp32 absmax; a code is ``BITS`` bits; in memory (the kernels' form) a block is
    ``WORDS`` 32-bit words, padded to whole blocks; ``ZERO_CODE[signed]`` is the code of 0.0. The canonical layout
    (checkpoints) holds a tensor's codes as ``canonical_shape(param shape)`` uint8, in element order, and keeps dim 0
    where the rows are whole blocks (FSDP2 shards the codes by rows, as the parameter). ``dequantize_blockwise`` takes
    the parameter's ``shape``: codes of fewer than 8 bits do not say it.
    """

    BLOCK: int
    BITS: int
    WORDS: int
    ZERO_CODE: dict

    def blocks(self, numel: int) -> int: ...
    def zero_codes(self, numel: int, signed: bool, device=None) -> tuple[torch.Tensor, torch.Tensor]: ...
    def canonical_shape(self, shape) -> tuple[int, ...]: ...
    def to_canonical(self, codes: torch.Tensor, p: torch.Tensor) -> torch.Tensor: ...
    def from_canonical(self, codes: torch.Tensor, p: torch.Tensor, signed: bool) -> torch.Tensor: ...
    def quantize_blockwise(self, x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]: ...
    def dequantize_blockwise(self, codes: torch.Tensor, absmax: torch.Tensor, signed: bool,
                             shape=None) -> torch.Tensor: ...
    def pack(self, x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]: ...
    def unpack(self, words: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor: ...


@dataclass(frozen=True)
class StateKey:
    """One tensor of a family's per-parameter state, in the canonical layout (checkpoints).

    Formats: ``step`` (the step count); ``param`` (floating point, the parameter's shape); ``codes`` (``codec``'s
    codes with ``<key>_absmax``, or floating point where the tensor keeps full-precision state); ``absmax`` (float32,
    one per block of the codec of the key it scales); ``row`` / ``col`` (floating point, a matrix's shape less its
    last / second-to-last dimension).
    """

    format: str
    signed: bool = False  # may hold negative values (first moments, compensation); else >= 0
    label: str = ""  # its name in conversion messages ("Kahan compensation")
    codec: Codec | None = None  # format "codes": the codec that stores it; "absmax": that of the key it scales

    def __post_init__(self):
        if (self.format in ("codes", "absmax")) != (self.codec is not None):
            raise ValueError(f"a StateKey of format {self.format!r} {'needs' if self.codec is None else 'takes no'} "
                             "codec: quantized state (codes, their absmax) names the codec that stores it")


STEP = StateKey("step")
FIRST_MOMENT = StateKey("param", signed=True, label="first moment")
SECOND_MOMENT = StateKey("param", label="second moment")
KAHAN = StateKey("param", signed=True, label="Kahan compensation")  # optim/compensation.py, bf16/fp16 weights


def codes(codec: Codec, *, signed: bool) -> StateKey:
    """A quantized moment stored by ``codec`` (its ``<key>_absmax`` is added by :class:`Family`)."""
    return StateKey("codes", signed=signed, codec=codec)


def kahan_keys(p: torch.Tensor, group: dict, default=None) -> set[str]:
    """``kahan_comp`` where a saved group compensates bf16/fp16 weights by Kahan summation (``default``: what a group
    without the key ran with: AdamWBF16 always had it; the other families gained it later, and resume from zero)."""
    return {"kahan_comp"} if group.get("compensation", default) == "kahan" and p.dtype in LOW_PRECISION else set()


def _zero_embeddings(bits: int) -> dict[str, tuple[str, str]]:
    """The ZeRO rule of every family with quantized state: its embeddings keep full-precision state by default."""
    return {"embedding_state": (
        f"{bits}bit", "cannot keep 32-bit state for embeddings and small tensors, as it does by default "
                      "(embedding_state=32bit): ZeRO hands the optimizer one flat partition per param group. Set "
                      f"optim_args embedding_state={bits}bit to accept {bits}-bit state everywhere")}


@dataclass(frozen=True)
class Family:
    """What every name of one optimizer family shares: state, conversions, options, distributed support, compensation.

    Names of one family (``adam8bit`` and ``paged_adam8bit``) share one Family; backends hold what differs per
    implementation (build, layout, memory rule, FSDP2 support). A quantized family declares its code keys only
    (:func:`codes`): each one's ``<key>_absmax`` follows it in :attr:`state`, and by default it always holds
    ``step``, its code keys and, under Kahan compensation of bf16/fp16 weights, ``kahan_comp``.
    """

    name: str
    state: dict[str, StateKey]  # canonical keys its optimizers may hold
    math: str  # families of one math convert moments into each other ("adamw": adamw, adamw8bit, adamw_bf16)
    # (param, its saved group) -> keys its state always holds (the absmax of each code tensor is the codec's, not
    # listed); None: step, the code keys and Kahan's buffer where the group asks for it (quantized families)
    required: Callable[[torch.Tensor, dict], set[str]] | None = None
    options: tuple[Option, ...] = ()  # its own options: hyperparameters its class takes by the same name
    param_dtype: torch.dtype = torch.float32  # the parameter dtype it is made for (bench and convergence runs)
    marks: frozenset[str] = frozenset()  # keys only its state holds: how an untagged checkpoint is recognised
    moment_dtype: Callable[[torch.Tensor], torch.dtype] | None = None  # dtype of moments converted in (None: fp32)
    check_state: Callable | None = None  # (state, param, where, trainer name) -> raise ValueError: its own checks
    deepspeed: str | None = None  # why it cannot train under ZeRO (None: it can)
    # option -> (the value ZeRO needs, why: "cannot ... . Set optim_args <option>=<value> to ..."); None: quantized
    # families keep embeddings' state in full precision by default, which ZeRO cannot
    deepspeed_options: dict[str, tuple[str, str]] | None = None
    uses_eps: bool = True  # Lion has none (bitsandbytes' Lion stores an unused eps=0.0 in its groups)
    flags: tuple[str, ...] = ()  # group flags that change the math (maximize, amsgrad) its optimizers implement
    # how updates reach bf16/fp16 weights under compensation=auto, and the default of the family's classes: on
    # scripts/convergence.py's bf16-model runs stochastic rounding met every family's target as well as Kahan, and it
    # costs no memory where Kahan keeps a bf16 buffer per weight (docs/results/convergence.md has the losses)
    compensation: str = "stochastic"
    # how create_optimizer groups a module's parameters: (model, weight_decay, its DecaySplit, parsed options) ->
    # param groups; None: the decay groups (param_groups.build_param_groups). Muon's: the Muon / AdamW split
    param_groups: Callable | None = None

    def __post_init__(self):
        state = {}
        for key, fmt in self.state.items():
            state[key] = fmt
            if fmt.format == "codes":
                state[f"{key}_absmax"] = StateKey("absmax", codec=fmt.codec)
        object.__setattr__(self, "state", state)
        if self.required is None:
            object.__setattr__(self, "required", self._default_required)
        if self.deepspeed_options is None:
            object.__setattr__(self, "deepspeed_options", _zero_embeddings(self.codec.BITS) if self.quantized else {})

    def _default_required(self, p: torch.Tensor, group: dict) -> set[str]:
        return {"step", *(k for k, _ in self.moments)} | (kahan_keys(p, group) if "kahan_comp" in self.state else set())

    @property
    def quantized(self) -> bool:
        """Holds blockwise quantized state (codes with absmaxes)."""
        return any(k.format == "codes" for k in self.state.values())

    @property
    def moments(self) -> tuple[tuple[str, bool], ...]:
        """Its quantized moments, in state order, as (key, signed): what its kernels step and its layouts relabel."""
        return tuple((k, s.signed) for k, s in self.state.items() if s.format == "codes")

    @property
    def codec(self) -> Codec | None:
        """The codec of its quantized moments (None: it keeps none)."""
        found = {id(s.codec): s.codec for s in self.state.values() if s.format == "codes"}
        if len(found) > 1:
            raise ValueError(f"family {self.name} stores its moments with {len(found)} codecs; its kernels take one")
        return next(iter(found.values()), None)

    @property
    def quantized_bytes(self) -> float:
        """Bytes of quantized state per parameter of a tensor that keeps it (codes and absmaxes)."""
        return sum(codes_bytes(s.codec, 1.0) for s in self.state.values() if s.format == "codes")

    def option(self, name: str) -> Option | None:
        return next((o for o in self.options if o.name == name), None)


def codes_bytes(codec: Codec, numel: float) -> float:
    """Bytes ``numel`` elements of one moment take in ``codec``'s blocks (a float ``numel``: per element, no
    padding; an int: in memory, padded to whole blocks)."""
    blocks = numel / codec.BLOCK if isinstance(numel, float) else codec.blocks(numel)
    return blocks * (codec.BLOCK * codec.BITS // 8 + 4)


# --- quantized-state eligibility: the one rule the quantized optimizers step by and the memory estimator counts by


def rows_of_blocks(shape, block: int) -> bool:
    """Whether each row (``shape[1:]``) of a tensor of global ``shape`` is whole blocks of ``block`` elements: then
    every Shard(0) shard of it is whole blocks, on any mesh."""
    return len(shape) >= 2 and shape[0] > 0 and math.prod(shape) // shape[0] % block == 0


def keeps_quantized_state(shape, codec: Codec, *, sharded: bool, min_8bit_size: int, keep_32bit: bool = False) -> bool:
    """Whether a tensor of global ``shape`` keeps ``codec``'s blockwise state in this package's quantized families: at
    least ``min_8bit_size`` elements and not kept 32-bit by policy (embeddings, ``fp32_state_params``); an FSDP2
    (Shard(0)) tensor also needs rows of whole blocks, so that no block straddles two ranks. Read from the global
    shape only, so the answer does not change with the mesh."""
    if keep_32bit or math.prod(shape) < min_8bit_size:
        return False
    return not sharded or rows_of_blocks(shape, codec.BLOCK)
