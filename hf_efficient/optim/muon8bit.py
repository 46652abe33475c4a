"""``hf_eff_muon8bit``: Muon with its momentum in the 8-bit codec, AdamW's half as ``hf_eff_adam8bit``.

:class:`Muon8bit` is :class:`.adamw8bit.AdamW8bit` whose groups marked ``"muon": True`` are stepped by
:func:`.muon.muon` (:class:`.muon.MuonSteps`, as :class:`.muon.Muon` does for fp32 state): the AdamW groups take
AdamW8bit's kernels and rules unchanged (8-bit moments, 32-bit state for embeddings and small tensors, its C and
Triton kernels, FSDP2 shards), and each Muon matrix keeps ``momentum_buffer`` in the same codec's blocks (signed,
~1.02 bytes per element) under the same rule: 8-bit from ``min_8bit_size`` elements (under FSDP2, with rows of whole
blocks), fp32 below. State dicts, loads, precision changes and conversions are :class:`._blockwise.Blockwise8bit`'s,
per group (:meth:`Muon8bit.moments_of`), so checkpoints hold the canonical layout of both halves.

The momentum of a Muon matrix is decoded whole to fp32 when its update is made, advanced there, and encoded back
(:class:`QuantizedMomentum`): the update is orthogonalised from the fp32 values, as the 8-bit AdamW steps from its
fp32 moments before storing them; one matrix's fp32 copy at a time. The codec runs as torch operations
(:func:`.quant8.pack` / :func:`.quant8.unpack`), no kernel of its own: on one CPU thread they cost more than
Newton-Schulz itself (docs/results/bench_muon.md: this step ~2.5x hf_eff_muon's), the first thing to move to the C
codec (``quant8.h``) where the step time matters.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _sharded, quant8
from ._blockwise import Blockwise8bit, _check_8bit_keys
from .adamw8bit import AdamW8bit
from .facts import KAHAN, STEP, Codec, Family, codes
from .muon import MUON_OPTIONS, NO_ZERO, NS_STEPS, MuonSteps, check_muon_group, muon_groups, muon_required

__all__ = ["MUON8BIT", "Muon8bit", "QuantizedMomentum"]

MUON8BIT = Family("muon8bit", {"step": STEP, "momentum_buffer": codes(quant8, signed=True),
                               "exp_avg": codes(quant8, signed=True), "exp_avg_sq": codes(quant8, signed=False),
                               "kahan_comp": KAHAN},
                  "muon", muon_required, options=MUON_OPTIONS, deepspeed=NO_ZERO, param_groups=muon_groups)
MOMENTUM = (("momentum_buffer", True),)  # the quantized key of a Muon matrix, signed


class QuantizedMomentum:
    """A matrix's momentum held in a codec's in-memory blocks (:class:`._blockwise.Blockwise8bit`'s layout: codes of
    whole blocks, zero-padded, and an absmax per block; an FSDP2 parameter's: its rows', which are whole blocks), as
    :func:`.muon.muon` reads and writes it: :meth:`decode` this rank's rows to fp32, :meth:`encode_` them back."""

    def __init__(self, p: Tensor, state: dict, codec: Codec, key: str = "momentum_buffer", signed: bool = True):
        self.shape, self.sharded = p.shape, _sharded.is_sharded(p)
        self._rows, self._codec, self._signed = _sharded.local(p).shape, codec, signed
        self._words = _sharded.local(state[key]).view(-1).view(torch.float32).view(-1, codec.WORDS)
        self._absmax = _sharded.local(state[f"{key}_absmax"]).view(-1)

    def decode(self) -> Tensor:
        n = math.prod(self._rows)
        return self._codec.unpack(self._words, self._absmax, self._signed).view(-1)[:n].view(self._rows)

    def encode_(self, values: Tensor) -> None:
        flat = values.reshape(-1)
        padded = F.pad(flat, (0, self._absmax.numel() * self._codec.BLOCK - flat.numel()))
        words, absmax = self._codec.pack(padded.view(-1, self._codec.BLOCK), self._signed)
        self._words.copy_(words)
        self._absmax.copy_(absmax)


class Muon8bit(MuonSteps, AdamW8bit, kernels=AdamW8bit):
    """Muon on the groups marked ``"muon": True`` with an 8-bit momentum, 8-bit AdamW on the others; see the module
    docstring. Arguments: :class:`.muon.Muon`'s, and AdamW8bit's ``min_8bit_size``, ``fp32_state_params`` (the
    registry passes the embeddings under ``embedding_state=32bit``) and ``compile`` (its kernels' choice)."""

    FACTS = MUON8BIT

    def __init__(self, params, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, momentum: float = MUON_OPTIONS[0].default, nesterov: bool = True,
                 ns_steps: int = NS_STEPS, ns_dtype: str = "bf16", adjust_lr: str = "match_rms_adamw",
                 min_8bit_size: int = 4096, fp32_state_params=None, compile: bool | None = None,
                 compensation: str = MUON8BIT.compensation):
        defaults = dict(self.MUON_DEFAULTS, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, ns_dtype=ns_dtype,
                        adjust_lr=adjust_lr, min_8bit_size=min_8bit_size, compile=compile, compensation=compensation)
        check_muon_group({**defaults, "muon": False}, "Muon8bit")
        Blockwise8bit.__init__(self, params, defaults, fp32_state_params)

    @classmethod
    def check_family_keys(cls, group: dict) -> None:
        _check_8bit_keys(group, cls.FACTS, cls.FAMILY)
        check_muon_group(group, cls.FAMILY)

    def moments_of(self, group: dict) -> tuple[tuple[str, bool], ...]:
        """A Muon group's matrices keep ``momentum_buffer``; AdamW's groups AdamW8bit's moments."""
        return MOMENTUM if group.get("muon") else self.MOMENTS

    def _muon_state(self, p: Tensor, group: dict) -> dict:
        return self._init_state(p, group)  # Blockwise8bit's: 8-bit or fp32 by its rule, DTensors under FSDP2

    def _momentum(self, p: Tensor, group: dict, state: dict):
        buf = state["momentum_buffer"]
        return QuantizedMomentum(p, state, self.CODEC) if buf.dtype == torch.uint8 else buf
