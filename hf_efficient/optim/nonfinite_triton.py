"""The guard's inf/NaN check on CUDA in one Triton launch per gradient dtype (:func:`.nonfinite.flag_on_device`).

Every gradient of the step is read once, over a :class:`._triton.PointerTable` (grid: tensors on dim 0, chunks of
``CHUNK`` elements on dim 1; a tensor of more than 65535 chunks gets a launch of its own). A program that finds an
inf, a NaN or ``|g| >= OVERFLOW`` stores 1.0 into its tensor's flag and into ``found`` (every writer stores the same
value: no atomics needed); the two live in one float32 buffer zeroed by one fill before the launch. Nothing is read on
the host, and nothing but that buffer is allocated. Conventions: see :mod:`._triton`.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from . import _triton

__all__ = ["DTYPES", "scan", "probe"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
BLOCK = 2048  # elements per load: 4 warps, 16 per thread (four 16-byte vectors of fp32)
ITERS = 8  # loads per program: one reduction and one flag test per CHUNK elements, not per BLOCK
CHUNK = BLOCK * ITERS
NUM_WARPS = 4
MAX_CHUNKS = 65535  # the grid's second dimension: a tensor of more chunks takes a launch of its own
_OVERFLOW = tl.constexpr(2.0**64)  # nonfinite.OVERFLOW (a global of a kernel must be a constexpr)


@triton.jit
def _clean(g):
    """Elementwise: finite and ``|g| < OVERFLOW`` (False for NaN: every comparison with NaN is false). 16-bit values
    are compared in fp32, where their conversion is exact; fp64 in fp64."""
    if g.dtype == tl.float16 or g.dtype == tl.bfloat16:
        g = g.to(tl.float32)
    return tl.abs(g) < _OVERFLOW


@triton.jit(do_not_specialize=["n", "idx", "count"])  # a size or index of 1 must not become a constant
def scan_kernel(found_ptr, flags_ptr, g_ptr, ptrs, sizes, n, idx, count, TABLE: tl.constexpr, ALIGNED: tl.constexpr,
                BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Sets ``flags[idx]`` and ``found`` to 1.0 where chunk ``program_id`` of the gradient holds a bad value. The
    gradient: the arguments as given (chunk ``program_id(0)``), or (``TABLE``) row ``program_id(0)`` of the table
    (``ptrs``: addresses; ``sizes``: numels, then flag indices, each ``count`` long) and chunk ``program_id(1)``."""
    blk = tl.program_id(0)
    if TABLE:
        t = tl.program_id(0)
        blk = tl.program_id(1)
        g_ptr = tl.load(ptrs + t).to(tl.pointer_type(g_ptr.dtype.element_ty))
        if ALIGNED:  # the compiler cannot see a loaded address's alignment: without it, loads are not vectors
            g_ptr = tl.multiple_of(g_ptr, 16)
        n = tl.load(sizes + t)
    start = blk.to(tl.int64) * (BLOCK * ITERS)
    rest = n.to(tl.int64) - start  # elements from this program's first on; <= 0: a smaller tensor's spare program
    if rest > 0:
        gp = g_ptr + start
        offs = tl.arange(0, BLOCK)
        clean = tl.full([BLOCK], 1, tl.int1)
        if rest >= BLOCK * ITERS:  # a whole chunk, unmasked: a mask of unknown alignment would split the vectors
            for i in range(ITERS):
                clean = clean & _clean(tl.load(gp + i * BLOCK + offs))
        else:
            left = rest.to(tl.int32)
            for i in range(ITERS):
                o = i * BLOCK + offs
                clean = clean & _clean(tl.load(gp + o, mask=o < left, other=0.0))
        if tl.min(clean.to(tl.int32), axis=0) == 0:
            at = idx
            if TABLE:  # read only here: a clean program loads its table row's address and size alone
                at = tl.load(sizes + count + tl.program_id(0))
            tl.store(flags_ptr + at, 1.0)
            tl.store(found_ptr, 1.0)


def scan(grads: list[torch.Tensor], tables: dict, max_chunks: int = MAX_CHUNKS) -> tuple[torch.Tensor, torch.Tensor]:
    """``(found, flags)`` of ``grads`` (non-empty, contiguous, of :data:`DTYPES`, on one device): ``found`` a float32
    scalar, 1.0 where any gradient holds an inf, NaN or ``|g| >= OVERFLOW``; ``flags`` float32 per gradient, 1.0 where
    it does. Launched on the device, read by nobody here. ``tables``: the caller's ``{dtype: PointerTable}``, kept
    between steps (a table is rebuilt only when an address moves). ``max_chunks``: the most chunks of a tensor that
    joins the batched launch (the grid's second dimension; lowered by the probe and tests)."""
    device = grads[0].device
    buf = torch.zeros(len(grads) + 1, dtype=torch.float32, device=device)
    found = buf[-1]
    opts = dict(num_warps=NUM_WARPS, BLOCK=BLOCK, ITERS=ITERS)
    batched: dict[torch.dtype, list[int]] = {}
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        for i, g in enumerate(grads):
            chunks = triton.cdiv(g.numel(), CHUNK)
            if chunks > max_chunks:
                scan_kernel[(chunks,)](found, buf, g, buf, buf, g.numel(), i, 1, TABLE=False, ALIGNED=False, **opts)
            else:
                batched.setdefault(g.dtype, []).append(i)
        for dtype, idx in batched.items():
            table = tables.setdefault(dtype, _triton.PointerTable())
            numels = [grads[i].numel() for i in idx]
            ptrs, sizes = table.get([[grads[i] for i in idx]], numels + idx, device)
            scan_kernel[(len(idx), triton.cdiv(max(numels), CHUNK))](
                found, buf, grads[idx[0]], ptrs, sizes, 0, 0, len(idx), TABLE=True, ALIGNED=table.aligned, **opts)
    return found, buf[:-1]


def probe(device: torch.device) -> bool:
    """On fresh tensors of ``device``, every dtype, batched and alone (a lowered grid limit gives the first tensor a
    launch of its own): a NaN, an inf and ``-OVERFLOW`` are each found in the right tensor, at a chunk's first
    element and at a ragged tail's last; clean tensors, the value just below ``OVERFLOW`` included, are not."""
    gen = torch.Generator().manual_seed(0)
    sizes = (3 * CHUNK + 5, 37, CHUNK)
    for dtype in DTYPES:
        grads = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
        half = dtype == torch.float16  # its largest finite value is far below OVERFLOW
        grads[2][-1] = torch.finfo(dtype).max if half else 2.0**64 * (1 - torch.finfo(dtype).eps / 2)  # clean
        for bad in (float("nan"), float("inf"), -float("inf") if half else -(2.0**64)):
            for where, at in ((0, CHUNK), (0, -1), (1, -1), (2, 0)):
                gs = [g.clone() for g in grads]
                gs[where][at] = bad
                found, flags = scan([g.to(device) for g in gs], {}, max_chunks=2)
                if float(found) != 1.0 or flags.cpu().tolist() != [float(i == where) for i in range(len(gs))]:
                    return False
        found, flags = scan([g.to(device) for g in grads], {}, max_chunks=2)
        if float(found) != 0.0 or bool(flags.any()):
            return False
    return True
