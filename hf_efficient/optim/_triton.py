"""What every Triton kernel of this package shares: where they run, the conventions, the common device functions.

Where. On CUDA tensors, when Triton imports (it ships with CUDA builds of torch). In tests, on CPU tensors too,
under Triton's interpreter: with ``TRITON_INTERPRET=1`` set before Triton is imported, :func:`interpret_on_cpu`
turns the CPU path on, and the very same kernel code runs in numpy, so CI (which has no GPU) executes it.

Conventions, shared by every Triton kernel (the C kernels use the same names and numbers):

- ``MODE`` (``tl.constexpr``): the compensation of a bf16/fp16 weight's write, :data:`KAHAN`, :data:`STOCHASTIC`
  or :data:`NONE` (``compensation.C_MODES``); fp32 weights are written as computed whatever the mode.
- ``flag_ptr``: a float32 scalar on the device, non-zero when this step is void (a non-finite gradient under the
  guard, as torch's ``found_inf``). Every kernel reads it first and returns at once when it is set: the guard then
  needs no host synchronisation (:func:`flag`).
- ``step_ptr``: each tensor's step count, a float32 scalar on the device, already counting this step; a kernel
  computes what depends on it (bias corrections, the rounding noise key) itself, so the host never reads it.
  Steps are advanced by :func:`advance_steps` before the launch and taken back when the flag is set.
- Noise for stochastic rounding: :func:`hash_noise` of (the tensor's key, the element index), the key being
  :func:`weight_key` of (the parameter's position, its step), bit for bit as :mod:`.compensation`'s torch code, so
  a resumed run, the CPU kernels and these round alike.
- Batching, one launch layer for every step kernel (:func:`launch`): the tensors of a step share few launches over a
  :class:`PointerTable` (device arrays of their addresses and sizes, rebuilt only when an address changes): Triton's
  launcher costs the host tens of microseconds a call, so one launch per tensor made the step wait on the host (see
  docs/results/bench_cuda.md). One layout: the table's rows are each tensor's weight, gradient and step count (rows
  0, 1, 2), then the family's own tensors; the info array is each tensor's size, then its position (or noise key). Grid: the tensors on axis 0, each tensor's programs on axes 1 and 2, at
  most :data:`MAX_PROGRAMS` each. A kernel finds its tensor with ``_triton_lib.tensor_of_program`` and its pointers
  with ``address``, and writes its weights with ``write``, the one compensated store.
- Adam-like steps take each tensor's step size and bias corrections from :func:`adam_scalars` (one program per
  tensor, in float64, before the step's launch), not from every program: their serial float64 powers, division and
  square root held each program back before its first load.
"""

from __future__ import annotations

import functools
import os
import threading
from array import array
from collections import OrderedDict
from contextlib import nullcontext

import torch

from .compensation import C_MODES, WEIGHT_STREAM

__all__ = ["available", "applies", "interpret_on_cpu", "KAHAN", "STOCHASTIC", "NONE", "flag", "zero_flag",
           "advance_steps", "PointerTable", "jit_helpers", "split64", "fp32", "MAX_PROGRAMS", "plan", "launch",
           "adam_scalars"]

KAHAN, STOCHASTIC, NONE = C_MODES["kahan"], C_MODES["stochastic"], C_MODES["none"]
MAX_PROGRAMS = 65535  # CUDA's limit on a grid's axes 1 and 2: a tensor of more programs spans both, alone
_ON_CPU = False
_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Triton imports (a CUDA build of torch ships it; on CPU only the interpreter can run its kernels). Asked once
    per process: every step asks it per tensor."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpret_on_cpu(on: bool = True) -> None:
    """Run the Triton kernels on CPU tensors, under Triton's interpreter (tests: CI has no GPU).

    Raises:
        RuntimeError: ``TRITON_INTERPRET=1`` was not set before Triton was imported (compiled kernels cannot take
            CPU tensors).
    """
    global _ON_CPU
    if on and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("interpret_on_cpu needs TRITON_INTERPRET=1 in the environment before triton is imported")
    _ON_CPU = bool(on)


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels take these tensors: all on one CUDA device (or on CPU under
    :func:`interpret_on_cpu`), plain (not DTensor or another subclass), and Triton importable."""
    if not tensors:
        return False
    device = tensors[0].device
    if device.type != "cuda" and not (_ON_CPU and device.type == "cpu"):
        return False
    plain = (torch.Tensor, torch.nn.Parameter)
    return all(type(t) in plain and t.device == device for t in tensors) and available()


def fp32(x: float) -> float:
    """``x`` rounded to fp32 (the value a kernel's fp32 argument holds), computed on the host without a tensor."""
    return array("f", [x])[0]


@functools.lru_cache(maxsize=256)  # per group and step otherwise: two array round trips on the host each
def split64(x: float) -> tuple[float, float]:
    """A float64 as two fp32 halves whose sum is within ~2**-48 of it (Triton passes Python floats as fp32): what
    ``pow_int`` and any other float64 constant of a kernel takes."""
    hi = fp32(x)
    return hi, fp32(x - hi)


_ZERO: dict = {}


def zero_flag(device: torch.device) -> torch.Tensor:
    """A float32 zero on ``device``: the flag of a step that nothing voids (one per device, never written)."""
    key = torch.device(device)
    with _LOCK:
        if key not in _ZERO:
            _ZERO[key] = torch.zeros(1, dtype=torch.float32, device=key)
        return _ZERO[key]


def flag(optimizer, device: torch.device) -> torch.Tensor:
    """The step's void flag for ``device``: ``optimizer.found_inf`` where the guard (or a GradScaler) set one on that
    device, else :func:`zero_flag`."""
    found = getattr(optimizer, "found_inf", None)
    if isinstance(found, torch.Tensor) and found.device == torch.device(device):
        return found
    return zero_flag(device)


def advance_steps(steps: list[torch.Tensor], found_inf: torch.Tensor) -> None:
    """Count this step in ``steps`` (float32 scalars on the device) unless ``found_inf`` is set: two small launches,
    no host synchronisation. Call it before the kernels, which read the new counts."""
    if steps:
        torch._foreach_add_(steps, found_inf.reshape(()).eq(0).float())


class PointerTable:
    """Device arrays of the addresses (int64) of lists of tensors, and of their sizes, for one launch over many
    tensors. Rebuilt only when an address or size changes (parameters and state do not move, and the caching
    allocator mostly gives a step's gradients the same addresses as the last one's), and then copied from pinned
    memory without blocking, in one upload: no host synchronisation either way (``pin_memory()`` copies on the host
    into a block of torch's caching host allocator; the upload is a ``cudaMemcpyAsync`` on the current stream).

    ``aligned``: every address is a multiple of 16 bytes, so a kernel may promise 16-byte vector loads
    (``tl.multiple_of``) on pointers it read from the table, which the compiler cannot see by itself."""

    def __init__(self):
        self._key = None
        self.tables: tuple[torch.Tensor, ...] = ()
        self.aligned = False

    def get(self, lists: list[list[torch.Tensor]], sizes: list[int], device: torch.device):
        """``(addresses, sizes)``: ``addresses`` of shape ``(len(lists), count)``, ``sizes`` int64 of ``count``."""
        key = (tuple(tuple(t.data_ptr() for t in ts) for ts in lists), tuple(sizes), device)
        if key != self._key:
            device = torch.device(device)
            pin = device.type == "cuda"
            flat = torch.tensor([a for row in key[0] for a in row] + list(sizes), dtype=torch.int64)
            if pin:  # a host-side copy into the caching host allocator's pinned block (no CUDA call, no sync); the
                flat = flat.pin_memory()  # block is reused only once the event of the copy that reads it is done
            flat = flat.to(device, non_blocking=pin)  # one asynchronous upload for both arrays
            rows = len(lists)
            count = len(lists[0]) if lists else 0
            self.tables = (flat[:rows * count].view(rows, count), flat[rows * count:])
            self.aligned = all(a % 16 == 0 for row in key[0] for a in row)
            self._key = key
        return self.tables


_HELPERS = None


def jit_helpers():
    """The shared ``@triton.jit`` device functions (imported lazily: Triton is optional), as a namespace:
    ``mix32``, ``hash_noise``, ``weight_key``, ``pow_int``, ``to_bf16``, ``to_dtype``, ``round_stochastic``,
    ``compensated``."""
    global _HELPERS
    if _HELPERS is None:
        from . import _triton_lib
        _HELPERS = _triton_lib
    return _HELPERS


def plan(params, grads, per_program: int, alone_from: int | None = None) -> tuple[list[int], list[list[int]]]:
    """``(alone, shared)``: the indices of the tensors that get a launch of their own (more than
    :data:`MAX_PROGRAMS` programs of ``per_program`` elements, which a shared grid would size for the others, or
    ``alone_from`` elements or more: probes and tests, to take both kinds), and one list per (weight, gradient) dtype
    pair of those that share one; empty tensors in neither. Reads only shapes and dtypes (meta tensors will do)."""
    limit = MAX_PROGRAMS * per_program + 1
    limit = limit if alone_from is None else min(limit, alone_from)
    alone, shared = [], {}
    for i, p in enumerate(params):
        n = p.numel()
        if n >= limit:
            alone.append(i)
        elif n:
            shared.setdefault((p.dtype, grads[i].dtype), []).append(i)
    return alone, list(shared.values())


_RECENT: OrderedDict = OrderedDict()  # the tables of callers that keep none (functional calls): the latest 64
_MAX_RECENT = 64


def _kept(tables: dict | None, key):
    """The dict to keep ``key``'s table in: ``tables``, or the recent ones (used last, the oldest dropped)."""
    if tables is not None:
        return tables
    with _LOCK:
        if key in _RECENT:
            _RECENT.move_to_end(key)
        else:
            while len(_RECENT) >= _MAX_RECENT - 1:  # room for the table and its prepare's buffer
                _RECENT.popitem(last=False)
    return _RECENT


def launch(kernel, items, tables: dict | None, flag, scalars: tuple, mode: str, per_program: int, *,
           num_warps: int = 4, prepare=None, alone_from: int | None = None, **constexprs) -> None:
    """``kernel`` over ``items`` (``(position, [weight, gradient, step count, *the family's tensors])``, all on one
    device; a row's tensor that a launch never reads may be the weight, e.g. the Kahan buffer without Kahan): one
    launch per (weight dtype, gradient dtype), the tensors on grid axis 0, their programs of ``per_program``
    elements on axes 1 and 2; a tensor :func:`plan` sets apart in a launch of its own. The kernel's arguments: the
    pointer table (a row per tensor list), the info array (sizes, then positions), ``flag``, the count of tensors,
    ``prepare``'s, ``scalars``; constexprs ``MODE``, ``OUT``, ``GRAD`` (the weights' and gradients' Triton dtypes),
    ``ALIGNED`` (every address a multiple of 16 bytes) and ``constexprs``. ``tables``: the caller's dict of
    :class:`PointerTable`, kept between steps (a table per set of tensors: gradient release steps a different bucket
    each call, the same ones each step), or None. ``prepare(addresses, count, key, tables)``: a launch's own leading
    arguments (``key``: its table's, for buffers kept in ``tables`` beside it: :func:`adam_scalars`)."""
    import triton.language as tl

    dtypes = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    alone, shared = plan([ts[0] for _, ts in items], [ts[1] for _, ts in items], per_program, alone_from)
    device = items[0][1][0].device if items else None
    with torch.cuda.device(device) if device is not None and device.type == "cuda" else nullcontext():
        for idx in shared + [[i] for i in alone]:  # Triton launches on the current device: made the tensors' one
            batch = [items[i] for i in idx]
            p, g = batch[0][1][0], batch[0][1][1]
            key = (kernel, p.dtype, g.dtype, device, *(ts[0].data_ptr() for _, ts in batch))
            kept = _kept(tables, key)
            table = kept.setdefault(key, PointerTable())
            sizes = [ts[0].numel() for _, ts in batch]
            addresses, info = table.get([list(row) for row in zip(*(ts for _, ts in batch))],
                                        sizes + [position for position, _ in batch], device)
            programs = -(-max(sizes) // per_program)
            grid = (len(batch), min(programs, MAX_PROGRAMS), -(-programs // MAX_PROGRAMS))
            lead = () if prepare is None else prepare(addresses, len(batch), key, kept)
            kernel[grid](addresses, info, flag, len(batch), *lead, *scalars, MODE=C_MODES[mode], OUT=dtypes[p.dtype],
                         GRAD=dtypes[g.dtype], ALIGNED=table.aligned, num_warps=num_warps, enable_fp_fusion=False,
                         **constexprs)


def adam_scalars(lr: float, beta1: float, beta2: float):
    """An Adam-like step's ``prepare`` for :func:`launch`: each tensor's ``lr / (1 - beta1^t)``,
    ``1 / sqrt(1 - beta2^t)`` and ``sqrt(1 - beta2^t)`` (fp32 roundings of float64 values, as eager computes them in
    Python), computed once per tensor and step from its step count on the device by
    ``_triton_lib.adam_scalars_kernel`` (a launch of one program per tensor) into 3 floats per tensor, a buffer kept in
    the launch's tables beside its pointer table: the kernel's ``coef`` argument."""
    halves = (*split64(lr), *split64(beta1), *split64(beta2))

    def prepare(addresses, count: int, key, tables: dict) -> tuple:
        coef = tables.get((key, "coef"))
        if coef is None or coef.numel() != 3 * count:
            coef = tables[(key, "coef")] = torch.empty(3 * count, dtype=torch.float32, device=addresses.device)
        jit_helpers().adam_scalars_kernel[(count,)](addresses, count, coef, *halves, num_warps=1)
        return (coef,)

    return prepare
