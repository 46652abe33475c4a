"""Protections installed on every optimizer :func:`create_optimizer` builds, whatever its backend.

- ``nonfinite``: a gradient holding an inf or NaN, or a finite value whose square overflows fp32 (``|g| >= 2**64``,
  which would make the second moment inf), is found before the step touches any state. One such value poisons a
  whole block's scale of quantized state forever, so the default is ``"raise"``; ``"skip"`` skips the step for
  all parameters and counts it; ``"ignore"`` is torch's behaviour.
- On CUDA, with no host synchronisation, where the backend honours torch's ``optimizer.found_inf`` (the one table
  :data:`~hf_efficient.nonfinite._FLAG_TABLE`: torch's fused AdamW, and this package's families whose step runs their
  Triton kernels, which they declare by a ``takes_found_inf()`` method, True for the step about to run): the step's
  gradients are checked on the device (the Triton scan of ``optim/nonfinite_triton.py``, one launch per gradient
  dtype; torch's multi-tensor inf-norm where Triton is missing), into a float32 flag set as
  ``optimizer.found_inf`` for the backend's step (unset after), which then updates nothing, step counts included.
  Nothing is read in ``step()``. ``"skip"``: the step is voided; ``steps`` / ``skipped_steps`` of
  ``optimizer_info(opt)`` read the device's count when read (a warning then says how many were skipped).
  ``"raise"``: the step is voided, and the error is raised when the flag is next read on the host: at the next
  ``step()`` (before it launches anything: that step is not applied either), at ``state_dict()``, or at
  :func:`raise_if_voided` (where a training loop logs values); it names the first bad parameter and says that the
  step was not applied. The flag's copy to the host is waited for alone, so these reads do not stall. Backends that
  cannot take the flag (bitsandbytes, torchao, this package's compiled torch / C / eager paths), a GradScaler's step
  and DTensor shards keep the host check below: one host sync per step.
- Where the host check runs: on CPU the gradients are scanned in backward, as it completes each one, and ``step()``
  scans what no scan vouches for (see :mod:`hf_efficient.nonfinite`, which finds bad gradients for this module).
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
import weakref
from collections import defaultdict

import torch

from . import checkpoint, nonfinite
from .optim import _sharded
from .info import unwrap
from .options import check_flags, check_hyperparams, check_unique, run_closure
from .param_groups import group_names, named_params

__all__ = ["protect", "check_params", "raise_if_voided", "void_later", "backend_class", "grads_in_param_layout"]

logger = logging.getLogger(__name__)


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


def _under_scaler() -> bool:
    """Whether a loss scaler (torch's GradScaler, its subclasses) called this step: it unscaled the gradients in place
    with an op that does not advance their versions (``torch._amp_foreach_non_finite_check_and_unscale_``), so the
    backward scans no longer describe them. Found on the stack (scaler.step -> _maybe_opt_step -> LR scheduler's
    wrapper -> step): a frame count, cheap beside a step."""
    frame = sys._getframe(1).f_back  # the caller of step()
    for _ in range(8):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "_maybe_opt_step" or "Scaler" in getattr(code, "co_qualname", ""):
            return True
        frame = frame.f_back
    return False


def grads_in_param_layout(optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Give every gradient whose strides differ from its parameter's a copy in the parameter's layout (some backends
    read a gradient with its parameter's strides); return ``(param, original grad)`` pairs to put back after the
    step. DTensor shards are left as they are."""
    swapped = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            grad = p.grad
            if (grad is None or grad.is_sparse or grad.stride() == p.stride() or p.numel() <= 1
                    or hasattr(p, "to_local")):  # a DTensor shard: its local tensor has its own layout
                continue
            p.grad = torch.empty_like(p, dtype=grad.dtype).copy_(grad)
            swapped.append((p, grad))
    return swapped


def backend_class(optimizer) -> type | None:
    """The backend's own class of an optimizer the guard protects (its class is a subclass of it), else None."""
    return getattr(type(optimizer), "_hf_eff_base", None) if isinstance(optimizer, _Protected) else None


class _VoidRecord:
    """What a step checked on the device under ``nonfinite="raise"`` leaves for the next host read: its flag's copy
    to pinned host memory (queued, with a CUDA event that marks that copy alone as done), and the per-gradient flags
    with their parameters' names, read only to name the parameter when it raises."""

    def __init__(self, found: torch.Tensor, flags: torch.Tensor, names: list[str], step: int, voided: str = ""):
        cuda = found.device.type == "cuda"
        self.host = torch.empty((), dtype=torch.float32, pin_memory=cuda).copy_(found, non_blocking=cuda)
        self.event = torch.cuda.Event() if cuda else None
        if cuda:
            self.event.record()
        self.flags, self.names, self.step = flags, names, step
        self.what = voided or f"step {step} was not applied, nothing was updated by it"

    def voided(self) -> bool:
        if self.event is not None:
            self.event.synchronize()  # recorded after an earlier step's check: long done, no stall
        return bool(self.host.numpy() != 0)  # numpy: the host copy, no tensor read


_VOIDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> _VoidRecord of its last step


def _check_on_device(optimizer, info, policy: str) -> torch.Tensor | None:
    """The step's void flag (float32, on the device: torch's ``found_inf``), computed without a host read; None when
    no gradient has an element. Counted in ``info`` (see ``OptimizerInfo.read_voided``); under ``"raise"`` a
    :class:`_VoidRecord` is left for the next read."""
    checked = nonfinite.flag_on_device(optimizer)
    if checked is None:
        return None
    found, flags, names = checked
    info.count_voids(found)
    if policy == "raise":
        _VOIDS[optimizer] = _VoidRecord(found, flags, names, info.counted_steps + 1)
    return found


def _raise_voided(optimizer, where: str) -> None:
    record = _VOIDS.pop(optimizer, None)
    if record is None or not record.voided():
        return
    info = optimizer.hf_efficient
    info.read_voided()  # the voided step is not counted
    name = record.names[int(record.flags.nonzero()[0])]
    also = "; nor is this step()" if where == "step()" else ""
    raise FloatingPointError(
        f"{info.resolution.spec.trainer_name}: non-finite gradient (inf or NaN, or a value of magnitude >= 2**64 whose "
        f"square overflows) in parameter {name!r} at step {record.step}, found on the device and read at {where}: "
        f"{record.what}{also}. Find the cause (learning rate, loss scale, bad data), or set "
        "optim_args='nonfinite=skip' to skip such steps")


def void_later(optimizer, found: torch.Tensor, flags: torch.Tensor, names: list[str], voided: str) -> None:
    """Leave a device-side check made outside ``step()`` (gradient release's buckets, under ``nonfinite="raise"``)
    for the next host read, as the device path's own: the next ``step()``, ``state_dict()`` or
    :func:`raise_if_voided` raises if ``found`` is set, naming the parameter whose ``flags`` entry is, and saying
    ``voided`` (what was not applied). Call it where the check's work is queued; it reads nothing."""
    info = optimizer.hf_efficient
    _VOIDS[optimizer] = _VoidRecord(found, flags, names, info.counted_steps + 1, voided)


def raise_if_voided(optimizer, *, where: str = "raise_if_voided()") -> None:
    """Raise now if the last step, checked on the device under ``nonfinite="raise"``, was voided by a non-finite
    gradient (else the next ``step()`` or ``state_dict()`` raises). For where a loop reads values to log them: the
    flag's copy to the host is long done by then, so it does not stall. ``where``: named in the message (gradient
    release reads it at the next backward).

    Raises:
        FloatingPointError: naming the parameter and the step, which was not applied.
    """
    opt = unwrap(optimizer)
    if isinstance(opt, _Protected) and opt.hf_efficient.options.get("nonfinite") == "raise":
        _raise_voided(opt, where)


# ---------------------------------------------------------------------------------------- the subclass


class _Protected:
    """Mixed in before the backend's class by :func:`protect`; ``self.hf_efficient`` is the OptimizerInfo."""

    _hf_eff_base: type

    def step(self, closure=None):
        info = self.hf_efficient
        loss = run_closure(closure)  # gradients exist only after the closure: run it, then check
        _sharded.check_grads_agree(self.param_groups, info.resolution.spec.trainer_name)
        policy = info.options.get("nonfinite", "ignore")
        found = None  # the flag, where the check runs on the device
        if policy == "raise":
            _raise_voided(self, "step()")  # the last step, if it was checked on the device
        if policy != "ignore":
            scaled = _under_scaler()
            if nonfinite.checks_on_device(self, self._hf_eff_base, scaled):
                found = _check_on_device(self, info, policy)
            elif self._host_check(info, policy, scaled):
                return loss
        swapped = grads_in_param_layout(self)
        if found is not None:
            self.found_inf = found
        try:
            out = super().step()
        finally:
            if found is not None:
                del self.found_inf
            for p, grad in swapped:
                p.grad = grad
        info.counted_steps += 1  # a step voided on the device is taken back when read (OptimizerInfo.read_voided)
        return loss if closure is not None else out

    step.hooked = True  # torch's step hooks already wrap the backend's step, which this calls: not twice

    def _host_check(self, info, policy: str, scaled: bool) -> bool:
        """The check read on the host: raises under ``"raise"``; True where ``"skip"`` skips this step."""
        bad = nonfinite.check_on_host(self, trust_hooks=not scaled)
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
        nonfinite.follow_params(self)

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
    nonfinite.watch(optimizer, info.options.get("nonfinite", "ignore") != "ignore")
