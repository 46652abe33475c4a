"""What every optimizer with blockwise quantized state shares: a family is its math, nothing else.

A family (:class:`.adamw8bit.AdamW8bit`, :class:`.lion8bit.Lion8bit`; the smallest: docs/contributing.md's) subclasses
:class:`Blockwise8bit` and gives:

- ``FACTS``, its :class:`.facts.Family`: ``NAME`` (the family's name, its kernels' name: ``{NAME}_cpu.c`` holds
  ``{NAME}_step``, the op is ``hf_efficient::{NAME}_step``, ``blockwise_triton.{NAME}`` launches its Triton kernel),
  ``FAMILY`` (the class's name, for messages), ``MOMENTS`` (its quantized state keys and whether each is signed) and
  ``CODEC`` are read from it;
- ``update(p, g, moments, coef) -> (p, moments)``: its math on fp32 values, in torch ops; the quantized kernel
  (unpack, update, pack) and the step of tensors that keep fp32 state are made from it. A family may write them
  itself instead: ``kernel(p, g, *words, *absmaxes, coef) -> (*words, *absmaxes)``, one step on ``nb`` blocks
  (``p``, ``g`` ``(nb, BLOCK)``, codes in its codec's in-memory form; compiled by inductor, or run as is), and
  ``step_32bit(group, items)`` (small tensors, ``fp32_state_params``; ``TRITON_FP32`` True where it steps CUDA
  tensors with a Triton kernel, their step counts then living on the device);
- ``coefficients(group, step) -> list[float]``: its per-step scalars (the C kernel reads them per tensor);
- its ``__init__``: its hyperparameters as keywords (its Family's options among them), put in ``defaults``.

Kernels are optional: ``C_KERNEL`` / ``TRITON_KERNEL`` say it has ``{NAME}_cpu.c`` / ``blockwise_triton.{NAME}``;
without them its tensors take the compiled (or eager) kernel.

Everything else is here, once: state creation, the choice of kernel per tensor (:meth:`Blockwise8bit.choose`),
full blocks in bounded calls and the zero-padded last block, all C-kernel tensors of a group in one call of its
``torch.library`` op, the canonical ``state_dict`` and an all-or-nothing ``load_state_dict``.

Kernels. On CUDA, contiguous fp32, bf16 or fp16 weights and gradients go through the family's Triton kernel
(:mod:`.blockwise_triton`: one launch per group and (weight dtype, gradient dtype) over a pointer table, the step
counts on the device, no host synchronisation, the void flag of :func:`._triton.flag` honoured). On CPU,
contiguous fp32 or bf16 weights and gradients go through the family's C kernel (built once per machine with the system C compiler, see :mod:`._native`; the codec is
``quant8.h``). Each is admitted by a probe that must give the eager kernel's codes and absmaxes exactly (3 steps,
a partial block, a gradient whose square overflows; the C kernel on 3 threads). Everything else (fp16 weights on
CPU, other layouts, ``compile=True``) gets the ``torch.compile``'d kernel, and without a C++ compiler (or Triton
on CUDA) the same kernel runs eagerly, in bounded chunks: same numbers, slower.

FSDP2 (DTensor parameters, Shard(0) on a 1-D mesh: see :mod:`._sharded`): which tensors keep 8-bit state is decided
from the whole tensor, so that every mesh size gives the same set: a matrix (or stack) under FSDP2 keeps 8-bit state
where it has ``min_8bit_size`` elements and each row (``shape[1:]``) is whole blocks of 256 (most transformer
matrices), so that every shard is whole blocks and no block ever straddles two ranks, whatever the mesh; its codes
are a DTensor of the parameter's shape and its absmaxes one of shape ``(rows, row length / 256)``, both placed like
the rows, and ``state_dict()`` keeps them so (flattened, a whole absmax is the canonical ``(blocks,)``, in order).
Other tensors keep fp32 state under FSDP2 (logged once). Each rank steps its shard with the eager (or, with
``compile=True``, the compiled) kernel, fp32-state shards through torch's path (no C or Triton kernel on shards);
stochastic rounding numbers each element as in the whole tensor. Elementwise math: no sum across ranks.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..options import check_group, check_saved_tensor, check_step, start_step
from . import _dispatch, _native, _sharded, _triton
from ._dispatch import on_device
from .compensation import (C_MODES, LOW_PRECISION, applies, check_compensation, drop_unused_buffers, element_index,
                           step_in_fp32, weight_key, write)
from .facts import Codec, Family, keeps_quantized_state, rows_of_blocks
from .quant8 import _describe

__all__ = ["Blockwise8bit"]

_EAGER_BLOCKS = 1024  # blocks per eager chunk: bounds the fp32 temporaries (~1 MiB each)
_TRITON_DTYPES = (torch.float32, *LOW_PRECISION)  # of weights and gradients the Triton kernels load
_CALL_BLOCKS = 4096  # blocks per compiled call: its code buffers (4 MiB) stay out of mmap and page faults


def _check_8bit_keys(group: dict, facts: Family | None = None, owner: str = "") -> None:
    """The group keys every quantized family has, and the family's own options (``facts.options``) that its groups
    carry (Muon's ``muon_include`` / ``muon_exclude`` choose the groups and are none of their keys)."""
    size = group["min_8bit_size"]
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"Invalid min_8bit_size={size!r}: it must be an int >= 0 (elements)")
    if group["compile"] not in (None, True, False):
        raise ValueError(f"Invalid compile={group['compile']!r}: expected None (automatic: the C kernel where it "
                         "applies, else the compiled one), True (the compiled kernel) or False (eager)")
    check_compensation(group["compensation"])
    for option in facts.options if facts is not None else ():
        if option.name in group:
            option.check_value(group[option.name], owner)


def _make_op(name: str, family: type):
    """``hf_efficient::{name}_step``: the family's C kernel over lists of tensors, in place (shows in the profiler,
    composes with torch.compile). ``codes`` / ``absmax``: every tensor's first moment, then every tensor's second...;
    ``comps``: each tensor's Kahan buffer (an empty tensor where it has none); ``keys``: each tensor's weight noise
    key. Not ``mode``: torch's dispatch passes a keyword of that name to ops."""
    def step(params: list[Tensor], grads: list[Tensor], codes: list[Tensor], absmax: list[Tensor],
             comps: list[Tensor], keys: list[int], coef: list[float], compensation: str, threads: int) -> None:
        family.run_native(family.native_fn(), params, grads, codes, absmax, coef, None if threads < 0 else threads,
                          comps, keys, compensation)

    return _dispatch.custom_op(f"{name}_step", step, ("params", "codes", "absmax", "comps"))


class Blockwise8bit(Optimizer):
    """Base of the quantized families (see the module docstring). Not used alone.

    A family declares ``FACTS`` (its :class:`.facts.Family`); its kernel name ``NAME`` (the family's name), message
    label ``FAMILY`` (the class's name), ``MOMENTS`` and ``CODEC`` are read from there. ``C_KERNEL`` /
    ``TRITON_KERNEL``: it has ``{NAME}_cpu.c`` / ``blockwise_triton.{NAME}`` (optional: without them its torch
    kernel runs, compiled or eager). ``PROBE``: the hyperparameters its kernels are probed with, over its defaults.

    A family whose groups hold different quantized state (Muon8bit: a momentum on Muon's matrices, AdamW's moments on
    the rest) names the family whose kernels step its blockwise groups (``class Muon8bit(..., kernels=AdamW8bit)``:
    that family's ``NAME``, ``MOMENTS``, ``CODEC``, C op and probes, so one kernel is built and probed for both),
    says which keys each group holds (:meth:`moments_of`), and steps its other groups itself (:meth:`_step_group`).
    """

    FACTS: Family
    NAME: str
    FAMILY: str
    MOMENTS: tuple[tuple[str, bool], ...]
    CODEC: Codec
    C_KERNEL = False  # a C kernel {NAME}_step in {NAME}_cpu.c
    TRITON_KERNEL = False  # a Triton step blockwise_triton.{NAME}
    TRITON_FP32 = False  # whether step_32bit steps CUDA tensors with a Triton kernel (device step counts)
    PROBE = dict(lr=1e-2, weight_decay=0.1)  # over the family's defaults: a step large enough to show a difference
    _op = None

    def __init_subclass__(cls, kernels: type | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if kernels is not None:  # another family's kernels, their probes bound to that family (see the class)
            cls.FAMILY = cls.__name__
            cls.NAME, cls.MOMENTS, cls.CODEC, cls._op = kernels.NAME, kernels.MOMENTS, kernels.CODEC, kernels._op
            for attr in ("c_kernel", "triton_fn", "probe_group"):
                setattr(cls, attr, getattr(kernels, attr))
        elif "FACTS" in cls.__dict__:  # a family (a subclass of one inherits its facts)
            facts = cls.FACTS
            cls.NAME, cls.FAMILY, cls.MOMENTS, cls.CODEC = facts.name, cls.__name__, facts.moments, facts.codec
            cls._op = _make_op(cls.NAME, cls) if cls.C_KERNEL else None

    def __init__(self, params, defaults: dict, fp32_state_params=None):
        _check_8bit_keys(defaults, self.FACTS, self.FAMILY)
        self._fp32_ids = {x if isinstance(x, int) else id(x) for x in (fp32_state_params or ())}
        self._tables = {}  # id(param group) -> its Triton launches' pointer tables (_triton.launch)
        super().__init__(params, defaults)

    # --- what a family gives -------------------------------------------------------------------------------

    @staticmethod
    def update(p: Tensor, g: Tensor, moments: list[Tensor], coef) -> tuple[Tensor, list[Tensor]]:
        """The family's math on fp32 values of one shape: the new weight and moments (``coef``: its
        :meth:`coefficients`, a tensor or a list). Not needed where the family writes :meth:`kernel` and
        :meth:`step_32bit` itself."""
        raise NotImplementedError("a quantized family gives update(), or kernel() and step_32bit()")

    @staticmethod
    def coefficients(group: dict, step: int) -> list[float]:
        raise NotImplementedError

    @classmethod
    def kernel(cls, p, g, *args):
        """One step on ``nb`` blocks made from :meth:`update`: the moments decoded, updated, encoded (returned, not
        written in place: inductor then keeps a block's moments local); ``p`` updated in place."""
        k, codec = len(cls.MOMENTS), cls.CODEC
        words, absmax, coef = args[:k], args[k:2 * k], args[-1]
        moments = [codec.unpack(w, a, s) for w, a, (_, s) in zip(words, absmax, cls.MOMENTS)]
        new_p, moments = cls.update(p.float(), g.float(), moments, coef)
        p.copy_(new_p)
        packed = [codec.pack(m, s) for m, (_, s) in zip(moments, cls.MOMENTS)]
        return (*(w for w, _ in packed), *(a for _, a in packed))

    def step_32bit(self, group: dict, items: list[tuple[Tensor, Tensor, dict]], offsets=None) -> None:
        """Step fp32-state ``items`` (weight, gradient, state, position) by :meth:`update`, bf16/fp16 weights as fp32
        copies written under the group's compensation; ``offsets``: where given, the items are FSDP2 shards (local
        tensors) and each one's first global element number, for the stochastic noise."""
        keys = self.noise_keys(items)
        for it in items:
            it[2]["step"] += 1

        def step(idx, ps):
            for i, p32 in zip(idx, ps):
                _, g, st, _ = items[i]
                coef = self.coefficients(group, int(st["step"].item()))
                new_p, moments = self.update(p32, g.float(), [st[k] for k, _ in self.MOMENTS], coef)
                p32.copy_(new_p)
                for (key, _), m in zip(self.MOMENTS, moments):
                    st[key].copy_(m)

        step_in_fp32([it[0] for it in items], step, group["compensation"],
                     [it[2].get("kahan_comp") for it in items], keys, offsets)

    @classmethod
    def check_family_keys(cls, group: dict) -> None:
        """A family's own group checks, beside :func:`..options.check_group`'s: the quantized families' keys and the
        family's options (``FACTS.options``)."""
        _check_8bit_keys(group, cls.FACTS, cls.FAMILY)

    @classmethod
    def probe_group(cls) -> dict:
        """The param group the kernels are probed with: a group of the family's own (its defaults, its options
        included), with :attr:`PROBE`'s hyperparameters."""
        return cls([torch.zeros(1, requires_grad=True)], **cls.PROBE).param_groups[0]

    # --- kernels ----------------------------------------------------------------------------------------------

    @classmethod
    def eager_kernel(cls, p, g, *args):
        """The kernel run as is, in chunks of blocks (its fp32 temporaries are ~30 times the chunk)."""
        *tensors, coef = args
        outs = [cls.kernel(*(t[i:i + _EAGER_BLOCKS] for t in (p, g, *tensors)), coef)
                for i in range(0, p.shape[0], _EAGER_BLOCKS)]
        return tuple(torch.cat(parts) for parts in zip(*outs))

    @classmethod
    def compiled_kernel(cls, device: torch.device):
        """The torch.compile'd kernel for ``device`` (compiled at its first call), or None where that failed."""
        return _dispatch.compiled(("compiled", cls.NAME, device.type), cls.kernel)

    @classmethod
    def native_fn(cls):
        """The C function, once its probe passed; else None."""
        return cls.c_kernel().fn()

    @classmethod
    def c_kernel(cls) -> _dispatch.CKernel:
        """The family's C function ``{NAME}_step`` of ``{NAME}_cpu.c`` (blockwise.h's arguments), declared once per
        class (``codes`` / ``absmax``: every tensor's first moment, then every tensor's second...)."""
        if "_c_kernel" not in cls.__dict__:
            k = len(cls.MOMENTS)
            cls._c_kernel = _dispatch.CKernel(f"{cls.NAME}_cpu.c", f"{cls.NAME}_step", "count params:ptrs grads:ptrs "
                                              f"codes:ptrs*{k} absmax:ptrs*{k} numel:i64s bf16:i32s comps:ptrs "
                                              "keys:i32s mode:mode maps:ptr coef:f32s*", cls._probe)
        return cls._c_kernel

    @staticmethod
    def native_fits(p: Tensor, g: Tensor) -> bool:
        return (_native.plain(p, g) and p.device.type == "cpu" and p.dtype == g.dtype
                and p.dtype in (torch.float32, torch.bfloat16) and p.is_contiguous() and g.is_contiguous())

    @classmethod
    def choose(cls, p: Tensor, g: Tensor, compile: bool | None):
        """The one dispatch point (automatic mode: ``compile`` None): on CUDA the Triton kernel (:meth:`triton_fn`)
        for contiguous tensors; on CPU the C kernel's op for plain contiguous fp32/bf16 tensors; else the compiled
        kernel unless ``compile=False`` or compiling failed, else the eager one."""
        if compile is None and cls.TRITON_KERNEL and cls.triton_fits(p, g) and cls.triton_fn(p.device) is not None:
            return cls.triton_fn(p.device)
        if compile is None and cls.C_KERNEL and cls.native_fits(p, g) and cls.native_fn() is not None:
            return cls._op
        if compile is False:
            return cls.eager_kernel
        return cls.compiled_kernel(p.device) or cls.eager_kernel

    @staticmethod
    def triton_fits(p: Tensor, g: Tensor) -> bool:
        """Whether the Triton kernels can step ``p``: :func:`._triton.applies` (CUDA, Triton importable), contiguous
        fp32/bf16/fp16 weights and gradients (logged once where CUDA has no Triton)."""
        _dispatch.note_missing_triton(p)
        return (_triton.applies(p, g) and p.dtype in _TRITON_DTYPES and g.dtype in _TRITON_DTYPES
                and p.is_contiguous() and g.is_contiguous())

    @classmethod
    def triton_fn(cls, device: torch.device):
        """The family's Triton step (``blockwise_triton.{NAME}``) on ``device``, once its probe there agreed with
        the eager kernel (:meth:`_probe`); else None (Triton failed or disagreed: logged once)."""
        def load():
            from . import blockwise_triton
            return getattr(blockwise_triton, cls.NAME)

        return _dispatch.probed(cls.NAME, device, load, cls._probe, "the eager one")

    @classmethod
    def run_native(cls, fn, params, grads, codes, absmax, coef, threads=None, comps=(), keys=(),
                   compensation: str = "none") -> None:
        """``fn`` (the C function) over all the tensors at once, blocks split over threads (``threads``: see
        :func:`._native.run_split`). ``codes`` / ``absmax`` hold each moment's tensors in turn; bf16 weights are
        written under ``compensation`` (``comps``: Kahan buffers, empty tensors for none; ``keys``: noise keys)."""
        k, count, numel = len(cls.MOMENTS), len(params), [p.numel() for p in params]
        by_moment = [c for i in range(k) for c in codes[i::k]], [a for i in range(k) for a in absmax[i::k]]
        codec = cls.CODEC
        cls.c_kernel().run(fn, count, params, grads, *by_moment, numel, [p.dtype == torch.bfloat16 for p in params],
                           comps or [None] * count, keys or [0] * count, compensation, codec.c_tables(), coef,
                           n=sum(codec.blocks(n) for n in numel), unit=codec.BLOCK, threads=threads)

    @classmethod
    def native_step(cls, fn, items, threads: int | None = None, compensation: str = "none") -> None:
        """``items``: (weight, gradient, state, coefficients, weight noise key) of each tensor, in one call of
        ``fn``, bf16 weights written under ``compensation``."""
        params, grads, codes, absmax, coef, comps, keys = cls._lists(items)
        cls.run_native(fn, params, grads, codes, absmax, coef, threads, comps, keys, compensation)

    @classmethod
    def _lists(cls, items) -> tuple[list, ...]:
        """(params, grads, codes, absmax, coef, comps, keys): the op's lists, from (weight, gradient, state,
        coefficients, weight noise key) items; a tensor without a Kahan buffer gets an empty tensor (NULL in C)."""
        keys = [k for k, _ in cls.MOMENTS]
        empty = torch.empty(0, dtype=torch.bfloat16)
        return ([it[0] for it in items], [it[1] for it in items], [it[2][k] for it in items for k in keys],
                [it[2][f"{k}_absmax"] for it in items for k in keys], [x for it in items for x in it[3]],
                [it[2].get("kahan_comp", empty) for it in items], [it[4] for it in items])

    @classmethod
    def _probe(cls, fn, device: torch.device | None = None) -> bool:
        """Three steps of the C function ``fn`` (``device`` None: a tensor of 515 blocks and a partial one, split over 3
        threads: whatever team OpenMP gives, every block must be done) or of the Triton launch ``fn`` on ``device``
        (10 blocks, the last partial: a program of whole blocks, blockwise_triton.NB = 8, and a partial one), against
        the eager kernel, with a gradient whose square overflows, on fp32 weights and on bf16 weights under each
        compensation: codes and absmaxes equal; fp32
        weights within 4 ulp of themselves or of the update (torch's fp32 sqrt on CPU is not correctly rounded,
        C's is), so bf16 weights within one bf16 ulp (such a difference can cross a rounding boundary) and, under
        Kahan, weight + buffer within 1e-4 of eager's."""
        gen = torch.Generator().manual_seed(0)
        native = device is None
        block = cls.CODEC.BLOCK
        n = (2 * _native._MIN_PER_THREAD + 3 * block if native else 9 * block) + 37
        p0 = torch.randn(n, generator=gen)
        grads = [torch.randn(n, generator=gen) * 10.0 ** -k for k in range(3)]
        grads[1][5] = 2e19
        device = torch.device("cpu" if device is None else device)
        group = cls.probe_group()
        for dtype, mode in ((torch.float32, "none"), *((torch.bfloat16, m) for m in C_MODES)):
            runs = []
            for candidate in (True, False):
                p = p0.to(device, dtype)
                state = {**cls.zero_state(n, device), "step": torch.zeros((), device=device)}
                if applies(p, mode) and mode == "kahan":
                    state["kahan_comp"] = torch.zeros(n, dtype=torch.bfloat16, device=device)
                for t, g in enumerate(grads, 1):
                    coef, key, g = cls.coefficients(group, t), weight_key(0, t), g.to(device, dtype)
                    if candidate and native:
                        cls.native_step(fn, [(p, g, state, coef, key)], threads=3, compensation=mode)
                    elif candidate:
                        _triton.advance_steps([state["step"]], _triton.zero_flag(device))
                        fn([(p, g, state, 0)], _triton.zero_flag(device), group, mode, {})
                    else:
                        cls.step_8bit(p, g, state, torch.tensor(coef, dtype=torch.float32, device=device),
                                      cls.eager_kernel, mode, key)
                runs.append((p, state))
            (pn, sn), (pe, se) = runs
            if not all(torch.equal(sn[k], se[k]) for k in se if k not in ("kahan_comp", "step")):
                return False
            tol = 4 * 2.0**-23 if dtype == torch.float32 else 2.0**-7
            if not torch.allclose(pn.float(), pe.float(), rtol=tol, atol=tol * 1e-2):
                return False
            if "kahan_comp" in sn and not torch.allclose(pn.float() + sn["kahan_comp"].float(),
                                                         pe.float() + se["kahan_comp"].float(), rtol=1e-4, atol=1e-6):
                return False
        return True

    # --- per-tensor steps ------------------------------------------------------------------------------------

    @classmethod
    def zero_state(cls, numel: int, device, moments=None) -> dict:
        """Fresh 8-bit state of a tensor of ``numel`` elements: zero codes in whole blocks, zero absmaxes (of each of
        ``moments``, default :attr:`MOMENTS`)."""
        state = {}
        for key, signed in moments or cls.MOMENTS:
            state[key], state[f"{key}_absmax"] = cls.CODEC.zero_codes(numel, signed, device)
        return state

    @classmethod
    def step_8bit(cls, p: Tensor, g: Tensor, state: dict, coef: Tensor, kernel, compensation: str = "none",
                  key: int = 0, offset: int = 0) -> None:
        """Update ``p`` and its 8-bit state: full blocks in bounded kernel calls, a partial last block in another.
        A bf16/fp16 weight under a compensation is stepped as an fp32 copy, then written by
        :func:`.compensation.write` (its Kahan buffer ``state["kahan_comp"]``, its noise ``key``; ``offset``: the
        number of ``p``'s first element in the whole tensor, where ``p`` is an FSDP2 shard)."""
        flat = p.detach().view(-1) if p.is_contiguous() else p.detach().contiguous().view(-1)
        gflat = g.reshape(-1)
        n = flat.numel()
        BLOCK, WORDS = cls.CODEC.BLOCK, cls.CODEC.WORDS  # noqa: N806 - the codec's constants
        full = n // BLOCK
        keys = [k for k, _ in cls.MOMENTS]
        words = [state[k].view(torch.float32) for k in keys]
        absmax = [state[f"{k}_absmax"] for k in keys]
        comp = state.get("kahan_comp") if compensation == "kahan" else None
        comp = None if comp is None else comp.view(-1)
        key_t = torch.tensor(key, dtype=torch.int32, device=p.device) if compensation == "stochastic" else None

        def run(pw, gw, start, cw, *state_args):  # pw: (blocks, 256) weights from element `start`; cw: their buffer
            if not applies(pw, compensation):
                return cls._store(kernel, [pw, gw, *state_args], coef)
            old = pw.float()
            work = old.clone()
            cls._store(kernel, [work, gw, *state_args], coef)
            write(pw, old, work - old, cw, compensation, key_t, element_index(pw, offset + start))

        for a in range(0, full, _CALL_BLOCKS):  # bounded calls: a 30522x768 embedding in one would allocate 190 MB
            b = min(a + _CALL_BLOCKS, full)
            args = [flat[a * BLOCK:b * BLOCK].view(-1, BLOCK), gflat[a * BLOCK:b * BLOCK].view(-1, BLOCK),
                    *(w[a * WORDS:b * WORDS].view(-1, WORDS) for w in words), *(x[a:b] for x in absmax)]
            if kernel is not cls.eager_kernel:
                for t in args:  # one graph for all block counts
                    torch._dynamo.maybe_mark_dynamic(t, 0)
            cw = None if comp is None else comp[a * BLOCK:b * BLOCK].view(-1, BLOCK)
            run(args[0], args[1], a * BLOCK, cw, *args[2:])
        if n > full * BLOCK:  # zero-padded last block: zero gradient and weight keep zero moments there
            tail, r = slice(full * BLOCK, n), n - full * BLOCK
            pt = torch.zeros(1, BLOCK, dtype=p.dtype, device=p.device)
            gt = torch.zeros(1, BLOCK, dtype=g.dtype, device=p.device)
            pt[0, :r] = flat[tail]
            gt[0, :r] = gflat[tail]
            ct = None if comp is None else torch.zeros(1, BLOCK, dtype=comp.dtype, device=p.device)
            if ct is not None:  # the tail's buffer, padded like its weights
                ct[0, :r] = comp[tail]
            run(pt, gt, full * BLOCK, ct, *(w[full * WORDS:].view(1, WORDS) for w in words),
                *(x[full:] for x in absmax))
            if ct is not None:
                comp[tail] = ct[0, :r]
            flat[tail] = pt[0, :r]
        if not p.is_contiguous():
            p.detach().copy_(flat.view(p.shape))

    @classmethod
    def _store(cls, kernel, args, coef) -> None:
        if kernel is cls.eager_kernel:
            out = kernel(*args, coef)
        else:
            out = _dispatch.call(kernel, cls.eager_kernel, cls.FAMILY, *args, coef)
        for dst, src in zip(args[2:], out):  # returned, not written in place: inductor keeps a block local
            dst.copy_(src)

    # --- the optimizer -------------------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        """As torch's, after :func:`..options.check_group` (hyperparameters, maximize, parameters listed twice) and
        :func:`._sharded.check` (a DTensor placed as the step can serve)."""
        param_group = check_group(self, param_group, self.FAMILY, self.check_family_keys)
        params = param_group.get("params", ()) if isinstance(param_group, dict) else ()
        for i, p in enumerate([params] if torch.is_tensor(params) else params):
            _sharded.check(p, self.FAMILY, f"parameter {i} of the new param group")
        super().add_param_group(param_group)

    def moments_of(self, group: dict) -> tuple[tuple[str, bool], ...]:
        """The quantized state keys (key, signed) of ``group``'s tensors: :attr:`MOMENTS`, the ones its kernels step
        (see the class docstring for a family whose groups differ)."""
        return self.MOMENTS

    def _has_8bit_state(self, p: Tensor, group: dict) -> bool:
        """Whether ``p`` keeps quantized state: :func:`.facts.keeps_quantized_state` of its whole tensor (else fp32:
        small tensors, those named at construction, and under FSDP2 tensors whose rows are not whole blocks)."""
        sharded, shape, size = _sharded.is_sharded(p), _sharded.global_shape(p), group["min_8bit_size"]
        keep_32bit, codec = id(p) in self._fp32_ids, self.CODEC
        if keeps_quantized_state(shape, codec, sharded=sharded, min_8bit_size=size, keep_32bit=keep_32bit):
            return True
        if sharded and keeps_quantized_state(shape, codec, sharded=False, min_8bit_size=size, keep_32bit=keep_32bit):
            _dispatch.log_once(logging.INFO, ("sharded-fp32", self.FAMILY), "hf_efficient: %s keeps fp32 state for "
                               "FSDP2-sharded tensors whose rows are not whole blocks of %d elements (vectors; the "
                               "first seen: shape %s): 8-bit blocks would straddle ranks and move with the mesh",
                               self.FAMILY, codec.BLOCK, tuple(p.shape))
        return False

    def _allocate_together(self, group: dict) -> None:
        """Fresh 8-bit state for the group's CPU tensors that start one at this step, each moment's codes and absmaxes
        as views of one buffer: the C kernel then reads the group's state as one stream, as fast as one tensor of
        their size, where separate allocations step measurably slower. A loaded state is packed the same way
        (:meth:`_pack`). Other devices keep a buffer per tensor (nothing measured there)."""
        params = [p for p in group["params"] if p.grad is not None and p.is_cpu and not self.state.get(p)
                  and not _sharded.is_sharded(p) and self._has_8bit_state(p, group)]
        codec = self.CODEC
        sizes = [codec.blocks(p.numel()) for p in params]
        for p in params:
            self.state[p]["step"] = torch.tensor(0.0, dtype=torch.float32)
        for key, signed in self.moments_of(group) if params else ():
            codes, absmax = codec.zero_codes(sum(sizes) * codec.BLOCK, signed, "cpu")
            per_block = codec.BLOCK * codec.BITS // 8  # code bytes per block in memory
            for p, c, a in zip(params, codes.split([n * per_block for n in sizes]), absmax.split(sizes)):
                self.state[p][key], self.state[p][f"{key}_absmax"] = c, a

    def _init_state(self, p: Tensor, group: dict, on_device: bool = False) -> dict:
        """``p``'s state, created at its first step; ``on_device``: a kernel that reads the step count on the
        device (Triton) steps ``p``, so the count lives there (a loaded one is moved there once)."""
        state = self.state[p]
        if _sharded.is_sharded(p):
            return self._init_sharded_state(p, group)
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device if on_device else None)
            if not self._has_8bit_state(p, group):
                for key, _ in self.moments_of(group):
                    state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            else:
                state.update(self.zero_state(p.numel(), p.device, self.moments_of(group)))
        if on_device and state["step"].device != p.device:
            state["step"] = state["step"].to(p.device)
        if group["compensation"] == "kahan" and p.dtype in LOW_PRECISION and "kahan_comp" not in state:
            # row-major like the kernels' flat view; also after a resume from a state without one (zero: nothing owed)
            state["kahan_comp"] = torch.zeros(p.shape, dtype=torch.bfloat16, device=p.device)
        return state

    def _init_sharded_state(self, p, group: dict) -> dict:
        """:meth:`_init_state` for an FSDP2 parameter: DTensors placed like its rows (codes of its shape, absmaxes
        ``(rows, row length / BLOCK)``; codes of the codec's canonical shape, which keeps the rows: see the module
        docstring), the step count a plain CPU tensor."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            eight_bit = self._has_8bit_state(p, group)
            for key, signed in self.moments_of(group):
                if not eight_bit:
                    state[key] = _sharded.zeros(p, p.shape, torch.float32)
                    continue
                state[key] = _sharded.zeros(p, self.CODEC.canonical_shape(p.shape), torch.uint8)
                _sharded.local(state[key]).fill_(self.CODEC.ZERO_CODE[signed])
                state[f"{key}_absmax"] = _sharded.zeros(p, _absmax_shape(p, self.CODEC), torch.float32)
        if group["compensation"] == "kahan" and p.dtype in LOW_PRECISION and "kahan_comp" not in state:
            state["kahan_comp"] = _sharded.zeros(p, p.shape, torch.bfloat16)
        return state

    def _step_sharded(self, group: dict, items: list) -> None:
        """Step FSDP2 shards ``items`` (parameter, state, position): each rank its local shard, 8-bit state with the
        eager kernel (the compiled one under ``compile=True``), fp32 state through :meth:`step_32bit`'s torch path;
        the noise numbered as in the whole tensor. Elementwise: nothing is summed across ranks."""
        fp32, offsets = [], []
        for p, state, position in items:
            lp, lg, local = _sharded.local(p), _sharded.local(p.grad), _sharded.to_local_state(state)
            if state[self.moments_of(group)[0][0]].dtype != torch.uint8:
                fp32.append((lp, lg, local, position))
                offsets.append(_sharded.global_offset(p))
                continue
            state["step"] += 1
            step = int(state["step"].item())
            coef = torch.tensor(self.coefficients(group, step), dtype=torch.float32, device=lp.device)
            flat = {k: v if k in ("step", "kahan_comp") else v.view(-1) for k, v in local.items()}  # kernels' views
            self.step_8bit(lp, lg, flat, coef, self.choose(lp, lg, group["compile"] or False), group["compensation"],
                           weight_key(position, step), _sharded.global_offset(p))
        if fp32:  # compile=False: torch's path, the one that numbers the noise from each shard's offset
            self.step_32bit({**group, "compile": False}, fp32, offsets)

    def _triton_launch(self, p: Tensor, group: dict):
        """The Triton step of ``p`` where it takes it (automatic mode, :meth:`choose`'s first case), else None."""
        if group["compile"] is not None or not self.TRITON_KERNEL or not self.triton_fits(p, p.grad):
            return None
        return self.triton_fn(p.device)

    def _uses_triton(self, p: Tensor, group: dict) -> bool:
        """Whether a Triton kernel steps ``p``: its 8-bit one, or the family's fp32-state one (:attr:`TRITON_FP32`)."""
        if _sharded.is_sharded(p):  # shards: the eager / torch paths (_step_sharded)
            return False
        state = self.state.get(p)
        if state[self.moments_of(group)[0][0]].dtype == torch.uint8 if state else self._has_8bit_state(p, group):
            return self._triton_launch(p, group) is not None
        return self.TRITON_FP32 and group["compile"] is None and self.triton_fits(p, p.grad)

    def takes_found_inf(self) -> bool:
        """Whether the coming step runs Triton kernels for every tensor with a gradient (the guard's protocol,
        :func:`._dispatch.takes_found_inf`)."""
        return _dispatch.takes_found_inf(self, lambda p, group, st: self._uses_triton(p, group))

    @torch.no_grad()
    def step(self, closure=None):
        loss = start_step(self, closure, self.FAMILY)  # closure, then sparse gradients refused: nothing half-done
        _sharded.check_placements(self.param_groups, self.FAMILY)
        position = 0  # a parameter's index across groups, as in state_dict(): its stochastic-rounding stream
        for group in self.param_groups:
            self._step_group(group, position)
            position += len(group["params"])
        return loss

    def _step_group(self, group: dict, position: int) -> None:
        """Step the parameters of ``group`` that have a gradient by the family's kernels; ``position``: the index of
        its first parameter across groups (the noise stream of each)."""
        self._allocate_together(group)
        first = self.moments_of(group)[0][0]
        sharded = []  # (p, state, position) of FSDP2 parameters
        mode = group["compensation"]
        fp32 = []  # (p, grad, state, position) of tensors with fp32 state
        coefs = {}  # (step, device) -> coefficients, as a list (C kernel) and a tensor (the others)
        native = []  # (p, grad, state, coefficients, key) of the tensors that go to the C kernel, in one call
        gpu = {}  # device -> (launch, [(p, grad, state, position)]) of the tensors a Triton kernel steps
        for position, p in enumerate(group["params"], position):
            if p.grad is None:
                continue
            state = self._init_state(p, group, self._uses_triton(p, group))
            if _sharded.is_sharded(p):
                sharded.append((p, state, position))
                continue
            if state[first].dtype != torch.uint8:  # torch's kernels count the step themselves
                fp32.append((p, p.grad, state, position))
                continue
            launch = self._triton_launch(p, group)
            if launch is not None:  # the step count stays on the device: counted and read there
                gpu.setdefault(p.device, (launch, []))[1].append((p.detach(), p.grad, state, position))
                continue
            state["step"] += 1
            step = int(state["step"].item())
            key = (step, p.device)
            if key not in coefs:
                coef = self.coefficients(group, step)
                coefs[key] = coef, torch.tensor(coef, dtype=torch.float32, device=p.device)
            noise = weight_key(position, step)
            kernel = self.choose(p, p.grad, group["compile"])
            if kernel is self._op:
                native.append((p.detach(), p.grad, state, coefs[key][0], noise))
            else:
                self.step_8bit(p, p.grad, state, coefs[key][1], kernel, mode, noise)
        if native:
            params, grads, codes, absmax, coef, comps, keys = self._lists(native)
            self._op(params, grads, codes, absmax, comps, keys, coef, mode, -1)
        for device, (launch, items) in gpu.items():
            flag = _triton.flag(self, device)  # set: every launch returns at once, and no step is counted
            _triton.advance_steps([it[2]["step"] for it in items], flag)
            with on_device(device):  # one launch per (weight dtype, gradient dtype): _triton.launch
                launch(items, flag, group, mode, self._tables.setdefault(id(group), {}))
        if fp32:
            self.step_32bit(group, fp32)
        if sharded:
            self._step_sharded(group, sharded)

    @staticmethod
    def noise_keys(items) -> list[int]:
        """The weight noise keys of fp32-state items (p, grad, state, position) at this step (steps not yet counted;
        reads each step on the host: for the paths that count steps there)."""
        return [weight_key(pos, int(st["step"].item()) + 1) for _, _, st, pos in items]

    def state_dict(self) -> dict:
        """torch's state dict, with 8-bit codes in the canonical layout (the parameter's shape, element order)."""
        sd = super().state_dict()
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        for i, (p, moments) in zip(ids, self._params_and_moments()):
            st = sd["state"].get(i)
            if st is not None and st[moments[0][0]].dtype == torch.uint8:
                sd["state"][i] = {**st, **{k: _to_canonical(st[k], p, self.CODEC) for k, _ in moments}}
        return sd

    def _params_and_moments(self) -> list[tuple[Tensor, tuple]]:
        """Each parameter, in state_dict order, with its group's quantized keys (:meth:`moments_of`)."""
        return [(p, self.moments_of(g)) for g in self.param_groups for p in g["params"]]

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a canonical state dict, all or nothing: everything is checked first (groups and their
        hyperparameters, each state's keys, dtypes, shapes, absmax lengths, step), and a ValueError names what is
        wrong before anything changed. Saved dtypes are kept (torch would cast the uint8 codes and the fp32
        moments of low-precision weights to the weight's dtype): uint8 codes resume as 8-bit state."""
        where = f"{self.FAMILY}.load_state_dict"
        groups = self._checked_groups(state_dict, where)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        unknown = set(state_dict["state"]) - set(ids)
        if unknown:
            raise ValueError(f"{where}: state for parameter ids {sorted(unknown, key=str)} that no saved param group "
                             f"lists (they list {ids}); nothing was loaded")
        loaded = {}
        for i, (p, moments) in zip(ids, self._params_and_moments()):
            if state_dict["state"].get(i) is not None:
                loaded[p] = self._checked_state(state_dict["state"][i], p, f"{where}: parameter {i}", moments)
        super().load_state_dict({**state_dict, "param_groups": groups, "state": {}})
        for p, st in loaded.items():
            self.state[p] = st
        drop_unused_buffers(self, self.FAMILY)
        self._pack()

    def _pack(self) -> None:
        """Each group's loaded 8-bit state on CPU moved into one buffer per moment, as a fresh one is allocated
        (:meth:`_allocate_together`), so that a resumed run steps as fast as the original (one moment's size in
        flight at a time)."""
        for group in self.param_groups:
            moments = self.moments_of(group)
            first = moments[0][0]
            params = [p for p in group["params"] if p.is_cpu and not _sharded.is_sharded(p)
                      and first in self.state.get(p, {}) and self.state[p][first].dtype == torch.uint8]
            for key in (k for m, _ in moments for k in (m, f"{m}_absmax")) if params else ():
                parts = [self.state[p][key] for p in params]
                flat = torch.cat([t.reshape(-1) for t in parts])
                for p, t, v in zip(params, parts, flat.split([t.numel() for t in parts])):
                    self.state[p][key] = v.view(t.shape)

    def _checked_groups(self, state_dict: dict, where: str) -> list[dict]:
        """The saved groups, each completed with this optimizer's defaults and checked as add_param_group checks."""
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) or not isinstance(
                state_dict.get("param_groups"), list):
            raise ValueError(f"{where}: expected a dict with 'state' (a dict) and 'param_groups' (a list), as "
                             f"state_dict() returns; got {type(state_dict).__name__} with keys "
                             f"{sorted(state_dict) if isinstance(state_dict, dict) else None}; nothing was loaded")
        saved = state_dict["param_groups"]
        sizes = [len(g.get("params", ())) if isinstance(g, dict) else None for g in saved]
        if sizes != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"{where}: the saved param groups hold {sizes} parameters, this optimizer's "
                             f"{[len(g['params']) for g in self.param_groups]}: the state belongs to another model or "
                             "grouping; nothing was loaded")
        out = []
        for gi, g in enumerate(saved):
            group = {**self.defaults, **g}
            try:
                # its own keys and the flags that change the math: another library's extras (bnb's eps) ignored
                mine = [k for k in group if k in self.defaults or k in ("maximize", "amsgrad")]
                check_group(None, {**{k: group[k] for k in mine}, "params": ()}, self.FAMILY, self.check_family_keys)
            except ValueError as e:
                raise ValueError(f"{where}: saved param group {gi}: {e}; nothing was loaded") from e
            out.append(group)
        return out

    def _checked_state(self, saved, p: Tensor, where: str, moments=None) -> dict:
        """The in-memory state of ``p`` from its saved (canonical) state, or a ValueError saying what is wrong
        (``moments``: its group's quantized keys, :meth:`moments_of`)."""
        if not isinstance(saved, dict):
            raise ValueError(f"{where}: its state is a {type(saved).__name__}, not a dict; nothing was loaded")
        signs = dict(moments or self.MOMENTS)
        moments = list(signs)
        eight_bit = isinstance(saved.get(moments[0]), Tensor) and saved[moments[0]].dtype == torch.uint8
        keys = {"step", *moments} | ({f"{k}_absmax" for k in moments} if eight_bit else set())
        if set(saved) - {"kahan_comp"} != keys:
            raise ValueError(f"{where}: state keys {sorted(saved)}, expected {sorted(keys)} ("
                             f"{'8-bit' if eight_bit else 'fp32'} moments; and kahan_comp for compensated bf16/fp16 "
                             "weights); nothing was loaded")
        check_step(saved["step"], where)
        comp = saved.get("kahan_comp")
        if comp is not None and not (isinstance(comp, Tensor) and comp.is_floating_point()
                                     and tuple(comp.shape) == tuple(p.shape) and bool(comp.isfinite().all())):
            raise ValueError(f"{where}: kahan_comp is {_describe(comp)}; expected a finite float tensor of the "
                             f"parameter's shape {tuple(p.shape)}; nothing was loaded")
        shape = self.CODEC.canonical_shape(p.shape) if eight_bit else tuple(p.shape)
        for key in moments:
            t = saved[key]
            good = isinstance(t, Tensor) and (t.dtype == torch.uint8 if eight_bit else t.is_floating_point())
            if not good or tuple(t.shape) != shape:
                want = "uint8 codes" if eight_bit else "a float tensor"
                raise ValueError(f"{where}: {key} is {_describe(t)}; expected {want} of shape {shape} (the "
                                 f"parameter's: {tuple(p.shape)}); nothing was loaded")
        st = {"step": torch.as_tensor(saved["step"], dtype=torch.float32).detach().clone().reshape(())}
        if comp is not None:
            st["kahan_comp"] = comp.to(device=p.device, dtype=torch.bfloat16).contiguous().clone()
        if not eight_bit:
            for key, signed in signs.items():
                check_saved_tensor(saved[key], key, where, signed=signed, first_moment=signed)
                st[key] = saved[key].to(device=p.device, dtype=torch.float32).clone()
            return st
        shapes = _absmax_shapes(p, self.CODEC)
        for key in (f"{k}_absmax" for k in moments):
            t = saved[key]
            if not isinstance(t, Tensor) or not t.is_floating_point() or tuple(t.shape) not in shapes:
                raise ValueError(f"{where}: {key} is {_describe(t)}; expected a float tensor of shape "
                                 f"{' or '.join(map(str, shapes))}, one absmax per block of {self.CODEC.BLOCK} elements; "
                                 "nothing was loaded")
            # a plain parameter's flat (a whole absmax taken from FSDP2 shards is row-major: the same order)
            plain = lambda: t.to(p.device, torch.float32).reshape(-1).clone()  # noqa: E731 - a copy: never the caller's
            st[key] = _placed_absmax(t, p, self.CODEC) if _sharded.is_sharded(p) else plain()
            first = signs[key.removesuffix("_absmax")]  # the scale of a first moment
            check_saved_tensor(st[key], key, where, signed=False, first_moment=first)
        for key, signed in signs.items():
            st[key] = _from_canonical(saved[key], p, signed, self.CODEC)
        return st


def _absmax_shape(p, codec: Codec) -> tuple[int, ...]:
    """In-memory absmax shape: ``(blocks,)``, or ``(rows, blocks per row)`` for an FSDP2 parameter (placed like its
    rows)."""
    if _sharded.is_sharded(p):
        return (p.shape[0], _sharded.global_numel(p) // p.shape[0] // codec.BLOCK)
    return (codec.blocks(p.numel()),)


def _absmax_shapes(p, codec: Codec) -> list[tuple[int, ...]]:
    """Saved absmax shapes ``p`` loads: its own, and for a parameter whose rows are whole blocks also the other of
    ``(blocks,)`` (a single-file state: DCP's full-state loader shards it as a vector) and ``(rows, blocks per row)``
    (a whole state taken from FSDP2 shards): the same absmaxes in the same order."""
    shapes = [_absmax_shape(p, codec)]
    if rows_of_blocks(p.shape, codec.BLOCK):
        numel = _sharded.global_numel(p)
        shapes += [s for s in ((codec.blocks(numel),), (p.shape[0], numel // p.shape[0] // codec.BLOCK))
                   if s != shapes[0]]
    return shapes


def _placed_absmax(t, p, codec: Codec):
    """A loaded absmax of an FSDP2 parameter ``p`` in memory: a DTensor ``(rows, blocks per row)`` placed like ``p``.
    One already so is copied; another (a plain whole one, or a ``(blocks,)`` vector that DCP sharded by blocks, not
    rows) is gathered whole and re-sharded by rows (a collective, as the load is)."""
    shape = _absmax_shape(p, codec)
    if _sharded.is_sharded(t) and tuple(t.shape) == shape and tuple(t.placements) == tuple(p.placements):
        return t.to(dtype=torch.float32).clone()
    return _sharded.shard_like(p, _sharded.whole(t).to(torch.float32).reshape(shape))


def _to_canonical(codes, p, codec: Codec):
    """``codec.to_canonical``, of each rank's shard for an FSDP2 parameter (its rows are whole blocks, so
    the interleaving never crosses a shard)."""
    if not _sharded.is_sharded(p):
        return codec.to_canonical(codes, p)
    return _sharded.like(codes, codec.to_canonical(_sharded.local(codes).reshape(-1), _sharded.local(p)))


def _from_canonical(codes, p, signed: bool, codec: Codec):
    """``codec.from_canonical``, shard by shard for an FSDP2 parameter (codes of its shape, placed alike)."""
    if not _sharded.is_sharded(p):
        return codec.from_canonical(codes, p, signed)
    lp = _sharded.local(p)
    return _sharded.like(codes, codec.from_canonical(_sharded.local(codes), lp, signed).view(codec.canonical_shape(
        lp.shape)))

