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
fp32 moments before storing them; one matrix's fp32 copy at a time. On CPU the codec is ``quant8_cpu.c`` (quant8.h's
block codec, probed against the eager one bit for bit): the eager :func:`.quant8.pack` / :func:`.quant8.unpack`
cost more than Newton-Schulz itself on a CPU thread; elsewhere (CUDA, no compiler) they run.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _dispatch, _sharded, quant8
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


def _probe_values() -> Tensor:
    """Blocks the probes code: 200 (a range that splits over 3 threads in whole 64-block pieces: a kernel that
    leaves a thread's share undone fails), random values at scales from 1e-40 (below fp32's normal range:
    block_scale's floor) to 1e30, an all-zero block, and exact zeros inside blocks."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, quant8.BLOCK, generator=g) * torch.logspace(-40, 30, 8).repeat(25)[:, None]
    x[3] = 0.0
    x[5, ::7] = 0.0
    return x


def _probe_encode(fn) -> bool:
    """quant8_encode gives the eager codec's words and absmaxes, both maps, over 1 and 3 threads."""
    x = _probe_values()
    for signed in (True, False):
        v = x if signed else x.abs()
        words, absmax = quant8.pack(v, signed)
        for threads in (1, 3):
            w, a = torch.zeros_like(words), torch.zeros_like(absmax)
            _ENCODE.run(fn, v, w, a, int(signed), quant8.c_tables(), n=len(v), unit=quant8.BLOCK, threads=threads)
            if not (torch.equal(w.view(torch.int32), words.view(torch.int32)) and torch.equal(a, absmax)):
                return False
    return True


def _probe_decode(fn) -> bool:
    """quant8_decode gives the eager codec's values, both maps, over 1 and 3 threads."""
    x = _probe_values()
    for signed in (True, False):
        words, absmax = quant8.pack(x if signed else x.abs(), signed)
        values = quant8.unpack(words, absmax, signed)
        for threads in (1, 3):
            out = torch.full_like(values, float("nan"))
            _DECODE.run(fn, out, words, absmax, int(signed), quant8.c_tables(), n=len(out), unit=quant8.BLOCK,
                        threads=threads)
            if not torch.equal(out, values):
                return False
    return True


_SIGNATURE = "values:ptr words:ptr absmax:ptr signed:int maps:ptr"
_ENCODE = _dispatch.CKernel("quant8_cpu.c", "quant8_encode", _SIGNATURE, _probe_encode)
_DECODE = _dispatch.CKernel("quant8_cpu.c", "quant8_decode", _SIGNATURE, _probe_decode)


class QuantizedMomentum:
    """A matrix's momentum held in a codec's in-memory blocks (:class:`._blockwise.Blockwise8bit`'s layout: codes of
    whole blocks, zero-padded, and an absmax per block; an FSDP2 parameter's: its rows', which are whole blocks), as
    :func:`.muon.muon` reads and writes it: :meth:`decode` this rank's rows to fp32, :meth:`encode_` them back."""

    def __init__(self, p: Tensor, state: dict, codec: Codec, key: str = "momentum_buffer", signed: bool = True):
        self.shape, self.sharded = p.shape, _sharded.is_sharded(p)
        self._rows, self._codec, self._signed = _sharded.local(p).shape, codec, signed
        self._words = _sharded.local(state[key]).view(-1).view(torch.float32).view(-1, codec.WORDS)
        self._absmax = _sharded.local(state[f"{key}_absmax"]).view(-1)

    def _c(self, kernel):
        """``kernel``'s C function where it steps these blocks (quant8's codec on CPU, built and probed), else None."""
        return kernel.fn() if self._codec is quant8 and self._words.device.type == "cpu" else None

    def decode(self) -> Tensor:
        n, blocks = math.prod(self._rows), self._absmax.numel()
        fn = self._c(_DECODE)
        if fn is None:
            values = self._codec.unpack(self._words, self._absmax, self._signed)
        else:
            values = torch.empty(blocks, self._codec.BLOCK)
            _DECODE.run(fn, values, self._words, self._absmax, int(self._signed), quant8.c_tables(), n=blocks,
                        unit=quant8.BLOCK)
        return values.view(-1)[:n].view(self._rows)

    def encode_(self, values: Tensor) -> None:
        flat = values.reshape(-1)
        padded = F.pad(flat, (0, self._absmax.numel() * self._codec.BLOCK - flat.numel()))
        fn = self._c(_ENCODE)
        if fn is not None:  # straight into the state's words and absmaxes
            _ENCODE.run(fn, padded, self._words, self._absmax, int(self._signed), quant8.c_tables(),
                        n=self._absmax.numel(), unit=quant8.BLOCK)
            return
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
