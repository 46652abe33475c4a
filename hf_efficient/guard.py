"""Protections installed on every optimizer :func:`create_optimizer` builds, whatever its backend.

- ``nonfinite``: a gradient holding an inf or NaN, or a finite value whose square overflows fp32 (``|g| >= 2**64``,
  which would make the second moment inf), is found before the step touches any state. One such value poisons a
  whole block's scale of quantized state forever, so the default is ``"raise"``; ``"skip"`` skips the step for
  all parameters and counts it; ``"ignore"`` is torch's behaviour.
- On CUDA, with no host synchronisation, where the backend honours torch's ``optimizer.found_inf`` (the one table
  :data:`_FLAG_TABLE`: torch's fused AdamW, and this package's families whose step runs their Triton kernels, which
  they declare by a ``takes_found_inf()`` method, True for the step about to run): the
  step's gradients are checked on the device, by one multi-tensor inf-norm and a compare, into a float32 flag set as
  ``optimizer.found_inf`` for the backend's step (unset after), which then updates nothing, step counts included.
  Nothing is read in ``step()``. ``"skip"``: the step is voided; ``steps`` / ``skipped_steps`` of
  ``optimizer_info(opt)`` read the device's count when read (a warning then says how many were skipped).
  ``"raise"``: the step is voided, and the error is raised when the flag is next read on the host: at the next
  ``step()`` (before it launches anything: that step is not applied either), at ``state_dict()``, or at
  :func:`raise_if_voided` (where a training loop logs values); it names the first bad parameter and says that the
  step was not applied. The flag's copy to the host is waited for alone, so these reads do not stall. Backends that
  cannot take the flag (bitsandbytes, torchao, this package's compiled torch / C / eager paths), a GradScaler's step
  and DTensor shards keep the host check below: one host sync per step.
- Where the host check runs: on CPU, each gradient of 65,536+ elements is scanned in backward, by a post-accumulate-grad
  hook, the moment backward completes it, and remembered clean with its version counter. At ``step()`` the scan
  cost fused fp32 AdamW's step 21-28%; in backward the gradient is still in cache (28M parameters on 2-core Zen 4:
  1.8 ms per backward, where the scan at ``step()`` took 2.1-2.7 ms). ``step()`` scans, in one call,
  what no hook vouches for: small gradients, gradients set by hand or replaced, gradients changed in place since
  (clipping, ``zero_grad(set_to_none=False)``, a later backward: each advances the version). Not trusted, so
  scanned at ``step()`` in full: under a GradScaler (its unscale op does not advance versions), in a process group
  of more than one process (DDP and DeepSpeed reduce after the hooks), on DTensor shards. Where the steps keep
  scanning again what the hooks scanned (clipping, micro-batch accumulation), the hooks go quiet (see
  :class:`_BackwardScan`). Writes that bypass the version counter (``grad.data``, ``grad.numpy()``, raw pointers)
  are not seen: change gradients through torch's ops.
- Gradients reach the backend in their parameter's layout (torch's fused CPU AdamW reads a transposed or expanded
  gradient as if it had the parameter's strides); the user's ``p.grad`` is put back after the step, untouched.
- A ``GradScaler`` always unscales and checks before calling ``step`` (torch's fused kernels would otherwise take
  the scaled gradients, and the guard would raise on an ordinary fp16 overflow the scaler means to skip).
- ``add_param_group`` validates hyperparameters, dtypes, device and duplicates before the group is added.
- ``state_dict`` / ``load_state_dict`` go through :mod:`hf_efficient.checkpoint` (tagged canonical layout,
  validated before anything changes).

How: the optimizer's class is swapped for a subclass of it (made once per backend class) that overrides these
methods and calls the backend's through ``super()``. A class, not instance attributes, so that ``copy.deepcopy``,
``pickle`` and ``torch.save`` of the optimizer give a copy that is protected like the original (``__reduce_ex__``
rebuilds it), and torch's LR schedulers and step hooks see ordinary methods.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time
import weakref
from collections import defaultdict

import torch
import torch.distributed as dist

from . import checkpoint
from .optim import _native
from .optim._dispatch import c_array, log_once, native
from .options import check_flags, check_hyperparams, check_unique, run_closure
from .param_groups import group_names, named_params

__all__ = ["protect", "check_params", "first_nonfinite", "raise_if_voided", "read_voided", "OVERFLOW"]

logger = logging.getLogger(__name__)

OVERFLOW = 2.0**64  # |g| from which g * g overflows fp32 (and bf16): treated like inf


def check_params(params, spec, device: torch.device | None = None) -> None:
    """Refuse parameters of a dtype ``spec`` cannot train, or on another device than ``device``."""
    for name, p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{spec.trainer_name}: parameter {name!r} is a {type(p).__name__}, not a tensor: pass "
                            "model.parameters(), a module, or param groups {'params': [tensors]}")
        if p.dtype not in spec.dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in spec.dtypes)
            raise TypeError(f"{spec.trainer_name} cannot train parameter {name!r} of dtype "
                            f"{str(p.dtype).replace('torch.', '')}: it takes {allowed}")
        if p.device.type == "meta":
            raise ValueError(f"{spec.trainer_name}: parameter {name!r} is on the meta device (no data to train): "
                             "load or materialize the model (e.g. model.to_empty(device=...) and load weights) first")
        if device is not None and p.device != device:
            raise ValueError(f"parameter {name!r} is on {p.device}, the optimizer's other parameters on {device}: "
                             "one optimizer steps parameters of one device")


def _names(optimizer) -> list[str]:
    return [n for n, _ in named_params(optimizer.param_groups)]


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
    c_int64 = ctypes.c_int64
    args = (len(grads), c_array(ctypes.c_void_p, grads), c_array(c_int64, (g.numel() for g in grads)),
            c_array(ctypes.c_int32, (_KINDS[g.dtype] for g in grads)))
    found = [i for i in _native.run_split(fn, args, sum(g.numel() for g in grads), threads=threads) if i >= 0]
    return min(found, default=-1)


def _scan_probe(fn) -> bool:
    """Over 3 threads and a range that splits unevenly, the scan finds a bad value at each end and none in a clean
    copy (a scan that skips a share, as the old split did under OMP_THREAD_LIMIT, is refused)."""
    clean = [torch.zeros(7), torch.ones(2 * 65536 + 1), torch.ones(5, dtype=torch.bfloat16)]
    last, first = [t.clone() for t in clean], [t.clone() for t in clean]
    last[1][-1], first[1][0], last[2][-1] = float("nan"), 2.0**64, float("inf")
    return _scan(fn, clean, 3) == -1 and _scan(fn, last, 3) == 1 and _scan(fn, first, 3) == 1


def _scan_kernel():
    """The C scan, once :func:`_scan_probe` passed (cached, probed and logged by the kernels' dispatcher); else
    None: the torch check is used."""
    return native("grad_check_cpu.c", "first_nonfinite",
                  [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int], _scan_probe,
                  ctypes.c_int64)


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
# Bytes per second below which a hook's scan of a gradient still in cache stalled (it reads at 50-100 GB/s on 2
# threads): the team waited at its barrier for a thread the OS gave to another process. On the shared 2-core machine
# under load, the scans then took 72-319 ms per backward on 2 threads, 4-5 ms on one; so such an optimizer's hooks
# scan on one thread from then on (unloaded, one thread costs 2.6-2.9 ms per backward of 28M parameters, two 1.8).
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


def _under_scaler() -> bool:
    """Whether a loss scaler (torch's GradScaler, its subclasses) called this step: it unscaled the gradients in place
    with an op that does not advance their versions (``torch._amp_foreach_non_finite_check_and_unscale_``), so the
    backward scans no longer describe them. Found on the stack (scaler.step -> _maybe_opt_step -> LR scheduler's
    wrapper -> step): a frame count that costs ~1 us."""
    frame = sys._getframe(1).f_back  # the caller of step()
    for _ in range(8):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "_maybe_opt_step" or "Scaler" in getattr(code, "co_qualname", ""):
            return True
        frame = frame.f_back
    return False


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
        from .release import is_attached  # gradient release checks (and steps) each tensor itself, in its own hook

        if not is_attached(optimizer) and self.scan(grad):
            self.scanned += grad.numel()
            _remember_clean(grad)

    def scan(self, grad: torch.Tensor) -> bool | None:
        """Whether ``grad``, just completed by backward, is clean, by the C scan on torch's threads (on one thread for
        good once a scan stalled, see _STALLED); None where the C scan does not apply. Gradient release uses it too."""
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
# a copy (deepcopy, pickle) is given its own hooks by protect()


def _scan_in_backward(optimizer, info) -> None:
    """Hook ``optimizer``'s parameters where the check is on and runs on CPU (elsewhere the step's one pass stays:
    a per-tensor check in a CUDA backward would add a launch per tensor, or a device sync to read its result)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    wanted = (info.options.get("nonfinite", "ignore") != "ignore" and not _sharded(params)
              and all(p.device.type == "cpu" for p in params) and _scan_kernel() is not None)
    hooks = _HOOKS.pop(optimizer, None)
    if hooks is not None:
        _remove_hooks(hooks.handles)
    if wanted:
        hooks = _HOOKS[optimizer] = _BackwardScan(optimizer)
        hooks.sync(params)


def _in_param_layout(optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Give every gradient whose strides differ from its parameter's a copy in the parameter's layout; return
    ``(param, original grad)`` pairs to put back after the step."""
    swapped = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            grad = p.grad
            if grad is None or grad.is_sparse or grad.stride() == p.stride() or p.numel() <= 1 or _sharded([p]):
                continue
            p.grad = torch.empty_like(p, dtype=grad.dtype).copy_(grad)
            swapped.append((p, grad))
    return swapped


# ------------------------------------------------------------------------------ the check on the device (CUDA)

_DEVICE_FLAG_ON_CPU = False  # tests only: CPU tensors take the device path too (CI has no GPU)


def _is_from(optimizer, package: str) -> bool:
    return any(c.__module__.split(".")[0] == package for c in optimizer._hf_eff_base.__mro__)


def _hf_efficient_takes_flag(optimizer) -> bool:
    takes = getattr(optimizer, "takes_found_inf", None)
    return takes is not None and bool(takes())


# The one table of which backends honour ``optimizer.found_inf`` (torch's attribute: a float32 scalar on the device;
# non-zero makes the whole step a no-op, step counts included): ``(backend, is it, does its step take the flag)``,
# first match wins. Where it is taken, the guard checks on the device and reads nothing in step(); elsewhere (and for
# a backend no row names) it keeps the host check.
_FLAG_TABLE = (
    ("bitsandbytes", lambda o: _is_from(o, "bitsandbytes"), lambda o: False),  # its kernels take no flag
    ("torchao", lambda o: _is_from(o, "torchao"), lambda o: False),  # nor do its compiled ones
    # this package's families: their Triton kernels read it (optim/_triton.flag), their compiled torch, C and eager
    # paths do not; a family whose step is about to run Triton kernels for every tensor says so by takes_found_inf()
    ("hf_efficient", lambda o: _is_from(o, "hf_efficient"), _hf_efficient_takes_flag),
    # torch's Adam / AdamW: the fused kernel reads it and takes its step counts back; foreach / for-loop refuse it
    ("torch", lambda o: isinstance(o, torch.optim.Adam), lambda o: all(g.get("fused") for g in o.param_groups)),
)


def _takes_flag(optimizer) -> bool:
    """Whether the backend's step honours ``optimizer.found_inf`` for every tensor (:data:`_FLAG_TABLE`); logs once
    per backend where it does not."""
    for backend, matches, takes in _FLAG_TABLE:
        if matches(optimizer):
            if takes(optimizer):
                return True
            break
    else:
        backend = optimizer._hf_eff_base.__qualname__
    log_once(logging.INFO, ("host check", backend), "hf_efficient: %s's step takes no device-side inf/NaN flag here: "
             "the guard reads its check on the host, one sync per step", backend)
    return False


def _device_check_applies(optimizer, scaled: bool) -> bool:
    """The guard checks on the device: CUDA (or CPU in tests), no GradScaler (it checked already, on the host), no
    DTensor shards (their ranks agree through the host check's all-reduce), and a backend that takes the flag."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    device = params[0].device.type
    return ((device == "cuda" or (device == "cpu" and _DEVICE_FLAG_ON_CPU)) and not scaled and not _sharded(params)
            and _takes_flag(optimizer))


class _VoidRecord:
    """What a step checked on the device under ``nonfinite="raise"`` leaves for the next host read: its flag's copy
    to pinned host memory (queued, with a CUDA event that marks that copy alone as done), and the per-gradient flags
    with their parameters' names, read only to name the parameter when it raises."""

    def __init__(self, found: torch.Tensor, flags: torch.Tensor, names: list[str], step: int):
        cuda = found.device.type == "cuda"
        self.host = torch.empty((), dtype=torch.float32, pin_memory=cuda).copy_(found, non_blocking=cuda)
        self.event = torch.cuda.Event() if cuda else None
        if cuda:
            self.event.record()
        self.flags, self.names, self.step = flags, names, step

    def voided(self) -> bool:
        if self.event is not None:
            self.event.synchronize()  # recorded after an earlier step's check: long done, no stall
        return bool(self.host.numpy() != 0)  # numpy: the host copy, no tensor read


_VOIDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> _VoidRecord of its last step


def _check_on_device(optimizer, info, policy: str) -> torch.Tensor | None:
    """The step's void flag (float32, on the device: torch's ``found_inf``), computed without a host read; None when
    no gradient has an element. Counted in ``info.unread_voids`` (see :func:`read_voided`); under ``"raise"`` a
    :class:`_VoidRecord` is left for the next read."""
    live = [(n, p.grad) for n, p in named_params(optimizer.param_groups)
            if p.grad is not None and not p.grad.is_sparse and p.grad.numel()]
    if not live:
        return None
    flags = _bad_flags([g for _, g in live])
    found = flags.any().float()
    if info.unread_voids is None or info.unread_voids.device != found.device:
        read_voided(info)
        info.unread_voids = torch.zeros((), dtype=torch.float32, device=found.device)
    info.unread_voids.add_(found)
    if policy == "raise":
        _VOIDS[optimizer] = _VoidRecord(found, flags, [n for n, _ in live], info.counted_steps + 1)
    return found


def read_voided(info) -> None:
    """Fold the steps voided on the device since the last read into ``info``'s counts (one device read, made when a
    count is read: see ``OptimizerInfo.steps``); under ``nonfinite="skip"`` they are skipped steps, said once per
    read."""
    unread = info.unread_voids
    if unread is None:
        return
    n = int(unread.item())
    if not n:
        return
    unread.sub_(n)
    info.counted_steps -= n
    if info.options.get("nonfinite") == "skip":
        info.counted_skips += n
        logger.warning("%s: %d step(s) skipped for a non-finite gradient, found on the device (%d skipped so far)",
                       info.resolution.spec.trainer_name, n, info.counted_skips)


def _raise_voided(optimizer, where: str) -> None:
    record = _VOIDS.pop(optimizer, None)
    if record is None or not record.voided():
        return
    info = optimizer.hf_efficient
    read_voided(info)  # the voided step is not counted
    name = record.names[int(record.flags.nonzero()[0])]
    also = "; nor is this step()" if where == "step()" else ""
    raise FloatingPointError(
        f"{info.resolution.spec.trainer_name}: non-finite gradient (inf or NaN, or a value of magnitude >= 2**64 whose "
        f"square overflows) in parameter {name!r} at step {record.step}, found on the device and read at {where}: step "
        f"{record.step} was not applied, nothing was updated by it{also}. Find the cause (learning rate, loss scale, "
        "bad data), or set optim_args='nonfinite=skip' to skip such steps")


def raise_if_voided(optimizer) -> None:
    """Raise now if the last step, checked on the device under ``nonfinite="raise"``, was voided by a non-finite
    gradient (else the next ``step()`` or ``state_dict()`` raises). For where a loop reads values to log them: the
    flag's copy to the host is long done by then, so it does not stall.

    Raises:
        FloatingPointError: naming the parameter and the step, which was not applied.
    """
    from .factory import unwrap  # factory imports this module

    opt = unwrap(optimizer)
    if isinstance(opt, _Protected) and opt.hf_efficient.options.get("nonfinite") == "raise":
        _raise_voided(opt, "raise_if_voided()")


# ---------------------------------------------------------------------------------------- the subclass


class _Protected:
    """Mixed in before the backend's class by :func:`protect`; ``self.hf_efficient`` is the OptimizerInfo."""

    _hf_eff_base: type

    def step(self, closure=None):
        info = self.hf_efficient
        loss = run_closure(closure)  # gradients exist only after the closure: run it, then check
        policy = info.options.get("nonfinite", "ignore")
        found = None  # the flag, where the check runs on the device
        if policy == "raise":
            _raise_voided(self, "step()")  # the last step, if it was checked on the device
        if policy != "ignore":
            scaled = _under_scaler()
            if _device_check_applies(self, scaled):
                found = _check_on_device(self, info, policy)
                hooks = _HOOKS.get(self)
                if hooks is not None:  # CPU in tests: the backward scans go unused
                    hooks.settle(0)
            elif self._host_check(info, policy, scaled):
                return loss
        swapped = _in_param_layout(self)
        if found is not None:
            self.found_inf = found
        try:
            out = super().step()
        finally:
            if found is not None:
                del self.found_inf
            for p, grad in swapped:
                p.grad = grad
        info.counted_steps += 1  # a step voided on the device is taken back when read (read_voided)
        return loss if closure is not None else out

    step.hooked = True  # torch's step hooks already wrap the backend's step, which this calls: not twice

    def _host_check(self, info, policy: str, scaled: bool) -> bool:
        """The check read on the host: raises under ``"raise"``; True where ``"skip"`` skips this step."""
        bad, used = _find_nonfinite(self, trust_hooks=not scaled)
        hooks = _HOOKS.get(self)
        if hooks is not None:
            hooks.settle(used)
        if bad is None:
            return False
        spec = info.resolution.spec
        if policy == "raise":
            raise FloatingPointError(
                f"{spec.trainer_name}: non-finite gradient (inf or NaN, or a value of magnitude >= 2**64 "
                f"whose square overflows) in parameter {bad!r} at step {info.steps + 1}; nothing was updated. "
                "Find the cause (learning rate, loss scale, bad data), or set optim_args='nonfinite=skip' to "
                "skip such steps")
        info.skipped_steps += 1
        logger.warning("%s: step %d skipped, non-finite gradient in %r (%d skipped so far)",
                       spec.trainer_name, info.steps + 1, bad, info.skipped_steps)
        return True

    def add_param_group(self, group: dict) -> None:
        info = getattr(self, "hf_efficient", None)
        if info is None:  # during the backend's own __init__, before protect() finished
            return super().add_param_group(group)
        spec = info.resolution.spec
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"{spec.trainer_name}.add_param_group takes a dict with a 'params' list, got {group!r}")
        params = [group["params"]] if torch.is_tensor(group["params"]) else list(group["params"])
        if not params:
            raise ValueError(f"{spec.trainer_name}.add_param_group got a group with no parameters")
        merged = {**self.defaults, **group}
        check_hyperparams(lr=merged.get("lr", 0.0), betas=merged.get("betas") if spec.uses_betas else None,
                          eps=merged.get("eps") if spec.uses_betas and spec.facts.uses_eps else None,
                          weight_decay=merged.get("weight_decay", 0.0))
        check_flags(merged, self.defaults, spec.trainer_name)
        gi = len(self.param_groups)
        names = group_names(group, gi, len(params))
        device = next(p.device for g in self.param_groups for p in g["params"])
        check_params(zip(names, params), spec, device)
        check_unique(((f"parameter {n!r}", p) for n, p in zip(names, params)),
                     [(f"parameter {n!r}", p) for n, p in named_params(self.param_groups)], spec.trainer_name)
        named = all("param_names" in g for g in self.param_groups)  # torch: all groups named, or none
        super().add_param_group(dict(group, params=params, **({"param_names": names} if named else {})))
        hooks = _HOOKS.get(self)
        if hooks is not None:
            hooks.sync(p for g in self.param_groups for p in g["params"])

    def state_dict(self) -> dict:
        info = self.hf_efficient
        if info.options.get("nonfinite") == "raise":
            _raise_voided(self, "state_dict()")  # no checkpoint taken past a voided step unsaid
        return checkpoint.save(super().state_dict(), info.resolution.spec, info.resolution.backend, info)

    def load_state_dict(self, state_dict: dict) -> None:
        # torch's parameter name: torch.distributed.checkpoint's set_optimizer_state_dict passes it by keyword
        info = self.hf_efficient
        checkpoint.load(self, super().load_state_dict, state_dict, info.resolution.spec, info.resolution.backend,
                        info, _names(self))
        _VOIDS.pop(self, None)  # a step voided before the state was replaced is no longer this run's

    def __reduce_ex__(self, protocol):
        """Copies (deepcopy, pickle, torch.save) rebuild a protected optimizer of the same backend class."""
        # The state travels as our canonical state dict (plain tensors: torchao's tensor subclasses cannot be
        # copied) and is loaded back through load_state_dict, as a resume would.
        attrs = {k: v for k, v in self.__dict__.items() if not k.startswith("_optimizer_") and k != "hf_efficient"}
        attrs["state"] = defaultdict(dict)
        params = [p for g in self.param_groups for p in g["params"]]
        fp32 = attrs.pop("_fp32_ids", None)  # ids do not survive a copy: positions do
        positions = None if fp32 is None else [i for i, p in enumerate(params) if id(p) in fp32]
        return _rebuild, (self._hf_eff_base, attrs, self.hf_efficient, positions, self.state_dict())


def _rebuild(base: type, attrs: dict, info, fp32_positions, state_dict: dict):
    optimizer = base.__new__(base)
    optimizer.__setstate__(attrs)
    if fp32_positions is not None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        optimizer._fp32_ids = {id(params[i]) for i in fp32_positions}
    protect(optimizer, info)
    optimizer.load_state_dict(state_dict)
    return optimizer


_CLASSES: dict[type, type] = {}
_CLASSES_LOCK = threading.Lock()


def _protected_class(base: type) -> type:
    with _CLASSES_LOCK:
        if base not in _CLASSES:
            # same name and module as the backend's class: isinstance, repr and logs read as before
            _CLASSES[base] = type(base.__name__, (_Protected, base), {
                "_hf_eff_base": base, "__module__": base.__module__, "__qualname__": base.__qualname__})
        return _CLASSES[base]


def protect(optimizer, info) -> None:
    """Make ``optimizer`` behave as the module docstring says; ``info`` becomes ``optimizer.hf_efficient``."""
    if not isinstance(optimizer, _Protected):
        optimizer.__class__ = _protected_class(type(optimizer))
        # A GradScaler must unscale, check and skip for us: with this flag (torch's fused kernels set it) it would hand
        # the scaled gradients to step() and leave the overflow check to the kernel, past our guard.
        optimizer._step_supports_amp_scaling = False
    optimizer.hf_efficient = info
    _scan_in_backward(optimizer, info)
