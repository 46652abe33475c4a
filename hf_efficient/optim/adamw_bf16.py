"""AdamW that trains bf16 / fp16 weights directly: no fp32 master copy, and no stale weights.

A bf16 weight near 1.0 moves in steps of 2**-7; an AdamW update of ``lr = 1e-4`` is far below half of
that, so rounding the new weight to bf16 throws the update away, every step (the "stale weights" of
Gopher, appendix C2). Two remedies that keep the weights in bf16:

* ``compensation="kahan"`` (default): a bf16 buffer ``kahan_comp`` carries the part of each update
  that the rounded weight could not absorb into the next step (Kahan summation). 6 bytes of state
  per parameter (``exp_avg``, ``exp_avg_sq``, ``kahan_comp``), against 8 for fp32 AdamW plus 4 for an
  fp32 master copy.
* ``compensation="stochastic"``: round the new weight up or down at random, with the probabilities
  that make the rounding unbiased. No buffer: 4 bytes per parameter.
* ``compensation="none"``: round to nearest, i.e. the stale-weights behaviour, for comparison.

Arithmetic inside the step is fp32 whatever the storage; state is stored in bf16 (also for fp16 weights,
whose range cannot hold a squared gradient). Parameters that are not bf16/fp16 get plain
``torch.optim.AdamW`` (state in their dtype, no compensation).

``exp_avg_sq`` is stored with stochastic rounding (except under ``"none"``): with beta2 = 0.999 its
per-step decrease is below half a bf16 ulp, so rounded to nearest it could never decrease, and the loss ends
measurably above fp32 AdamW's (docs/results/convergence.md).

Stochastic rounding needs no random state: its noise is a hash of (parameter position, step, element),
so a resumed run rounds exactly as the uninterrupted one would, and data-parallel replicas agree.

Speed: on CPU, bf16 weights go through a small C kernel (``adamw_bf16_cpu.c``, built once per machine
with the system C compiler, see :mod:`._native`): eager's operations in eager's order, vectorized by the
compiler, all tensors of a step in one call on torch's threads, through the op ``hf_efficient::adamw_bf16_step``
(it shows in the profiler and composes with ``torch.compile``). It must pass the compiled kernel's probe, in
every mode, before it is used; kernels are cached, probed and published by :mod:`._dispatch`.
``compile=True`` asks for the compiled kernel instead, and fp16 weights always get it: one
``torch.compile``'d (inductor C++) kernel per tensor does the whole step in a single pass (compiled on the
first step, a few seconds; inductor caches it on disk); tensors below ``_SMALL_NUMEL`` share one call.
Without a working compiler it falls back to the foreach path (same math, eager, much slower). The kernel is
compiled with ``emulate_precision_casts``: without it inductor elides the bf16 round trip ``new.float()``
that the compensation is computed from, and Kahan silently degrades to round-to-nearest (a probe on the
first step checks), and with ``cpp.dynamic_threads``: the loop is parallel whatever the size of the first
call, the probe's. The C kernel moves 18 bytes per parameter where torch's fused fp32 AdamW moves 28; the compiled
kernel is slower: inductor turns the bit operations of stochastic rounding into scalar code (step times:
docs/results/bench_step.md).

On CUDA (automatic path), bf16/fp16 weights go through a Triton kernel (:mod:`.adamw_triton`) once it agreed with
the eager kernel on a probe on that device: the eager kernel's operations and noise in one pass, one launch per
large tensor and one for the small ones, step counts on the device, nothing read on the host. Without Triton, or
where the probe fails, the foreach path runs, one warning logged.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.adamw import adamw as _torch_adamw

from ..options import check_group, check_saved, start_step
from . import _dispatch, _native, _sharded, _triton
from .adamw import fused_takes
from .compensation import (COMPENSATIONS, LOW_PRECISION, WEIGHT_STREAM, check_compensation, hash_noise,
                           noise_key, round_stochastic, write, drop_unused_buffers, element_index)
from .facts import FIRST_MOMENT, KAHAN, PREFIX, SECOND_MOMENT, STEP, Family, kahan_keys

__all__ = ["ADAMW_BF16", "AdamWBF16", "adamw_bf16", "COMPENSATIONS"]


def _adamw_bf16_required(p, group) -> set[str]:
    return {"step", "exp_avg", "exp_avg_sq"} | kahan_keys(p, group, "kahan")


def _adamw_bf16_dtype(p) -> torch.dtype:
    """bf16 state for bf16 and fp16 weights (fp16's range underflows (1 - beta2) * grad**2); else the weight's."""
    return torch.bfloat16 if p.dtype in LOW_PRECISION else p.dtype


ADAMW_BF16 = Family(
    "adamw_bf16", {"step": STEP, "exp_avg": FIRST_MOMENT, "exp_avg_sq": SECOND_MOMENT, "kahan_comp": KAHAN},
    "adamw", _adamw_bf16_required, param_dtype=torch.bfloat16,
    compensation="kahan",  # the name made for bf16 + Kahan (stochastic met its target too: convergence.md)
    marks=frozenset({"kahan_comp"}), moment_dtype=_adamw_bf16_dtype,
    deepspeed="ZeRO keeps fp32 master partitions and steps those (with bf16 enabled too), so there are no bf16 "
              "weights for its compensated update: it trains as plain fp32 AdamW (the same weights as "
              f"{PREFIX}adamw), without the memory it exists to save")

logger = logging.getLogger(__name__)

_LOW_PRECISION = LOW_PRECISION
_BF16_MAX = torch.finfo(torch.bfloat16).max  # the largest value state may hold: fp32's rounds to bf16 inf
_SMALL_NUMEL = 1 << 16  # below this a compiled call costs more than gathering the tensor into a shared one
_FOREACH_CHUNK = 1 << 22  # elements per eager chunk: bounds the fp32 temporaries (~10 x 16 MiB)
# stochastic rounding and its noise: shared with every family (compensation.py)
_hash, _round_stochastic, _noise_key, _WEIGHT_STREAM = hash_noise, round_stochastic, noise_key, WEIGHT_STREAM


# ----------------------------------------------------------------------------------------------------
# Kernels. One set of tensor-level functions is both the single-tensor path (called as is) and the
# compiled path (torch.compile of the same functions), so the two cannot drift apart.
# coef = [beta1, 1 - beta1, beta2, 1 - beta2, 1 / sqrt(1 - beta2**t), eps, -lr * wd, lr / (1 - beta1**t)]
# (adamw_bf16_cpu.c's adamw_bf16_coef_t). -lr * wd, not the other families' decay 1 - lr * wd: these kernels return
# the step's delta, which the compensated write adds; p * (1 - lr * wd) - p would round it otherwise.
# ----------------------------------------------------------------------------------------------------


def _adamw_update(p32: Tensor, g: Tensor, m: Tensor, v: Tensor, coef: Tensor, noise: Tensor | None) -> Tensor:
    """Advance the moments (stored in bf16); return the fp32 AdamW update of ``p32``.

    ``noise`` rounds ``exp_avg_sq`` stochastically: with beta2 = 0.999 its largest decrease per step (0.1%)
    is below half a bf16 ulp (0.2% to 0.4%), so rounded to nearest it could only ever grow; the second
    moment has its own stale-weights problem. None rounds to nearest (``compensation="none"``).
    """
    g32 = g.float()
    # v clamped to bf16's largest finite value (fp32's largest rounds to bf16 inf): a finite gradient whose square
    # overflows would otherwise store inf, and v would stay inf (or turn m / v into NaN) for good. m needs no
    # clamp: it is a convex combination of m and g, both within bf16's range (a clamp would cost the C kernel time).
    m32 = m.float() * coef[0] + g32 * coef[1]
    v32 = (v.float() * coef[2] + (g32 * g32) * coef[3]).clamp(max=_BF16_MAX)
    m.copy_(m32)
    v.copy_(v32 if noise is None else _round_stochastic(v32, v.dtype, noise))
    denom = v32.sqrt() * coef[4] + coef[5]
    return p32 * coef[6] - (m32 / denom) * coef[7]


def _index(idx: Tensor | None, p: Tensor) -> Tensor:
    """Element numbers for the noise: row-major position in ``p`` unless given (pieces, gathered tensors)."""
    if idx is None:
        idx = torch.arange(p.numel(), dtype=torch.int32, device=p.device).view(p.shape)
    return idx


def _kernel(mode: str):
    """The step of one mode: moments, then the weight written by :func:`.compensation.write`."""
    def kernel(p, g, m, v, c, key, idx, coef):
        idx = _index(idx, p)
        p32 = p.float()
        update = _adamw_update(p32, g, m, v, coef, None if mode == "none" else _hash(key, idx))
        write(p, p32, update, c, mode, None if mode == "none" else key ^ _WEIGHT_STREAM, idx)

    kernel.__name__ = kernel.__qualname__ = f"_{mode}_"
    return kernel


_KERNELS = {mode: _kernel(mode) for mode in COMPENSATIONS}


# ----------------------------------------------------------------------------------------------------
# Paths. Each takes the tensors of one (step, device, dtype), the int32 noise key of each tensor (None
# under "none"), and the step's coefficients.
# ----------------------------------------------------------------------------------------------------


def _key(key: int | None, device) -> Tensor | None:
    return None if key is None else torch.tensor(key, dtype=torch.int32, device=device)


def _single_tensor(kernel, mode, params, grads, exp_avgs, exp_avg_sqs, comps, keys, coef, offsets=None):
    """The kernel on each tensor, in flat pieces of ``_FOREACH_CHUNK`` elements to bound its fp32 temporaries
    (``offsets``: each tensor's first element number where it is an FSDP2 shard: its noise is the whole tensor's)."""
    coef_t = torch.tensor(coef, dtype=torch.float32, device=params[0].device)
    for i, p in enumerate(params):
        ts = [p, grads[i], exp_avgs[i], exp_avg_sqs[i], comps[i] if comps else None]
        key = _key(keys[i] if keys else None, p.device)
        n, off = p.numel(), offsets[i] if offsets else 0
        if n <= _FOREACH_CHUNK or not all(t is None or t.is_contiguous() for t in ts):
            kernel(*ts, key, element_index(p, off) if off else None, coef_t)
            continue
        for a in range(0, n, _FOREACH_CHUNK):
            b = min(a + _FOREACH_CHUNK, n)
            idx = torch.arange(off + a, off + b, dtype=torch.int32, device=p.device)
            kernel(*(None if t is None else t.view(-1)[a:b] for t in ts), key, idx, coef_t)


def _foreach(kernel, mode, params, grads, exp_avgs, exp_avg_sqs, comps, keys, coef):
    """Same operations, in the same order, as the kernels, over lists (bitwise equal to the single-tensor path).

    On CPU torch's foreach ops loop over tensors anyway, and big fp32 temporaries cost more in page faults
    than in arithmetic, so tensors are cut into cache-sized flat pieces; elsewhere chunks only bound memory.
    """
    on_cpu = params[0].device.type == "cpu"
    piece, limit = (1 << 15, 1 << 18) if on_cpu else (None, _FOREACH_CHUNK)
    sets = [params, grads, exp_avgs, exp_avg_sqs] + ([comps] if comps else [])

    def run(chunk):  # chunk: (tensor index, start, end), end None for a whole strided tensor
        cut = [[ts[i] if b is None else ts[i].view(-1)[a:b] for i, a, b in chunk] for ts in sets]
        noise = None
        if keys:  # (key, element numbers) per piece, numbered as the kernel numbers them
            noise = [(_key(keys[i], t.device), _index(None, t) if b is None else
                      torch.arange(a, b, dtype=torch.int32, device=t.device)) for (i, a, b), t in zip(chunk, cut[0])]
        _foreach_chunk(mode, *cut[:4], cut[4] if comps else None, noise, coef)

    chunk, total = [], 0
    for i, p in enumerate(params):
        n = p.numel()
        if not all(ts[i].is_contiguous() for ts in sets):
            bounds = [(0, None)]
        else:
            step = piece or max(n, 1)
            bounds = [(a, min(a + step, n)) for a in range(0, n, step)] or [(0, 0)]
        for a, b in bounds:
            chunk.append((i, a, b))
            total += n if b is None else b - a
            if total >= limit:
                run(chunk)
                chunk, total = [], 0
    if chunk:
        run(chunk)


def _foreach_chunk(mode, P, G, M, V, C, noise, coef):
    b1, omb1, b2, omb2, inv_bc2, eps, decay, step_size = coef
    p32 = [p.float() for p in P]  # torch has no foreach dtype cast
    g32 = [g.float() for g in G]
    m32 = [m.float() for m in M]
    torch._foreach_mul_(m32, b1)
    torch._foreach_add_(m32, torch._foreach_mul(g32, omb1))
    v32 = [v.float() for v in V]
    torch._foreach_mul_(v32, b2)
    g2 = torch._foreach_mul(g32, g32)
    torch._foreach_mul_(g2, omb2)
    torch._foreach_add_(v32, g2)
    del g32, g2
    torch._foreach_clamp_max_(v32, _BF16_MAX)  # as in _adamw_update
    torch._foreach_copy_(M, m32)
    if noise is None:
        torch._foreach_copy_(V, v32)
    else:
        for v, x, (key, idx) in zip(V, v32, noise):
            v.copy_(_round_stochastic(x, v.dtype, _hash(key, idx)))
    denom = torch._foreach_sqrt(v32)
    del v32
    torch._foreach_mul_(denom, inv_bc2)
    torch._foreach_add_(denom, eps)
    ratio = torch._foreach_div(m32, denom)
    del m32, denom
    torch._foreach_mul_(ratio, step_size)
    update = torch._foreach_mul(p32, decay)
    torch._foreach_sub_(update, ratio)
    del ratio
    if mode == "kahan":
        torch._foreach_add_(update, [c.float() for c in C])  # y
        new = [t.to(p.dtype) for t, p in zip(torch._foreach_add(p32, update), P)]
        absorbed = [t.float() for t in new]
        torch._foreach_sub_(absorbed, p32)
        torch._foreach_sub_(update, absorbed)
        torch._foreach_copy_(C, update)
        torch._foreach_copy_(P, new)
    elif mode == "stochastic":
        for p, x, (key, idx) in zip(P, torch._foreach_add(p32, update), noise):
            p.copy_(_round_stochastic(x, p.dtype, _hash(key ^ _WEIGHT_STREAM, idx)))
    else:
        torch._foreach_copy_(P, torch._foreach_add(p32, update))


def _compiled(kernel, mode, params, grads, exp_avgs, exp_avg_sqs, comps, keys, coef):
    """One compiled call per large tensor (flat views); small tensors are gathered into one call."""
    device = params[0].device
    coef_t = torch.tensor(coef, dtype=torch.float32, device=device)
    small = []
    for i, p in enumerate(params):
        ts = [p, grads[i], exp_avgs[i], exp_avg_sqs[i]] + ([comps[i]] if comps else [])
        if p.numel() < _SMALL_NUMEL:
            small.append(i)
        elif all(t.is_contiguous() for t in ts):
            flat = [t.view(-1) for t in ts]
            _call(kernel, mode, *flat[:4], flat[4] if comps else None, _key(keys[i] if keys else None, device),
                  None, coef_t)
        else:  # rare (channels_last, transposed grads): the eager kernel handles any layout
            _single_tensor(_KERNELS[mode], mode, [p], [grads[i]], [exp_avgs[i]], [exp_avg_sqs[i]],
                           [comps[i]] if comps else None, [keys[i]] if keys else None, coef)
    if not small:
        return
    sizes = [params[i].numel() for i in small]
    cat = lambda ts: torch.cat([ts[i].reshape(-1) for i in small])  # noqa: E731
    P, G, M, V = cat(params), cat(grads), cat(exp_avgs), cat(exp_avg_sqs)
    C = cat(comps) if comps else None
    key = idx = None
    if keys:  # the same noise each element would get from a call of its own
        counts = torch.tensor(sizes, device=device)
        key = torch.repeat_interleave(torch.tensor([keys[i] for i in small], dtype=torch.int32, device=device), counts)
        starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        idx = (torch.arange(P.numel(), device=device) - starts).to(torch.int32)
    _call(kernel, mode, P, G, M, V, C, key, idx, coef_t)
    for flat, targets in ((P, params), (M, exp_avgs), (V, exp_avg_sqs), (C, comps)):
        if flat is not None:
            dst = [targets[i] for i in small]
            torch._foreach_copy_(dst, [t.view_as(d) for t, d in zip(flat.split(sizes), dst)])


@contextmanager
def _quiet():
    """Around compiled calls: fp16 weights with bf16 state make inductor note the mix, harmlessly."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "bf16 and fp16 are mixed")
        yield


def _call(kernel, mode, *args):
    """A compiled call; if compiling it fails (before anything ran), the eager kernel does this call instead (see
    :func:`._dispatch.call`: any other error propagates)."""
    with _quiet():
        _dispatch.call(kernel, _KERNELS[mode], "AdamWBF16", *args)


# ----------------------------------------------------------------------------------------------------
# Dispatch: kernels cached, probed and published by :mod:`._dispatch`
# ----------------------------------------------------------------------------------------------------

_NATIVE_SOURCE, _NATIVE_SYMBOL = "adamw_bf16_cpu.c", "adamw_bf16_step"


def _agrees_with_eager(mode: str, device: torch.device, dtype: torch.dtype, run, n: int = 37) -> bool:
    """Probe a fast path: ``run(p, g, m, v, c, key, coef)`` must give eager's weights and moments exactly on a
    sub-ulp update, and its compensation to 1%: a path that loses the compensation (a rounding elided) fails.
    ``n`` elements (a kernel that splits them over threads needs enough to split), one gradient of 2e19 (its
    square overflows: the moments must stay finite). The probe runs on fresh tensors: nothing of the user's."""
    gen = torch.Generator().manual_seed(0)
    # weights 1.0, updates of 2e-3 (about a quarter of a bf16 ulp): it lives in c or in the rounding
    base = [torch.ones(n), torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n), torch.zeros(n)]
    base[1][n // 2] = 2e19
    coef = _coefficients(lr=2e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    ref, got = ([t.to(device, dtype if j < 2 else torch.bfloat16) for j, t in enumerate(base)] for _ in range(2))
    _KERNELS[mode](*ref, torch.tensor(12345, dtype=torch.int32, device=device), None,
                   torch.tensor(coef, device=device))
    run(*got, 12345, coef)
    exact = [torch.equal(r, g_) for r, g_ in zip(ref[:4], got[:4])]
    return all(exact) and torch.allclose(ref[4].float(), got[4].float(), rtol=1e-2, atol=0.0)


def _compiled_key(mode: str, device: torch.device, dtype: torch.dtype) -> tuple:
    return "compiled", "adamw_bf16", mode, device.type, dtype


def _compiled_kernel(mode: str, device: torch.device, dtype: torch.dtype):
    """The torch.compile'd kernel, after a probe showing it agrees with eager on a sub-ulp update; else None.

    ``emulate_precision_casts``: without it inductor elides the bf16 round trip the compensation is computed
    from (the probe catches that). ``cpp.dynamic_threads``: a parallel loop whatever the size of the first call
    (inductor otherwise decides from it, and the probe's size would make every later call run on one thread)."""
    def probe(fn) -> bool:
        def run(p, g, m, v, c, k, coef):
            with _quiet():
                fn(p, g, m, v, c, torch.tensor(k, dtype=torch.int32, device=device), None,
                   torch.tensor(coef, device=device))

        return _agrees_with_eager(mode, device, dtype, run)

    return _dispatch.compiled(_compiled_key(mode, device, dtype), _KERNELS[mode], probe, dynamic=True,
                              options={"emulate_precision_casts": True, "cpp.dynamic_threads": True})


def _native_probe(fn) -> bool:
    """The C function gives eager's results in every mode, its elements split over 3 threads (whatever team
    OpenMP gives, every element must be done)."""
    def agrees(mode: str) -> bool:
        def run(p, g, m, v, c, k, coef):
            _native_path(fn, mode, [p], [g], [m], [v], [c] if mode == "kahan" else None, [k], coef, threads=3)

        return _agrees_with_eager(mode, torch.device("cpu"), torch.bfloat16, run, n=2 * _native._MIN_PER_THREAD + 37)

    return all(agrees(mode) for mode in COMPENSATIONS)


_NATIVE = _dispatch.CKernel(_NATIVE_SOURCE, _NATIVE_SYMBOL, "count params:ptrs grads:ptrs exp_avgs:ptrs "
                            "exp_avg_sqs:ptrs comps:ptrs numel:i64s keys:i32s*2 coef:f32s=8 mode:mode", _native_probe)


def _native_fn():
    """The C function of ``adamw_bf16_cpu.c``, once its probe passed; else None (see :meth:`._dispatch.CKernel.fn`)."""
    return _NATIVE.fn()


def _native_path(fn, mode, params, grads, exp_avgs, exp_avg_sqs, comps, keys, coef, threads=None):
    """The C kernel over all the tensors at once, their concatenated elements split over torch's threads (see
    :func:`._native.run_split`, also for ``threads``): one call, whatever the number of tensors."""
    sets = [params, grads, exp_avgs, exp_avg_sqs] + ([comps] if comps else [])
    ok = [i for i in range(len(params)) if all(ts[i].is_contiguous() and ts[i].dtype == torch.bfloat16 for ts in sets)]
    rest = [i for i in range(len(params)) if i not in set(ok)]
    if rest:  # rare layouts (channels_last, transposed grads): the eager kernel handles any
        pick = lambda xs: [xs[i] for i in rest] if xs else None  # noqa: E731
        _single_tensor(_KERNELS[mode], mode, pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
                       pick(comps), pick(keys), coef)
    if not ok:
        return
    mine = [[ts[i] for i in ok] for ts in sets]
    numel = [params[i].numel() for i in ok]
    both = [k for i in ok for k in ((keys[i], keys[i] ^ _WEIGHT_STREAM) if keys else (0, 0))]
    _NATIVE.run(fn, len(ok), *mine[:4], mine[4] if comps else None, numel, both, coef, mode, n=sum(numel),
                threads=threads)


def _step_op(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
             comps: list[Tensor], keys: list[int], coef: list[float], compensation: str, threads: int) -> None:
    """The C kernel's step over lists, in place (``comps``, ``keys``: empty where the compensation has none;
    ``threads`` < 0: torch's count). Not ``mode``: torch's dispatch passes a keyword of that name to ops."""
    _native_path(_native_fn(), compensation, params, grads, exp_avgs, exp_avg_sqs, comps or None, keys or None, coef,
                 None if threads < 0 else threads)


_op = _dispatch.custom_op("adamw_bf16_step", _step_op, ("params", "exp_avgs", "exp_avg_sqs", "comps"))


def _native_op(op, mode, params, grads, exp_avgs, exp_avg_sqs, comps, keys, coef):
    """The path of the C kernel: its op, once for all the tensors."""
    op(params, grads, exp_avgs, exp_avg_sqs, comps or [], keys or [], coef, mode, -1)


def _choose(mode: str, device: torch.device, dtype: torch.dtype, foreach: bool | None, compile: bool | None,
            plain: bool = True):
    """The one dispatch point: (path name, path, kernel). Automatic on CPU: the C kernel's op for bf16 weights,
    else the compiled one; ``compile=True`` asks for inductor's; foreach elsewhere. ``plain``: no tensor subclass
    among the tensors (an FSDP2 DTensor shard is not memory the C kernel may address by its global ``numel()``)."""
    if (compile is None and foreach is None and plain and device.type == "cpu" and dtype == torch.bfloat16
            and _native_fn() is not None):
        return "native", _native_op, _op
    if compile is None:  # fp16 under Kahan: inductor's kernel fails the probe (it does not keep fp16's rounding of
        # the Kahan sum), so the automatic choice is foreach, without compiling in vain and warning every run
        compile = foreach is None and device.type == "cpu" and not (dtype == torch.float16 and mode == "kahan")
    kernel = _compiled_kernel(mode, device, dtype) if compile else None
    if kernel is not None:
        return "compiled", _compiled, kernel
    if foreach is False:
        return "single_tensor", _single_tensor, _KERNELS[mode]
    return "foreach", _foreach, _KERNELS[mode]


def _coefficients(*, lr, beta1, beta2, eps, weight_decay, step) -> list[float]:
    """Per-step scalars, rounded to fp32 once so every path multiplies by exactly the same numbers (the layout of
    ``adamw_bf16_cpu.c``'s ``adamw_bf16_coef_t``; see the kernels' comment for why weight decay is ``-lr * wd``)."""
    raw = [beta1, 1.0 - beta1, beta2, 1.0 - beta2, 1.0 / math.sqrt(1.0 - beta2**step), eps,
           -lr * weight_decay, lr / (1.0 - beta1**step)]
    return torch.tensor(raw, dtype=torch.float32).tolist()


def adamw_bf16(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
               kahan_comps: list[Tensor | None], state_steps: list[Tensor], *, lr: float, beta1: float,
               beta2: float, eps: float, weight_decay: float, compensation: str = "kahan",
               noise_ids: list[int] | None = None, foreach: bool | None = None, compile: bool | None = None,
               found_inf: Tensor | None = None, tables: dict | None = None) -> None:
    """Functional AdamWBF16 step (see :class:`AdamWBF16`); increments ``state_steps``.

    ``kahan_comps`` holds each bf16/fp16 tensor's buffer under ``"kahan"`` (None elsewhere);
    ``noise_ids`` names each tensor's stochastic-rounding stream (default: its list position).
    Tensors that are not bf16/fp16 go to ``torch.optim.adamw.adamw`` (fused on CPU when compiling).
    On CUDA (automatic path), bf16/fp16 tensors whose step count lives on their device go to the Triton kernel
    (:mod:`.adamw_triton`), which reads nothing on the host. ``found_inf`` (a float32 scalar, torch's name) set
    voids the step, step counts included: the Triton kernel reads it on the device, the other paths on the host.
    ``tables``: the caller's dict for the Triton launches' pointer tables, kept between steps (see
    :func:`.adamw.adamw_fp32_state`).
    """
    _check_compensation(compensation)
    noise_ids = list(range(len(params))) if noise_ids is None else noise_ids
    low = [i for i, p in enumerate(params) if p.dtype in _LOW_PRECISION]
    high = [i for i, p in enumerate(params) if p.dtype not in _LOW_PRECISION]
    mine = {}
    if foreach is None and compile is None:
        mine, low = _triton_split(low, params, grads, exp_avgs, exp_avg_sqs, kahan_comps, state_steps, compensation)
    if (high or low) and found_inf is not None and bool(found_inf):  # the host paths read the flag (a sync)
        return
    for device, idx in mine.items():
        _dispatch.log_once(logging.INFO, ("AdamWBF16", "triton", compensation, device.type),
                           "AdamWBF16: triton path for %s tensors (compensation=%s)", device.type, compensation)
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        flag = found_inf if found_inf is not None and found_inf.device == device else _triton.zero_flag(device)
        _triton_kernel(device)(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), pick(kahan_comps),
                               pick(state_steps), pick(noise_ids), flag, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                               weight_decay=weight_decay, compensation=compensation, tables=tables)
    if high:  # torch's own AdamW, mapped path for path: compiled -> fused on CPU, foreach, single tensor
        on_cpu = params[high[0]].device.type == "cpu"
        fused = foreach is None and compile is not False and on_cpu and all(
            fused_takes(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]) for i in high)
        pick = lambda xs: [xs[i] for i in high]  # noqa: E731
        _torch_adamw(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), [], pick(state_steps),
                     foreach=None if fused else foreach is not False, fused=fused, amsgrad=False,
                     beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)
    if not low:
        return
    torch._foreach_add_([state_steps[i] for i in low], 1)
    groups = defaultdict(list)  # tensors sharing step, device, dtype and plainness share coefficients and a kernel
    for i in low:
        plain = _native.plain(params[i], grads[i])
        groups[(int(state_steps[i].item()), params[i].device, params[i].dtype, plain)].append(i)
    for (step, device, dtype, plain), idx in groups.items():
        name, run, kernel = _choose(compensation, device, dtype, foreach, compile, plain)
        _dispatch.log_once(logging.INFO, ("AdamWBF16", name, compensation, device.type, dtype),
                           "AdamWBF16: %s path for %s %s tensors (compensation=%s)", name, device.type, dtype,
                           compensation)
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        keys = None if compensation == "none" else [_noise_key(noise_ids[i], step) for i in idx]
        coef = _coefficients(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
        run(kernel, compensation, pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
            pick(kahan_comps) if compensation == "kahan" else None, keys, coef)


# ----------------------------------------------------------------------------------------------------
# The Triton kernel (CUDA; CPU tensors under the interpreter in tests), probed once per device
# ----------------------------------------------------------------------------------------------------


def _triton_split(low, params, grads, exp_avgs, exp_avg_sqs, comps, steps, compensation: str):
    """``({device: indices}, other indices)`` of ``low`` (bf16/fp16 tensors): those the Triton kernel steps (plain,
    contiguous, on one device with their bf16 state and step count: :func:`._dispatch.triton_split`)."""
    def fits(i: int) -> bool:
        kahan = (comps[i],) if compensation == "kahan" else ()
        tensors = (params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], steps[i], *kahan)
        return (all(t is not None and t.dtype == torch.bfloat16 for t in (exp_avgs[i], exp_avg_sqs[i], *kahan))
                and grads[i].dtype in (torch.float32, *_LOW_PRECISION) and steps[i].dtype == torch.float32
                and _triton.applies(*tensors) and all(t.is_contiguous() for t in tensors))

    return _dispatch.triton_split(low, params, fits, _triton_kernel)


def _triton_kernel(device: torch.device):
    """:func:`.adamw_triton.bf16_state_step`, once its probe on ``device`` passed; else None (logged once)."""
    def load():
        from . import adamw_triton
        return adamw_triton.bf16_state_step

    return _dispatch.probed("adamw_bf16", device, load, _triton_agrees, "the eager one")


def _triton_agrees(step_fn, device: torch.device) -> bool:
    """On fresh tensors of ``device`` (a launch of its own and a batched one; bf16 and fp16 weights; every mode),
    the Triton kernel agrees with the eager one: moments within one bf16 spacing (the same bits where the device
    rounds as eager), weights within one spacing of their dtype, Kahan buffers within 1% (weights 1.0, updates of
    about a quarter of a bf16 spacing: a lost compensation fails), one gradient of 2e19 (the moments stay finite)."""
    sizes = (3000, 37)
    coef = torch.tensor(_coefficients(step=1, **_TRITON_PROBE), device=device)
    for mode in COMPENSATIONS:
        for dtype in _LOW_PRECISION:
            gen = torch.Generator().manual_seed(0)
            grads = [torch.randn(n, generator=gen) for n in sizes]
            grads[0][1234] = 2e19
            grads = [g.to(device, torch.bfloat16) for g in grads]
            runs = []
            for triton in (True, False):
                ps = [torch.ones(n, dtype=dtype, device=device) for n in sizes]
                ms, vs, cs = ([torch.zeros(n, dtype=torch.bfloat16, device=device) for n in sizes] for _ in range(3))
                if triton:
                    steps = [torch.zeros((), device=device) for _ in sizes]
                    step_fn(ps, grads, ms, vs, cs, steps, [0, 1], _triton.zero_flag(device), compensation=mode,
                            small=1024, **_TRITON_PROBE)
                else:
                    for i in range(len(sizes)):
                        _KERNELS[mode](ps[i], grads[i], ms[i], vs[i], cs[i],
                                       torch.tensor(_noise_key(i, 1), dtype=torch.int32, device=device), None, coef)
                runs.append((ps, ms + vs, cs))
            (pt, st, ct), (pr, sr, cr) = runs
            close = all(torch.isclose(a.float(), b.float(), rtol=2.0**-7, atol=0.0).all() for a, b in zip(st, sr))
            close &= all(((a.float() - b.float()).abs() <= torch.finfo(dtype).eps).all() for a, b in zip(pt, pr))
            if mode == "kahan":
                close &= all(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=0.0) for a, b in zip(ct, cr))
            if not close:
                return False
    return True


_TRITON_PROBE = dict(lr=2e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)



_state_dtype = ADAMW_BF16.moment_dtype  # bf16 for bf16/fp16 weights: the family's rule, which conversions read too


_check_compensation = check_compensation


def _check_family_keys(group: dict) -> None:
    _check_compensation(group["compensation"])
    if group["foreach"] and group["compile"]:
        raise ValueError("foreach=True and compile=True are exclusive: pick one path (or leave both None)")


class AdamWBF16(Optimizer):
    """AdamW for bf16/fp16 weights, with Kahan-compensated or stochastically rounded updates.

    A standard ``torch.optim.Optimizer``: param groups carry ``lr`` (any LR scheduler works), state keys
    follow torch (``step``, ``exp_avg``, ``exp_avg_sq``, plus ``kahan_comp``), and ``state_dict()`` loads
    with ``torch.load(weights_only=True)``. float32 parameters get plain AdamW (as ``torch.optim.AdamW``).

    Args:
        params: parameters or param groups (groups may set any keyword below).
        lr: learning rate.
        betas: moment decay rates.
        eps: added to the denominator.
        weight_decay: decoupled weight decay, ``p -= lr * weight_decay * p``.
        compensation: ``"kahan"`` (6 bytes/param), ``"stochastic"`` (4) or ``"none"`` (4, stale weights).
        foreach: True for the foreach path, False for the per-tensor loop; None: automatic.
        compile: None (automatic): on CPU the C kernel for bf16 weights (fp16: the torch.compile'd kernel, or
            foreach under kahan), on other devices foreach; True: the compiled kernel; False never compiles. A compiled kernel that fails
            to compile falls back to foreach with a warning.

    Example::

        model = model.to(torch.bfloat16)
        opt = AdamWBF16(model.parameters(), lr=1e-4, weight_decay=0.01)

    fp16 parameters work the same way, but their state is bf16 (same 2 bytes): in fp16,
    ``exp_avg_sq = (1 - beta2) * grad**2`` underflows to 0 for gradients below ~1e-3 and the update
    becomes ``lr * exp_avg / eps``; ``kahan_comp`` of small weights would be subnormal.
    """

    FACTS = ADAMW_BF16

    def __init__(self, params, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, compensation: str = ADAMW_BF16.compensation, foreach: bool | None = None,
                 compile: bool | None = None):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, compensation=compensation,
                        foreach=foreach, compile=compile)
        super().__init__(params, defaults)
        self._tables = {}  # id(param group) -> its Triton launches' pointer tables (_triton.launch)
        self._report_dtypes()

    def add_param_group(self, param_group: dict) -> None:
        """As torch's, after :func:`..options.check_group` (hyperparameters, maximize, parameters listed twice)."""
        super().add_param_group(check_group(self, param_group, "AdamWBF16", _check_family_keys))

    def _report_dtypes(self) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        other = [p for p in params if p.dtype not in _LOW_PRECISION]
        if other and len(other) == len(params):
            logger.warning("AdamWBF16 got only %s parameters: it runs plain AdamW (state in their dtype, no "
                           "compensation). Cast the model to bfloat16 to save the memory this optimizer is for.",
                           sorted({str(p.dtype) for p in other}))
        elif other:
            logger.info("AdamWBF16: %d of %d parameter tensors (%d elements) are not bf16/fp16: they get plain "
                        "AdamW with state in their dtype; compensation applies to the others.",
                        len(other), len(params), sum(p.numel() for p in other))

    def _init_state(self, p: Tensor, compensation: str) -> dict:
        state, where = self.state[p], _dispatch.step_device(p, _LOW_PRECISION)
        if not state:
            dtype = _state_dtype(p)
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=where)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            if compensation == "kahan" and p.dtype in _LOW_PRECISION:
                state["kahan_comp"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        elif (p.is_cuda or state["step"].is_cuda) and state["step"].device != where:
            state["step"] = state["step"].to(where)  # loaded, or saved by the other path: moved once
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, except that fp16 parameters keep their bf16 state (torch casts state to the param dtype), and
        a saved ``step`` that is a number (torch accepts one) becomes the float32 tensor step() counts in. Saved
        steps and groups are checked first (a ValueError, nothing loaded)."""
        check_saved(self, state_dict, "AdamWBF16", _check_family_keys)
        super().load_state_dict(state_dict)
        for st in self.state.values():  # not all dicts: a load hook may store a flag here (torch's tests do)
            if isinstance(st, dict) and "step" in st and not torch.is_tensor(st["step"]):
                st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)
        drop_unused_buffers(self, "AdamWBF16")
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        placed = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, placed):  # torch cast them to the parameter's dtype
            # .get: indexing would give a parameter without state an empty entry, which outlives the parameter
            # (accelerate's FSDP2 prepare swaps it for a DTensor) and breaks torch's state_dict() with a KeyError
            saved, state = state_dict["state"].get(i, {}), self.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq", "kahan_comp") if isinstance(saved, dict) else ():
                if key in saved and key in state and state[key].dtype != _state_dtype(p):
                    state[key] = saved[key].to(device=p.device, dtype=_state_dtype(p))

    def takes_found_inf(self) -> bool:
        """Whether the coming step sends every tensor with a gradient to the Triton kernel, which reads the guard's
        device-side flag (the guard's protocol, as ``Blockwise8bit.takes_found_inf``): then the guard leaves its check
        on the device and reads nothing. False before a tensor's first step (its state is made in step()), and where
        a tensor takes a host path (fp32 weights, shards, ``foreach`` / ``compile`` set)."""
        def takes(p, group, st):
            return (bool(st) and group["foreach"] is None and group["compile"] is None and p.dtype in _LOW_PRECISION
                    and bool(_triton_split([0], [p], [p.grad], [st["exp_avg"]], [st["exp_avg_sq"]],
                                           [st.get("kahan_comp")], [st["step"]], group["compensation"])[0]))

        return _dispatch.takes_found_inf(self, takes)

    @torch.no_grad()
    def step(self, closure=None):
        loss = start_step(self, closure, "AdamWBF16")  # closure, then sparse gradients refused: nothing half-done
        position = 0  # a parameter's index across groups, as in state_dict(): its noise stream
        for group in self.param_groups:
            lists = [[] for _ in range(7)]
            for p in group["params"]:
                if p.grad is not None:
                    state = self._init_state(p, group["compensation"])
                    for lst, item in zip(lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                                                 state.get("kahan_comp"), state["step"], position)):
                        lst.append(item)
                position += 1
            if not lists[0]:
                continue
            shards = [i for i, p in enumerate(lists[0]) if _sharded.is_sharded(p) and p.dtype in _LOW_PRECISION]
            if shards:
                self._step_low_precision_shards(group, *([lst[i] for i in shards] for lst in lists))
                lists = [[x for i, x in enumerate(lst) if i not in shards] for lst in lists]
                if not lists[0]:
                    continue
            params, grads, exp_avgs, exp_avg_sqs, comps, steps, noise_ids = lists
            beta1, beta2 = group["betas"]
            adamw_bf16(params, grads, exp_avgs, exp_avg_sqs, comps, steps, lr=group["lr"], beta1=beta1, beta2=beta2,
                       eps=group["eps"], weight_decay=group["weight_decay"], compensation=group["compensation"],
                       noise_ids=noise_ids, foreach=group["foreach"], compile=group["compile"],
                       found_inf=getattr(self, "found_inf", None),
                       tables=self.__dict__.setdefault("_tables", {}).setdefault(id(group), {}))
        return loss

    def _step_low_precision_shards(self, group: dict, params, grads, exp_avgs, exp_avg_sqs, comps, steps,
                                   noise_ids) -> None:
        """bf16/fp16 FSDP2 shards (Shard(0) on a 1-D mesh, :func:`._sharded.check`): the eager kernel on each local
        shard (the C, compiled and Triton kernels address whole tensors), its noise numbered as in the whole tensor,
        so that every mesh rounds alike. fp32 shards keep torch's AdamW on DTensors."""
        for p, position in zip(params, noise_ids):
            _sharded.check(p, "AdamWBF16", f"parameter {position}")
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf):  # as adamw_bf16's host paths: the flag voids the step
            return
        mode, beta1, beta2 = group["compensation"], *group["betas"]
        local = lambda ts: [None if t is None else _sharded.local(t) for t in ts]  # noqa: E731
        torch._foreach_add_(steps, 1)
        by_step = defaultdict(list)
        for i, s in enumerate(steps):
            by_step[int(s.item())].append(i)
        for step, idx in by_step.items():
            pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
            coef = _coefficients(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                 weight_decay=group["weight_decay"], step=step)
            keys = None if mode == "none" else [_noise_key(noise_ids[i], step) for i in idx]
            _single_tensor(_KERNELS[mode], mode, *(local(pick(xs)) for xs in (params, grads, exp_avgs, exp_avg_sqs)),
                           local(pick(comps)) if mode == "kahan" else None, keys, coef,
                           [_sharded.global_offset(p) for p in pick(params)])
