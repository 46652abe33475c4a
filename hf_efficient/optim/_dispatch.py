"""Kernel dispatch shared by every family: one cache, probe-then-publish, log-once, the compile-error fallback, and the
one split of a step's tensors between a family's Triton kernel and its other paths.

A family has up to three kernels for one step: its C kernel (CPU, via :mod:`._native`, exposed as a
``torch.library.custom_op`` so it shows in the profiler and composes with ``torch.compile``), its
``torch.compile``'d kernel, and the same function run eagerly. The kernels are cached here under a key the family
picks (kernel name, device type, dtype or mode): each is built and probed against the eager kernel once, under a
lock, and published only then (a thread that finds it published never sees a kernel that was not checked).
Where building or the probe fails, None is published and the reason logged once: the caller runs the next path.
Each C function is declared once as a :class:`CKernel` (its signature gives the ctypes types and checks every call's
values), and each Triton kernel is admitted by :func:`probed`. Which tensors a family's Triton kernel takes is decided
here for every family (:func:`triton_split`, :func:`takes_found_inf`, :func:`step_device`): each gives only its test
of one tensor.

A compiled kernel that fails when first called (no C++ compiler, no Triton) may fall back to eager, but only on
:func:`compile_errors`: an error from a running kernel may come after its in-place weight update, and running the
step again would apply it twice.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import threading
from array import array
from operator import index
from typing import Callable

import torch

from . import _native, _sharded, _triton
from .compensation import C_MODES, COMPENSATIONS

__all__ = ["cached", "compiled", "probed", "on_device", "CKernel", "C_KERNELS", "custom_op", "call", "compile_errors",
           "log_once", "Bf16WeightKernel", "note_missing_triton", "triton_may_apply", "triton_split", "step_device",
           "takes_found_inf"]

logger = logging.getLogger(__name__)

_COMPILED: dict = {}  # key -> kernel, or None where building or its probe failed
_LOCK = threading.RLock()  # held while a kernel is built and probed: published once, after its probe passed
_LOGGED: set = set()


def log_once(level: int, key, msg: str, *args) -> None:
    """Log ``msg`` once per process and ``key`` (a fallback is worth one line, not one per step)."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.log(level, msg, *args)


def compile_errors() -> tuple:
    """What ``torch.compile``'d code raises when compiling fails (before anything ran: no C++ compiler, no Triton,
    an unsupported Python). Only those may fall back to the eager kernel (see the module docstring)."""
    from torch._dynamo.exc import TorchDynamoException  # BackendCompilerFailed, InductorError, Unsupported
    from torch._inductor.exc import CppCompileError

    # a fullgraph function recompiled more than dynamo's recompile_limit times (each weight/gradient dtype pair and
    # torch thread count is a graph): raised before the new graph ran, and no TorchDynamoException
    limit = getattr(importlib.import_module("torch._dynamo.exc"), "FailOnRecompileLimitHit", TorchDynamoException)
    return TorchDynamoException, CppCompileError, limit


def cached(key, make: Callable[[], object | None]):
    """The kernel published under ``key``, made by ``make()`` the first time (it builds and probes, returning the
    kernel or None). Any exception from ``make`` publishes None, logged once: nothing of the caller's ran."""
    fn = _COMPILED.get(key, _COMPILED)  # published: no lock needed to read it
    if fn is not _COMPILED:
        return fn
    with _LOCK:
        if key not in _COMPILED:
            try:
                fn = make()
            except Exception as e:  # noqa: BLE001 - a kernel that cannot be built or probed is simply not used
                log_once(logging.WARNING, ("make", key), "hf_efficient: kernel %s unavailable (%s: %s); using the "
                         "next path (same results, slower)", key, type(e).__name__, e)
                fn = None
            _COMPILED[key] = fn
        return _COMPILED[key]


def compiled(key, fn: Callable, probe: Callable[[Callable], bool] | None = None, **options):
    """``torch.compile(fn, fullgraph=True, **options)`` under ``key``, after ``probe(kernel)`` returned True
    (None: no probe; compiling happens at the first call, see :func:`call`)."""
    def make():
        kernel = torch.compile(fn, fullgraph=True, **options)
        if probe is not None and not probe(kernel):
            raise RuntimeError("the compiled kernel disagrees with the eager one on the probe")
        return kernel

    return cached(key, make)


def on_device(device):
    """The context a Triton launch for ``device`` runs in: Triton launches on the current CUDA device, which need not
    be the tensors' (a model over several GPUs)."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def probed(name: str, device, load: Callable[[], object], probe: Callable, reference: str):
    """What ``load()`` returns (it imports the Triton kernels: a step function, or a module), once ``probe(loaded,
    device)``, run under :func:`on_device`, agreed with ``reference`` on ``device``; else None, logged once (cached
    per process and device under ``("triton", name, str(device))``): the caller runs its reference path. Every
    Triton kernel of the package is admitted here."""
    def make():
        loaded = load()
        with on_device(device):
            agrees = probe(loaded, device)
        if not agrees:
            raise RuntimeError(f"the Triton kernel disagrees with {reference} on its probe on {device}")
        return loaded

    return cached(("triton", name, str(device)), make)


def note_missing_triton(p: torch.Tensor) -> None:
    """One warning per process where a CUDA tensor finds no Triton: every family then steps it on its torch paths."""
    if p.device.type == "cuda" and not _triton.available():
        log_once(logging.WARNING, ("triton", "missing"), "hf_efficient: Triton is not installed; steps on CUDA take "
                 "the families' torch kernels (same results, slower): pip install triton (CUDA builds of torch ship "
                 "it)")


def triton_may_apply(params) -> bool:
    """A cheap test before the per-tensor ones, so that a CPU step costs what it did: a CUDA tensor among
    ``params``, or CPU tensors under the interpreter (tests)."""
    return any(p.is_cuda for p in params) or (bool(params) and _triton.applies(params[0]))


def triton_split(indices, params, fits: Callable[[int], bool], kernel: Callable[[torch.device], object]):
    """``({device: indices}, other indices)`` of ``indices`` into ``params``: those a family's Triton kernel steps
    (``fits(i)``: its test of one tensor; ``kernel(device)``: its kernel there once probed, else None), and those its
    other paths step, in order."""
    indices = list(indices)
    if not triton_may_apply([params[i] for i in indices]):
        return {}, indices
    mine = {}
    for i in indices:
        note_missing_triton(params[i])
        if fits(i):
            mine.setdefault(params[i].device, []).append(i)
    mine = {device: idx for device, idx in mine.items() if kernel(device) is not None}
    taken = {i for idx in mine.values() for i in idx}
    return mine, [i for i in indices if i not in taken]


def step_device(p: torch.Tensor, dtypes: tuple[torch.dtype, ...] | None = None) -> torch.device:
    """Where ``p``'s step count lives: on its device where a Triton kernel may step it (a weight of ``dtypes``, the
    ones the family's kernel takes; None: any), which reads the count there as torch's fused AdamW does; else on the
    CPU (the host reads it for free)."""
    return p.device if (dtypes is None or p.dtype in dtypes) and _triton.applies(p) else torch.device("cpu")


def takes_found_inf(optimizer, takes: Callable) -> bool:
    """The guard's ``takes_found_inf()`` for every family: True where some tensor has a gradient and the family's
    Triton kernels step every one of them (``takes(p, group, state)``, ``state`` empty before its first step), none
    an FSDP2 shard (their host paths read the flag). Those kernels read the guard's device-side flag
    (``optimizer.found_inf``), so the guard need not read its check on the host."""
    todo = [(p, group) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return bool(todo) and all(not _sharded.is_sharded(p) and takes(p, group, optimizer.state.get(p) or {})
                              for p, group in todo)


_ARRAYS = {"ptrs": "Q", "i64s": "q", "i32s": "i", "f32s": "f", "f64s": "d"}  # array kinds -> array typecode
_SCALARS = {"count": ctypes.c_int64, "int": ctypes.c_int64, "threads": ctypes.c_int, "mode": ctypes.c_int,
            "ptr": ctypes.c_void_p}
_SPLIT = "start:int end:int threads:threads"  # what :func:`._native.run_split` appends to every call
assert array("i").itemsize == 4 and array("Q").itemsize == ctypes.sizeof(ctypes.c_void_p)  # C's int32_t, void *


C_KERNELS: dict = {}  # (source, symbol) -> its CKernel: every declared C function (tests check them against C)


def _address(value) -> int:
    """A tensor's data pointer, or an address (0: NULL)."""
    return value if isinstance(value, int) else value.data_ptr()


class CKernel:
    """One C function of this package, declared once: its source, symbol, signature and probe. The ctypes
    argtypes come from the signature, every call's Python values are converted by kind and checked before C runs
    (a wrong length would make C read past an array's end), and a split kernel runs through
    :func:`._native.run_split`.

    The signature is ``name:kind`` words in the C prototype's order, its trailing ``start, end, threads`` left out
    where ``split`` (run_split appends them). Kinds: ``count`` (int64, the number of tensors), ``int`` (int64),
    ``threads`` (int), ``mode`` (a compensation name, as :data:`.compensation.C_MODES` numbers it), ``ptr`` (a
    tensor's data pointer or an address), and arrays: ``ptrs`` (tensors' data pointers, None or 0 for NULL; the
    whole argument None: a NULL array), ``i64s``, ``i32s``, ``f32s``, ``f64s``. An array holds one entry per tensor;
    ``*k``: k per tensor; ``*``: a whole number per tensor; ``=k``: exactly k. Arrays are ``array`` module buffers:
    filling a ctypes array from Python costs more, at every step."""

    def __init__(self, source: str, symbol: str, signature: str, probe: Callable[[Callable], bool], restype=None,
                 split: bool = True):
        self.source, self.symbol, self.probe, self.restype, self.split = source, symbol, probe, restype, split
        self.names, self._kinds = [], []  # _kinds: (kind, entries per tensor, exact entries), per argument
        for word in (signature + " " + _SPLIT if split else signature).split():
            name, _, kind = word.rpartition(":")
            base, rule, n = kind.partition("=") if "=" in kind else kind.partition("*")
            if base not in _ARRAYS and (base not in _SCALARS or rule):
                raise ValueError(f"{symbol}: unknown argument kind {kind!r} of {name!r}; kinds: "
                                 f"{sorted(_SCALARS) + sorted(_ARRAYS)} (arrays may end in *k, * or =k)")
            if base in _ARRAYS and rule != "=" and "count" not in self.names:
                raise ValueError(f"{symbol}: {name!r} has entries per tensor, so a count must come before it")
            self.names.append(name or base)
            self._kinds.append((base, None if rule == "=" or (rule and not n) else int(n or 1),
                                int(n) if rule == "=" else None))
        self.argtypes = [_SCALARS.get(base, ctypes.c_void_p) for base, _, _ in self._kinds]
        self._given = len(self._kinds) - (3 if split else 0)  # the values a caller passes
        C_KERNELS[(source, symbol)] = self

    def fn(self):
        """The bound C function, once ``probe(fn)`` showed it gives the eager kernel's results; else None (no
        compiler, build failed, probe failed: logged once). Cached under ``("native", source, symbol)``."""
        def make():
            lib = _native.load(self.source)
            if lib is None:
                return None  # _native logged why
            fn = _native.bind(lib, self.symbol, self.argtypes, self.restype)
            if not self.probe(fn):
                log_once(logging.WARNING, ("probe", self.source), "hf_efficient: the C kernel %s disagrees with the "
                         "eager kernel on its probe; not using it", self.source)
                return None
            return fn

        return cached(("native", self.source, self.symbol), make)

    def args(self, *values) -> tuple[list, list]:
        """``values`` (one per signature word a caller passes) as C arguments, and the buffers they point into
        (keep them alive until C returned). Raises TypeError / ValueError naming the argument on a wrong value."""
        if len(values) != self._given:
            raise TypeError(f"{self.symbol} takes {self._given} values ({', '.join(self.names[:self._given])}), "
                            f"got {len(values)}")
        count, args, keep = 0, [], []
        for name, (kind, per, exact), value in zip(self.names, self._kinds, values):
            try:
                if kind in _SCALARS:
                    arg = C_MODES[value] if kind == "mode" else _address(value) if kind == "ptr" else index(value)
                    if kind == "count":
                        count = arg
                elif value is None and kind == "ptrs":
                    arg = None  # a NULL array
                else:
                    buf = array(_ARRAYS[kind], [0 if v is None else v.data_ptr() for v in value]
                                if kind == "ptrs" else value)
                    keep.append(buf)
                    arg = buf.buffer_info()[0]
            except (KeyError, TypeError, AttributeError, OverflowError) as e:
                if kind == "mode":
                    raise ValueError(f"{self.symbol}: {name}={value!r} is not a compensation mode; expected one of "
                                     f"{sorted(C_MODES)}") from None
                raise TypeError(f"{self.symbol}: argument {name!r} is not a {kind} value ({type(e).__name__}: "
                                f"{e})") from None
            if kind in _ARRAYS and arg is not None:
                self._check_length(name, kind, len(buf), count, per, exact)
            args.append(arg)
        return args, keep

    def _check_length(self, name: str, kind: str, length: int, count: int, per: int | None, exact: int | None):
        """Raise unless an array of ``length`` entries fits its rule for ``count`` tensors (see the class)."""
        if exact is not None:
            fits, want = length == exact, exact
        elif per is not None:
            fits, want = length == count * per, f"{per} per tensor"
        else:
            fits, want = length % max(count, 1) == 0 and (length > 0) == (count > 0), "a whole number per tensor"
        if not fits:
            raise ValueError(f"{self.symbol}: argument {name!r} ({kind}) has {length} entries for {count} tensors; "
                             f"expected {want}")

    def run(self, fn, *values, n: int = 0, unit: int = 1, threads: int | None = None):
        """``fn`` (:meth:`fn`'s result, or a probe's candidate) on ``values``: a split kernel over ``n`` items of
        ``unit`` elements through :func:`._native.run_split` (its results, a list; ``threads`` as it takes it),
        any other called once (its result)."""
        args, keep = self.args(*values)  # noqa: F841 - keep: the buffers C reads, alive until it returned
        if not self.split:
            return fn(*args)
        return _native.run_split(fn, tuple(args), n, unit=unit, threads=threads)


_LIBRARY = torch.library.Library("hf_efficient", "FRAGMENT")
_IMPLS: dict = {}  # op name -> its function


def custom_op(name: str, fn: Callable, mutates_args: tuple[str, ...]):
    """``fn`` (a C kernel's step over lists of CPU tensors, in place, returning None) as the op
    ``torch.ops.hf_efficient.{name}``: it shows in the profiler under that name, and ``torch.compile`` calls it as
    an opaque op instead of tracing ctypes. Defined with ``torch.library.Library`` rather than
    ``torch.library.custom_op``: the version bumps of the mutated tensors and the autograd check then run in C++,
    and a step of many tensors spends far less in the dispatcher than through ``custom_op``'s Python wrappers."""
    if name not in _IMPLS:  # defined once per process: a reloaded module (tests) only replaces the function
        _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        _LIBRARY.impl(name, lambda *args: _IMPLS[name](*args), "CPU")
        torch.library.register_fake(f"hf_efficient::{name}", lambda *args: None, lib=_LIBRARY)  # no outputs
    _IMPLS[name] = fn
    return getattr(torch.ops.hf_efficient, name).default


def call(kernel: Callable, fallback: Callable, family: str, *args):
    """``kernel(*args)``; if it fails to compile, it is dropped for the rest of the process (one warning) and
    ``fallback(*args)`` does this call. Any other error propagates."""
    try:
        return kernel(*args)
    except compile_errors() as e:
        log_once(logging.WARNING, ("compile", family, type(e).__name__), "%s: the compiled kernel failed (%s: %s); "
                 "continuing with the eager kernel (same results, slower). Pass compile=False to skip compiling.",
                 family, type(e).__name__, e)
        with _LOCK:
            for key, fn in _COMPILED.items():
                if fn is kernel:
                    _COMPILED[key] = None
        return fallback(*args)


class Bf16WeightKernel:
    """A family's C kernel for bf16 weights with fp32 state on CPU, where the torch path steps fp32 copies and
    writes them back (:func:`.compensation.step_in_fp32`): ``adamw_cpu.c``'s ``adamw_step``, ``lion8bit_cpu.c``'s
    ``lion_step``. Their C signature is declared once, in ``self.c``: ``states[k * count + t]`` the k-th fp32 state
    tensor of tensor t, ``coef`` the family's scalars per tensor. Exposed as the op ``torch.ops.hf_efficient.{name}``.

    Used only once its probe passed: on fresh tensors (``probe_states``: each state's initial value; ``probe_coef``:
    the scalars of the step ``reference(params, grads, states, comps, keys, mode)``, the torch path, takes), every
    mode, elements split over 3 threads, it must agree with the torch path: state within 1e-6 relative, weights
    within one bf16 spacing, Kahan buffers within 1% (weights 1.0, updates of about a quarter of a bf16 spacing: a
    lost compensation fails). Tests check the bits (another torch build may round its multiply-adds otherwise)."""

    def __init__(self, name: str, source: str, symbol: str, reference: Callable, probe_states: tuple[float, ...],
                 probe_coef: Callable[[], list[float]]):
        self.reference, self.probe_states, self.probe_coef = reference, probe_states, probe_coef
        self.c = CKernel(source, symbol, f"count params:ptrs grads:ptrs states:ptrs*{len(probe_states)} comps:ptrs "
                         f"numel:i64s g_bf16:i32s keys:i32s coef:f32s*{len(probe_coef())} mode:mode", self._probe)

        def step(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[torch.Tensor],
                 comps: list[torch.Tensor], keys: list[int], coef: list[float], compensation: str,
                 threads: int) -> None:  # not ``mode``: torch's dispatch passes a keyword of that name to ops
            self._run(self.fn(), params, grads, states, comps, keys, coef, compensation, threads)

        self.op = custom_op(name, step, ("params", "states", "comps"))

    def fn(self):
        """The C function, once its probe passed; else None (see :meth:`CKernel.fn`)."""
        return self.c.fn()

    @staticmethod
    def eligible(p: torch.Tensor, g: torch.Tensor, states, comp, compensation: str) -> bool:
        """Whether the kernel can step ``p``: a plain contiguous bf16 CPU weight, an fp32 or bf16 gradient, fp32
        ``states``, and its bf16 Kahan buffer ``comp`` under kahan."""
        if p.dtype != torch.bfloat16 or not p.is_cpu or g.dtype not in (torch.float32, torch.bfloat16):
            return False
        kahan = compensation == "kahan"
        tensors = (p, g, *states, comp) if kahan else (p, g, *states)
        return (all(s.dtype == torch.float32 for s in states) and (not kahan or (
            comp is not None and comp.dtype == torch.bfloat16))
                and all(t.is_cpu and t.is_contiguous() for t in tensors) and _native.plain(*tensors))

    def split(self, params, grads, states, comps, compensation: str) -> tuple[list[int], list[int]]:
        """The indices of the tensors this kernel steps (:meth:`eligible` ones, once it passed its probe), and the
        others' (``states``: each tensor's fp32 state tensors; ``comps``: its Kahan buffer or None)."""
        mine = [i for i in range(len(params)) if self.eligible(params[i], grads[i], states[i], comps[i], compensation)]
        if mine and self.fn() is None:
            mine = []
        taken = set(mine)
        return mine, [i for i in range(len(params)) if i not in taken]

    def __call__(self, params, grads, states, comps, keys, coef, compensation: str) -> None:
        """The step of ``params`` (``states``: each tensor's fp32 tensors; ``comps``: Kahan buffers, under kahan)."""
        self.op([p.detach() for p in params], grads, _state_major(states),
                [c for c in comps if c is not None] if compensation == "kahan" else [], keys, coef, compensation, -1)

    def _run(self, fn, params, grads, states, comps, keys, coef, mode: str, threads: int | None) -> None:
        """``fn`` over all the tensors in one call (``states`` flat, state-major), split over torch's threads
        (``threads`` < 0 or None) or ``threads``."""
        self.c.run(fn, len(params), params, grads, states, comps or None, [p.numel() for p in params],
                   [g.dtype == torch.bfloat16 for g in grads], keys, coef, mode,
                   n=sum(p.numel() for p in params), threads=None if threads is None or threads < 0 else threads)

    def _probe(self, fn) -> bool:
        n = 2 * _native._MIN_PER_THREAD + 37
        gen = torch.Generator().manual_seed(0)
        grads = [torch.randn(n, generator=gen), (torch.randn(n, generator=gen) * 1e-3).bfloat16()]
        for mode in COMPENSATIONS:
            runs = []
            for c_kernel in (True, False):
                ps = [torch.ones(n, dtype=torch.bfloat16) for _ in grads]
                states = [tuple(torch.full((n,), v) for v in self.probe_states) for _ in grads]
                cs = [torch.zeros(n, dtype=torch.bfloat16) if mode == "kahan" else None for _ in grads]
                if c_kernel:
                    self._run(fn, ps, grads, _state_major(states), [c for c in cs if c is not None], [7, -9],
                              self.probe_coef() * len(ps), mode, 3)
                else:
                    self.reference(ps, grads, states, cs, [7, -9], mode)
                runs.append((ps, [s for st in states for s in st], cs))
            (pc, sc, cc), (pt, st, ct) = runs
            close = all(torch.allclose(a, b, rtol=1e-6, atol=0.0) for a, b in zip(sc, st))
            close &= all(((a.float() - b.float()).abs() <= 2.0**-7).all() for a, b in zip(pc, pt))
            if mode == "kahan":
                close &= all(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=0.0) for a, b in zip(cc, ct))
            if not close:
                return False
        return True


def _state_major(states) -> list:
    """Each tensor's state tuples, as the C kernels take them: every tensor's first state, then every second..."""
    return [s[k] for k in range(len(states[0]) if states else 0) for s in states]
