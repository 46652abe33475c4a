"""Finding non-finite gradients: the inf/NaN scan behind the guard's ``nonfinite`` policy (:mod:`hf_efficient.guard`).

A gradient is bad when it holds an inf or NaN, or a finite value whose square overflows fp32 (``|g| >= OVERFLOW``: the
second moment would be inf). Four ways to find one, each used where it is cheapest:

- the C scan (``grad_check_cpu.c``): plain contiguous CPU fp32/bf16/fp16 tensors, on torch's threads;
- torch's check: one multi-tensor inf-norm and a compare, any device, one host read;
- the device flag (CUDA, where the backend honours torch's ``optimizer.found_inf``): a float32 flag left on the
  device, read by nobody here (see :data:`_FLAG_TABLE`): a Triton scan in one launch per gradient dtype
  (:mod:`.optim.nonfinite_triton`) where it applies, else torch's check without its host read;
- the backward scan, where the host check runs on CPU: each gradient of 65,536+ elements is scanned in backward, by a
  post-accumulate-grad hook, the moment backward completes it, and remembered clean with its version counter. At
  ``step()`` the scan reads every gradient from memory again, a sizeable share of a fused AdamW step; in backward the
  gradient is still in cache, so the same scan costs less. ``step()`` scans, in one call,
  what no hook vouches for: small gradients, gradients set by hand or replaced, gradients changed in place since
  (clipping, ``zero_grad(set_to_none=False)``, a later backward: each advances the version). Not trusted, so
  scanned at ``step()`` in full: under a GradScaler (its unscale op does not advance versions), in a process group
  of more than one process (DDP and DeepSpeed reduce after the hooks), on DTensor shards. Where the steps keep
  scanning again what the hooks scanned (clipping, micro-batch accumulation), the hooks go quiet (see
  :class:`_BackwardScan`). Writes that bypass the version counter (``grad.data``, ``grad.numpy()``, raw pointers)
  are not seen: change gradients through torch's ops.

The interface the guard and gradient release use: :func:`first_nonfinite`, :func:`checks_on_device`,
:func:`flag_on_device`, :func:`check_on_host`, :func:`watch`, :func:`follow_params`, :func:`is_bad`,
:func:`defer_scans`, and for gradient release's buckets :func:`checked_per_bucket`, :func:`flag_grads` and
:func:`bad_grads`. What a bad gradient then does (raise, skip, count) is the guard's policy, not decided here.
"""

from __future__ import annotations

import ctypes
import logging
import time
import weakref

import torch
import torch.distributed as dist

from .optim import _native, _triton
from .optim._dispatch import CKernel, log_once, probed
from .param_groups import named_params

__all__ = ["OVERFLOW", "first_nonfinite", "checks_on_device", "flag_on_device", "check_on_host", "watch",
           "follow_params", "is_bad", "defer_scans", "flag_grads", "checked_per_bucket", "bad_grads"]

logger = logging.getLogger(__name__)

OVERFLOW = 2.0**64  # |g| from which g * g overflows fp32 (and bf16): treated like inf

_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # grad_check_cpu.c's dtype numbers


def _first_bad_native(grads: list[torch.Tensor]) -> int | None:
    """Index of the first gradient holding an inf, NaN or ``|g| >= OVERFLOW``, -1 if none, via the C scan
    (``grad_check_cpu.c``); None where it does not apply (not all plain contiguous CPU fp32/bf16/fp16 tensors, or
    no C compiler)."""
    if not _c_scannable(grads):
        return None
    fn = _scan_kernel()
    return None if fn is None else _scan(fn, grads)


def _c_scannable(grads: list[torch.Tensor]) -> bool:
    return _native.plain(*grads) and all(g.device.type == "cpu" and g.dtype in _KINDS and g.is_contiguous()
                                         for g in grads)


def _scan(fn, grads: list[torch.Tensor], threads: int | None = None) -> int:
    found = [i for i in _SCAN.run(fn, len(grads), grads, [g.numel() for g in grads], [_KINDS[g.dtype] for g in grads],
                                  n=sum(g.numel() for g in grads), threads=threads) if i >= 0]
    return min(found, default=-1)


def _scan_probe(fn) -> bool:
    """Over 3 threads and a range that splits unevenly, the scan finds a bad value at each end and none in a clean
    copy (a scan that skips a share, as the old split did under OMP_THREAD_LIMIT, is refused)."""
    clean = [torch.zeros(7), torch.ones(2 * 65536 + 1), torch.ones(5, dtype=torch.bfloat16)]
    last, first = [t.clone() for t in clean], [t.clone() for t in clean]
    last[1][-1], first[1][0], last[2][-1] = float("nan"), 2.0**64, float("inf")
    return _scan(fn, clean, 3) == -1 and _scan(fn, last, 3) == 1 and _scan(fn, first, 3) == 1


_SCAN = CKernel("grad_check_cpu.c", "first_nonfinite", "count grads:ptrs numel:i64s kind:i32s", _scan_probe,
                ctypes.c_int64)


def _scan_kernel():
    """The C scan, once :func:`_scan_probe` passed (cached, probed and logged by the kernels' dispatcher); else
    None: the torch check is used."""
    return _SCAN.fn()


def _bad_flags(grads: list[torch.Tensor]) -> torch.Tensor:
    """Per gradient (all non-empty), whether it holds an inf, NaN or ``|g| >= OVERFLOW``: a bool vector on their
    device, read nowhere here.

    The largest magnitude of each gradient (inf-norm, which keeps NaN) from one multi-tensor call: a single fused
    pass over all gradients on CUDA; no sum to overflow on finite values.
    """
    wide = any(g.dtype == torch.float64 for g in grads)  # the norm's dtype cannot be narrower than a gradient's
    peaks = torch._foreach_norm(grads, float("inf"), dtype=torch.float64 if wide else torch.float32)
    return ~(torch.stack(peaks) < OVERFLOW)  # True for NaN, inf and overflowing squares


def _first_bad_torch(grads: list[torch.Tensor]) -> int:
    """Index of the first gradient holding an inf, NaN or ``|g| >= OVERFLOW``, or -1 (any device; one host read)."""
    nonempty = [i for i, g in enumerate(grads) if g.numel()]
    if not nonempty:
        return -1
    bad = _bad_flags([grads[i] for i in nonempty])
    if not bool(bad.any()):
        return -1
    return nonempty[int(bad.nonzero()[0])]


def _sharded(params) -> bool:
    return any(hasattr(p, "to_local") for p in params)


def first_nonfinite(optimizer) -> str | None:
    """Name of the first parameter whose gradient holds an inf, NaN or ``|g| >= OVERFLOW``, else None (every gradient
    read now: no backward scan taken on trust).

    Under FSDP2 (DTensor parameters) every rank checks its shards and all ranks take the same decision by one
    all-reduce, entered by every rank, also one that holds no gradient this step.
    """
    return _find_nonfinite(optimizer, trust_hooks=False)[0]


def _find_nonfinite(optimizer, trust_hooks: bool) -> tuple[str | None, int]:
    """:func:`first_nonfinite`, skipping with ``trust_hooks`` the gradients that the backward hooks found clean at
    their present version (in one process, without shards); also the number of elements so skipped."""
    params = named_params(optimizer.param_groups)
    live = [(n, p) for n, p in params if p.grad is not None and not p.grad.is_sparse]
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for _, p in live]  # FSDP2: check ours
    sharded = _sharded(p for _, p in params)
    todo, used = list(range(len(grads))), 0
    if trust_hooks and not sharded and _single_process():
        todo = [i for i in todo if not _scanned_clean(grads[i])]
        used = sum(g.numel() for g in grads) - sum(grads[i].numel() for i in todo)
        hooks = _HOOKS.get(optimizer)
        if hooks is not None and any(grads[i].numel() >= _HOOK_MIN and not hooks.hooked(live[i][1]) for i in todo):
            hooks.sync(p for _, p in params)  # parameters added to the groups by hand, or unfrozen since
    first = -1
    if todo:
        first = _first_bad_native([grads[i] for i in todo])
        if first is None:
            first = _first_bad_torch([grads[i] for i in todo])
        first = todo[first] if first >= 0 else -1
    bad = first >= 0
    if sharded and dist.is_available() and dist.is_initialized():  # every rank must take the same decision
        device = params[0][1].to_local().device if hasattr(params[0][1], "to_local") else params[0][1].device
        flag = torch.tensor(int(bad), dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        bad = bool(flag)
    if not bad:
        return None, used
    return (live[first][0] if first >= 0 else "(a parameter on another rank)"), used



# ------------------------------------------------------------------------------------ the scan in backward

_HOOK_MIN = 1 << 16  # elements: below this a scan call of its own costs more than the tensor's read at step()
_RETRY_STEPS = 100  # steps with the hooks off, after a step that did not use their scans, before they try again
# Bytes per second below which a hook's scan of a gradient still in cache stalled (a scan from cache reads far
# faster): the team waited at its barrier for a thread the OS gave to another process. On a loaded machine such
# stalls cost far more than one thread's slower scan, so such an optimizer's hooks scan on one thread from then on.
_STALLED = 10e9
_CLEAN: dict[int, tuple] = {}  # id(grad) -> (weakref to that grad, its _version when a hook found it clean)


def _scanned_clean(grad: torch.Tensor) -> bool:
    """A hook found ``grad`` clean, and nothing changed it in place since (its version is the one scanned)."""
    seen = _CLEAN.get(id(grad))
    return seen is not None and seen[0]() is grad and seen[1] == grad._version


def _remember_clean(grad: torch.Tensor) -> None:
    key = id(grad)

    def forget(ref):  # the grad died: its id may be reused by another tensor
        if _CLEAN.get(key, (None,))[0] is ref:
            del _CLEAN[key]

    _CLEAN[key] = (weakref.ref(grad, forget), grad._version)


def _single_process() -> bool:
    """No process group of several processes: there, DDP and DeepSpeed reduce gradients after the hooks ran."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1


class _BackwardScan:
    """The post-accumulate-grad hooks of one optimizer's parameters. A hook holds a weak reference to the optimizer
    (a dead optimizer leaves no hooks: ``weakref.finalize``); it never raises inside backward: a bad gradient is just
    not remembered, and ``step()`` finds it and names it.

    The hooks scan only while the steps use what they scanned. A step that scans again what they scanned (clipping
    changed every gradient, a GradScaler unscaled them, micro-batches accumulated into them) turns them off for
    ``_RETRY_STEPS`` steps: such a loop would otherwise pay for the scan twice."""

    def __init__(self, optimizer):
        self.ref = weakref.ref(optimizer)
        self.handles: dict[int, tuple] = {}  # id(param) -> (weakref to param, hook handle)
        self.active, self.off_steps = True, 0
        self.threads: int | None = None  # torch's thread count; 1 once a scan stalled
        self.scanned = 0  # elements the hooks found clean since the last step
        weakref.finalize(optimizer, _remove_hooks, self.handles)

    def settle(self, used: int) -> None:
        """At a step that used ``used`` elements' scans: switch the hooks off if they scanned more, back on later."""
        if self.active and self.scanned > used:
            self.active, self.off_steps = False, _RETRY_STEPS
        elif not self.active:
            self.off_steps -= 1
            self.active = self.off_steps <= 0
        self.scanned = 0

    def hooked(self, p: torch.Tensor) -> bool:
        entry = self.handles.get(id(p))
        return entry is not None and entry[0]() is p

    def sync(self, params) -> None:
        """Hooks on exactly those of ``params`` that require a gradient."""
        params = [p for p in params if p.requires_grad and p.is_leaf]
        current = {id(p) for p in params}
        for key in [k for k, (ref, _) in self.handles.items() if k not in current or ref() is None]:
            self.handles.pop(key)[1].remove()
        for p in params:
            if not self.hooked(p):
                self.handles[id(p)] = (weakref.ref(p), p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, p: torch.Tensor) -> None:
        optimizer, grad = self.ref(), p.grad
        if (not self.active or optimizer is None or grad is None or grad.numel() < _HOOK_MIN
                or _scanned_clean(grad) or not _single_process()):  # clean: another optimizer's hook scanned it
            return
        if optimizer not in _DEFERRED and self.scan(grad):
            self.scanned += grad.numel()
            _remember_clean(grad)

    def scan(self, grad: torch.Tensor) -> bool | None:
        """Whether ``grad``, just completed by backward, is clean, by the C scan on torch's threads (on one thread for
        good once a scan stalled, see _STALLED); None where the C scan does not apply (see :func:`is_bad`)."""
        fn = _scan_kernel()
        if fn is None or not _c_scannable([grad]):
            return None
        start = time.perf_counter()
        clean = _scan(fn, [grad], threads=self.threads) < 0
        if self.threads is None and time.perf_counter() - start > grad.numel() * grad.element_size() / _STALLED:
            self.threads = 1  # see _STALLED
        return clean


def _remove_hooks(handles: dict) -> None:
    for _, handle in handles.values():
        handle.remove()
    handles.clear()


_HOOKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> _BackwardScan; not an attribute:
# a copy (deepcopy, pickle) is given its own hooks by the guard's protect()
_DEFERRED: "weakref.WeakSet" = weakref.WeakSet()  # optimizers whose gradients gradient release checks itself


def watch(optimizer, on: bool) -> None:
    """Scan ``optimizer``'s gradients in backward where ``on`` (the check is wanted) and it runs on CPU; replaces the
    hooks it had. Elsewhere the step's one pass stays: a per-tensor check in a CUDA backward would add a launch per
    tensor, or a device sync to read its result."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    wanted = on and not _sharded(params) and all(p.device.type == "cpu" for p in params) and _scan_kernel() is not None
    hooks = _HOOKS.pop(optimizer, None)
    if hooks is not None:
        _remove_hooks(hooks.handles)
    if wanted:
        hooks = _HOOKS[optimizer] = _BackwardScan(optimizer)
        hooks.sync(params)


def follow_params(optimizer) -> None:
    """Hook the parameters now in ``optimizer``'s groups (after ``add_param_group``), where it is watched."""
    hooks = _HOOKS.get(optimizer)
    if hooks is not None:
        hooks.sync(p for g in optimizer.param_groups for p in g["params"])


def defer_scans(optimizer, deferred: bool) -> None:
    """While ``deferred``, the backward scans leave ``optimizer``'s gradients alone: gradient release checks (and
    steps) each one in its own hook, through :func:`is_bad`."""
    if deferred:
        _DEFERRED.add(optimizer)
    else:
        _DEFERRED.discard(optimizer)


def is_bad(optimizer, grad: torch.Tensor) -> bool:
    """Whether one gradient, just completed by backward, holds an inf, NaN or ``|g| >= OVERFLOW``: the backward scan's
    C scan (with its stall rule) where ``optimizer`` is watched, else, or where the C scan does not apply, torch's
    check (as the step's)."""
    hooks = _HOOKS.get(optimizer)
    clean = None if hooks is None else hooks.scan(grad)
    return _first_bad_torch([grad]) >= 0 if clean is None else not clean


def check_on_host(optimizer, trust_hooks: bool) -> str | None:
    """The step's check read on the host: the first bad parameter's name, else None. ``trust_hooks``: gradients the
    backward scans found clean at their present version are not scanned again (false under a GradScaler, whose
    unscale does not advance versions); the scans are switched off for a while where the steps do not use them."""
    bad, used = _find_nonfinite(optimizer, trust_hooks)
    hooks = _HOOKS.get(optimizer)
    if hooks is not None:
        hooks.settle(used)
    return bad


# ------------------------------------------------------------------------------ the check on the device (CUDA)

_DEVICE_FLAG_ON_CPU = False  # tests only: CPU tensors take the device path too (CI has no GPU)


def _is_from(backend: type, package: str) -> bool:
    return any(c.__module__.split(".")[0] == package for c in backend.__mro__)


def _hf_efficient_takes_flag(optimizer) -> bool:
    takes = getattr(optimizer, "takes_found_inf", None)
    return takes is not None and bool(takes())


# The one table of which backends honour ``optimizer.found_inf`` (torch's attribute: a float32 scalar on the device;
# non-zero makes the whole step a no-op, step counts included): ``(backend, is it, does its step take the flag)``,
# first match wins, by the backend's class (the guard's subclass would match "hf_efficient" for every backend).
# Where it is taken, the guard checks on the device and reads nothing in step(); elsewhere (and for a backend no row
# names) it keeps the host check.
_FLAG_TABLE = (
    ("bitsandbytes", lambda cls: _is_from(cls, "bitsandbytes"), lambda o: False),  # its kernels take no flag
    ("torchao", lambda cls: _is_from(cls, "torchao"), lambda o: False),  # nor do its compiled ones
    # this package's families: their Triton kernels read it (optim/_triton.flag), their compiled torch, C and eager
    # paths do not; a family whose step is about to run Triton kernels for every tensor says so by takes_found_inf()
    ("hf_efficient", lambda cls: _is_from(cls, "hf_efficient"), _hf_efficient_takes_flag),
    # torch's Adam / AdamW: the fused kernel reads it and takes its step counts back; foreach / for-loop refuse it
    ("torch", lambda cls: issubclass(cls, torch.optim.Adam), lambda o: all(g.get("fused") for g in o.param_groups)),
)


def _takes_flag(optimizer, backend: type) -> bool:
    """Whether the step of ``backend`` (``optimizer``'s class) honours ``optimizer.found_inf`` for every tensor
    (:data:`_FLAG_TABLE`); logs once per backend where it does not."""
    for name, matches, takes in _FLAG_TABLE:
        if matches(backend):
            if takes(optimizer):
                return True
            break
    else:
        name = backend.__qualname__
    log_once(logging.INFO, ("host check", name), "hf_efficient: %s's step takes no device-side inf/NaN flag here: "
             "the guard reads its check on the host, one sync per step", name)
    return False


def checks_on_device(optimizer, backend: type, scaled: bool) -> bool:
    """Whether the step's check runs on the device: CUDA (or CPU in tests), no GradScaler (``scaled``: it checked
    already, on the host), no DTensor shards (their ranks agree through the host check's all-reduce), and a
    ``backend`` class whose step takes the flag."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    device = params[0].device.type
    return ((device == "cuda" or (device == "cpu" and _DEVICE_FLAG_ON_CPU)) and not scaled and not _sharded(params)
            and _takes_flag(optimizer, backend))


def flag_on_device(optimizer) -> tuple[torch.Tensor, torch.Tensor, list[str]] | None:
    """The step's check left on the device, no host read: ``(found, flags, names)``, ``found`` the float32 flag to set
    as ``optimizer.found_inf`` (1.0: a gradient is bad), ``flags`` per gradient (non-zero: bad), ``names`` their
    parameters; None when no gradient has an element."""
    hooks = _HOOKS.get(optimizer)
    if hooks is not None:  # CPU in tests: the backward scans go unused
        hooks.settle(0)
    live = [(n, p.grad) for n, p in named_params(optimizer.param_groups)
            if p.grad is not None and not p.grad.is_sparse and p.grad.numel()]
    if not live:
        return None
    found, flags = flag_grads([g for _, g in live], _SCAN_TABLES.setdefault(optimizer, {}))
    return found, flags, [n for n, _ in live]


def flag_grads(grads: list[torch.Tensor], tables: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(found, flags)`` of non-empty ``grads`` of one device, left on the device (no host read): the Triton scan
    where it applies, else torch's check. ``tables``: the caller's pointer tables, kept between calls over the same
    tensors (a table per set of gradients: gradient release keeps one per bucket, so none is rebuilt per bucket)."""
    scan = _triton_scan(grads)
    if scan is not None:
        return scan(grads, tables)
    flags = _bad_flags(grads)
    return flags.any().float(), flags


def checked_per_bucket(grad: torch.Tensor) -> bool:
    """Whether gradient release checks ``grad`` with its bucket, when the bucket is stepped, rather than alone in its
    hook: on CUDA (or on CPU under the tests' switch), where a check per tensor would add a launch and a host read
    per tensor, and a bucket's check can stay on the device (:func:`flag_grads`) or cost one read."""
    kind = grad.device.type
    return kind == "cuda" or (kind == "cpu" and _DEVICE_FLAG_ON_CPU)


def bad_grads(grads: list[torch.Tensor]) -> list[int]:
    """Indices of the gradients (of one device) holding an inf, NaN or ``|g| >= OVERFLOW``, in order: one host read
    for all of them (gradient release's check of a bucket whose backend takes no device flag)."""
    nonempty = [i for i, g in enumerate(grads) if g.numel() and not g.is_sparse]
    if not nonempty:
        return []
    flags = _bad_flags([grads[i] for i in nonempty]).tolist()
    return [i for i, bad in zip(nonempty, flags) if bad]


_SCAN_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> its scan's pointer tables


def _triton_scan(grads: list[torch.Tensor]):
    """:func:`.optim.nonfinite_triton.scan` where it takes ``grads`` (one CUDA device, or CPU under the interpreter in
    tests; contiguous, of its dtypes) and its probe on that device passed; else None: torch's check."""
    if not _triton.applies(*grads):
        return None
    from .optim import nonfinite_triton as kernel

    if not all(g.dtype in kernel.DTYPES and g.is_contiguous() for g in grads):
        return None
    return probed("nonfinite", grads[0].device, lambda: kernel.scan, lambda scan, device: kernel.probe(device),
                  "the flags it expects")

