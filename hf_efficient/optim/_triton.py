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
- Batching: the tensors of a step share few launches over a :class:`PointerTable` (device arrays of their addresses
  and sizes, rebuilt only when an address changes): Triton's launcher costs the host tens of microseconds a call,
  so one launch per tensor made the step wait on the host (see docs/results/bench_cuda.md).
"""

from __future__ import annotations

import functools
import os
import threading
from array import array

import torch

from .compensation import C_MODES, WEIGHT_STREAM

__all__ = ["available", "applies", "interpret_on_cpu", "KAHAN", "STOCHASTIC", "NONE", "flag", "zero_flag",
           "advance_steps", "PointerTable", "jit_helpers", "split64", "fp32"]

KAHAN, STOCHASTIC, NONE = C_MODES["kahan"], C_MODES["stochastic"], C_MODES["none"]
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
