"""Kernel dispatch shared by every family: one cache, probe-then-publish, log-once, the compile-error fallback.

A family has up to three kernels for one step: its C kernel (CPU, via :mod:`._native`, exposed as a
``torch.library.custom_op`` so it shows in the profiler and composes with ``torch.compile``), its
``torch.compile``'d kernel, and the same function run eagerly. The kernels are cached here under a key the family
picks (kernel name, device type, dtype or mode): each is built and probed against the eager kernel once, under a
lock, and published only then (a thread that finds it published never sees a kernel that was not checked).
Where building or the probe fails, None is published and the reason logged once: the caller runs the next path.

A compiled kernel that fails when first called (no C++ compiler, no Triton) may fall back to eager, but only on
:func:`compile_errors`: an error from a running kernel may come after its in-place weight update, and running the
step again would apply it twice.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import threading
from typing import Callable

import torch

from . import _native

__all__ = ["cached", "compiled", "native", "custom_op", "call", "compile_errors", "log_once", "c_array"]

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


def native(source: str, symbol: str, argtypes: list, probe: Callable[[Callable], bool], restype=None):
    """The C function ``symbol`` of ``source`` (built by :mod:`._native`), once ``probe(fn)`` showed it gives the
    eager kernel's results; else None (no compiler, build failed, probe failed: logged once)."""
    def make():
        lib = _native.load(source)
        if lib is None:
            return None  # _native logged why
        fn = _native.bind(lib, symbol, argtypes, restype)
        if not probe(fn):
            log_once(logging.WARNING, ("probe", source), "hf_efficient: the C kernel %s disagrees with the eager "
                     "kernel on its probe; not using it", source)
            return None
        return fn

    return cached(("native", source, symbol), make)


_LIBRARY = torch.library.Library("hf_efficient", "FRAGMENT")
_IMPLS: dict = {}  # op name -> its function


def custom_op(name: str, fn: Callable, mutates_args: tuple[str, ...]):
    """``fn`` (a C kernel's step over lists of CPU tensors, in place, returning None) as the op
    ``torch.ops.hf_efficient.{name}``: it shows in the profiler under that name, and ``torch.compile`` calls it as
    an opaque op instead of tracing ctypes. Defined with ``torch.library.Library`` rather than
    ``torch.library.custom_op``: the version bumps of the mutated tensors and the autograd check then run in C++,
    and a step of 200 bf16 tensors costs 0.3 ms in the dispatcher instead of 0.85 ms."""
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


def c_array(ctype, values) -> ctypes.Array:
    """``values`` as a C array of ``ctype``; tensors give their data pointers (``ctypes.c_void_p``)."""
    values = list(values)
    if ctype is ctypes.c_void_p:
        values = [v.data_ptr() for v in values]
    return (ctype * len(values))(*values)
