"""Gradient release: each parameter is stepped inside backward, the moment its gradient is complete, and its gradient
is freed at once, so training holds one gradient at a time instead of all of them (4 bytes per parameter in fp32).

``attach(optimizer)`` registers a ``register_post_accumulate_grad_hook`` on every parameter of an optimizer made by
:func:`hf_efficient.create_optimizer` (any name, any backend). Completed gradients are stepped by the optimizer's own
step while they are the only ones holding a gradient, then set to None. The step therefore goes through the very code
of the ordinary step, with the param groups untouched: each parameter's decay group, its current ``lr`` (LR schedulers
keep working), its state and 8-bit codec, its compensation and its stochastic-rounding stream (AdamWBF16 keys it by
the parameter's position), and bitsandbytes' per-index configs (32-bit embeddings) all see exactly what the ordinary
step sees. The update is elementwise, so it equals the ordinary step bit for bit (tests/test_release.py checks each
backend). A tied weight has one ``AccumulateGrad`` node: its hook fires once per backward, after all uses.

Buckets: completed gradients wait until ``bucket_bytes`` (4 MiB; on CUDA 1/32 of the gradients where more:
:func:`default_bucket_bytes`) of them are pending, or the backward ends, and are stepped in one call; so at most
``bucket_bytes`` plus one tensor of gradients are alive (``bucket_bytes=0``: one tensor at a time): a bucket pays a
call's fixed cost (Python, dispatch, launches) once for many tensors. This package's C
kernels run on torch's own OpenMP threads (the libgomp torch loaded), so a call between backward's ops wakes no second
thread pool; MiniLM's step times with either setting: docs/results/memory_release.md.

inf/NaN check (``nonfinite``): on CPU each tensor is checked the moment its gradient completes, by the guard's scan in
backward (its C scan, and its rule for a scan that stalled) where the guard hooked the optimizer (C compiler), else by
torch's check (the C scans cost a fraction of torch's check per backward: docs/results/memory_release.md).

inf/NaN on CUDA: a check per tensor would cost a launch and a host read per tensor, so a bucket is checked when it is
stepped (:func:`.nonfinite.checked_per_bucket`). Where the backend's step takes the guard's device flag (its Triton
kernels, ``takes_found_inf()``; torch's fused AdamW): the Triton scan of the bucket (one launch per gradient dtype,
over a pointer table kept per bucket) leaves a flag on the device that the bucket's step call takes as
``optimizer.found_inf``; nothing is read on the host in backward or ``step()``. The unit that a bad gradient voids is
then the bucket (``bucket_bytes=0``: the tensor, as on CPU): ``skip``: its bucket is not stepped (weights, state, step
counts), the other buckets are; the tensors are counted, and said in one warning, when :func:`release_info` is read or
at a later backward's first hook once the count's copy to the host is done (``optimizer_info(opt).skipped_steps``
includes them from then on). ``raise``: the bucket holding it and every later bucket of that backward are not
stepped (the flag stays set for the backward); backward and ``step()`` do not raise: the FloatingPointError comes at
the next host read of the flag: the next backward's first hook (which then steps nothing), ``state_dict()`` or
:func:`.guard.raise_if_voided`; that read waits for the flag's own copy, queued at the end of the step before.
Where the backend takes no flag (bitsandbytes, torchao): one host read per bucket, and each bad tensor as on CPU
(``raise`` raises at the end of its bucket: the tensors completed before it are stepped, it and the later ones not).

``optimizer.step()`` and ``zero_grad()`` keep working: no parameter holds a gradient when they run, so the step finds
nothing to update and the guard still counts one step per ``step()`` call (``optimizer.hf_efficient.steps``); the
Trainer's loop, an Accelerate loop and a user's loop run unchanged. Torch's step hooks run once per ``step()`` call,
not per tensor. ``optimizer.zero_grad(set_to_none=False)`` keeps zero gradients in the ordinary loop, and its step
moves the parameters no backward reached since (momentum, weight decay, step count): release steps those with zeros
at ``step()``, so it equals the ordinary step there too (``model.zero_grad(set_to_none=False)`` cannot be seen: with
it, a parameter is stepped only by a backward that reaches it). ``add_param_group`` hooks the new parameters.
``detach(optimizer)`` removes the hooks. While attached, the optimizer's class is a subclass of its own (same name) that
sees ``zero_grad`` and ``add_param_group``; a copy (``copy.deepcopy``, ``pickle``) is not attached; ``state_dict()`` /
``load_state_dict`` are the optimizer's own, so a resume is exact.

Decided, and refused or checked where it cannot hold (never silent):

- Gradient accumulation (the Trainer's or Accelerate's ``gradient_accumulation_steps > 1``) would need every gradient
  kept across micro-batches: refused by :func:`check_trainer_args` / :func:`check_accelerate`. A larger per-device
  batch is the same math. In a hand-written loop, every ``backward()`` is an optimizer step: a second backward before
  ``step()`` (``retain_graph=True``, summed micro-batches) is refused at its first hook, before it steps anything, so
  each ``step()`` stays one step of the optimizer and of its state.
- Clipping by the global norm needs every gradient before the first step: refused (``max_grad_norm`` must be 0). The
  Trainer would otherwise "clip" gradients that are already None, i.e. not clip at all. In a hand-written loop,
  ``clip_grad_norm_`` after ``backward()`` finds no gradients and returns 0: do not call it.
- inf/NaN (``nonfinite``, :mod:`hf_efficient.guard`), decided per tensor (on CUDA per bucket where the check stays on
  the device: see above), in the order backward completes them:
  ``raise``: the tensors completed earlier in this backward were stepped; the bad one and every later one were not
  (the FloatingPointError stops the backward; the bad gradient stays in ``.grad`` for inspection, and the next
  backward refuses to start stepping until ``zero_grad()`` cleared it). ``skip``: that tensor is not stepped (its
  gradient is dropped, its state untouched), the others are; ``info.skipped_steps`` counts the backward passes in
  which some tensor was skipped, :func:`release_info` the tensors, and one warning per backward names them.
- fp16 with a GradScaler: the scaler unscales and skips at ``step()``, after the release already stepped scaled
  gradients: refused by the checks, and in a hand-written loop at the first hook of a backward whose loss is a product
  while an enabled GradScaler is alive (before anything is stepped). bf16 autocast and bf16 weights need no scaler.
- Distributed (DDP, FSDP, DeepSpeed): the hooks would see local gradients before their reduction: refused by the
  checks, by :func:`attach` and at each backward's first hook when a process group of more than one process is up or a
  parameter is a DTensor. DistributedDataParallel in any number of processes (one too: ``torchrun --nproc-per-node
  1``): its reducer writes the reduced gradients back when backward ends, after the hooks stepped and freed them, so
  ``step()`` would step them again: refused at the first backward after :func:`attach` that finds a process group up
  (before anything is stepped); a gradient written back later anyway (a DDP made after that) is refused at ``step()``,
  which then drops it and steps nothing.
- Reentrant activation checkpointing (``use_reentrant=True``) runs one nested backward per segment, each adding to a
  weight's gradient once per segment that uses it: no hook can tell when a gradient is complete. Refused by the
  Trainer check, on each transformers version's default (4.x: reentrant; 5.x: not), and in any loop at the first hook
  of a nested backward (a Python autograd Function's backward on the stack): the segments' tensors are not stepped,
  those completed outside them may have been (a full bucket). ``use_reentrant=False`` is one backward, and fine.
- A backward refused at its first hook drops the gradients it produced, so neither ``step()`` nor the next backward
  applies them.
- A parameter that did not require a gradient when ``attach`` ran has no hook: if it gets one later, the next backward
  refuses to start and drops what it produced (call ``attach`` again after unfreezing it; it works at once). Gradients
  present at ``attach`` are refused; a gradient present at a backward's start (set by hand, left by a backward that
  raised) refuses that backward, which drops its own gradients and leaves that one for ``zero_grad()``.
"""

from __future__ import annotations

import gc
import importlib.metadata
import logging
import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch.autograd import Variable

from . import guard, nonfinite
from .info import unwrap
from .param_groups import named_params

__all__ = ["attach", "detach", "is_attached", "release_info", "ReleaseInfo", "check_trainer_args",
           "check_accelerate", "BUCKET_BYTES", "default_bucket_bytes"]

logger = logging.getLogger(__name__)

_WHY_ACCUMULATION = ("gradient_release steps each tensor inside backward and frees its gradient, so gradients cannot "
                     "be summed over micro-batches")
_OFF = "or turn gradient_release off (optim_args 'gradient_release=false', HF_EFF_GRADIENT_RELEASE=0)"


@dataclass
class ReleaseInfo:
    """Counters of an attached optimizer (see :func:`release_info`)."""

    params: int  # parameters with a release hook
    stepped_tensors: int = 0  # tensors stepped inside backward since attach
    skipped_tensors: int = 0  # tensors skipped for a non-finite gradient under nonfinite="skip"
    frozen: list[str] = field(default_factory=list)  # parameters without a hook (no requires_grad at attach)


_ATTACHED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> _Release; no attribute: copies
# of the optimizer (deepcopy, pickle) carry no hooks, and are not attached


def is_attached(optimizer) -> bool:
    return unwrap(optimizer) in _ATTACHED


def release_info(optimizer) -> ReleaseInfo | None:
    """The counters of an attached optimizer, else None. Tensors voided on the device (CUDA, ``nonfinite="skip"``)
    are counted here, or at the next backward, not before."""
    opt = unwrap(optimizer)
    rel = _ATTACHED.get(opt)
    if rel is None:
        return None
    rel._fold(opt)  # counts of the last backward checked on the device (one wait for their copy, long done)
    return rel.info


def _raw_step(cls: type):
    """The backend's step without torch's profiling / step-hook wrapper (hooks run once per ``step()`` call)."""
    fn = cls.step
    return fn.__wrapped__ if getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__") else fn


BUCKET_BYTES = 4 << 20
MAX_BUCKETS = 32  # on CUDA: a backward's buckets at most, by default (each bucket is a step call)


def default_bucket_bytes(params) -> int:
    """The bucket size when the caller names none: :data:`BUCKET_BYTES` on CPU; on CUDA the larger of that and
    1/:data:`MAX_BUCKETS` of the gradients' bytes. Each bucket is a step call whose host cost (Python, launches)
    grows with the optimizer's parameters, not the bucket's; a 1B model of 8 MiB matrices would otherwise step one
    tensor per call (~150 calls per backward), and the host, not the GPU, would set the pace. At most 1/32 of the
    gradients is then alive at once (~3% of what release frees)."""
    params = [p for p in params if p.requires_grad]
    if not any(p.device.type == "cuda" for p in params):
        return BUCKET_BYTES
    return max(BUCKET_BYTES, sum(p.numel() * p.element_size() for p in params) // MAX_BUCKETS)


def attach(optimizer, *, bucket_bytes: int | None = None) -> None:
    """Step every parameter of ``optimizer`` inside backward and free its gradient (see the module docstring).

    Calling it again on an attached optimizer adds hooks for parameters that require a gradient since (unfrozen).

    Args:
        optimizer: made by :func:`hf_efficient.create_optimizer` (or Accelerate's wrapper of one).
        bucket_bytes: completed gradients wait until this many bytes are pending (or the backward ends), then are
            stepped in one call: a few large kernel calls instead of one per tensor (see the module docstring).
            0: each tensor alone, one gradient alive at a time. None: :func:`default_bucket_bytes` (4 MiB on CPU;
            on CUDA 1/32 of the gradients' bytes where that is more), decided at each backward's start (where the
            parameters are then: Accelerate's ``prepare`` moves them after the optimizer is made).

    Raises:
        TypeError: another optimizer. RuntimeError: a parameter already holds a gradient, more than one process,
        or DTensor (sharded) parameters. Nothing is attached then.
    """
    opt = unwrap(optimizer)
    if guard.backend_class(opt) is None:
        raise TypeError(f"gradient release attaches to an optimizer made by hf_efficient.create_optimizer (or the "
                        f"Trainer with an hf_eff_* optim), got {type(optimizer).__name__}: its step is what each "
                        "hook runs, with the inf/NaN policy of hf_efficient.guard")
    named = named_params(opt.param_groups)
    _refuse_distributed(named)
    holding = [n for n, p in named if p.grad is not None]
    if holding:
        raise RuntimeError(f"gradient release: parameters {holding[:3]} already hold gradients; released, they would "
                           "be stepped at the next backward together with its gradients. Call "
                           "optimizer.zero_grad(set_to_none=True) before attach")
    if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool)
                                     or bucket_bytes < 0):
        raise ValueError(f"bucket_bytes={bucket_bytes!r}: expected an int >= 0 (bytes of gradients stepped together; "
                         "0 steps each tensor alone; None: the default)")
    rel = _ATTACHED.get(opt)
    if rel is None:
        rel = _ATTACHED[opt] = _Release(opt, bucket_bytes)
        opt.__class__ = _attached_class(type(opt))
        nonfinite.defer_scans(opt, True)  # each tensor is checked here, in the release's hook
    rel.bucket_bytes = bucket_bytes
    rel.check_ddp = True
    rel.hook(named)


def detach(optimizer) -> None:
    """Remove the hooks: backward keeps gradients again and ``step()`` steps them. A no-op if not attached."""
    opt = unwrap(optimizer)
    rel = _ATTACHED.pop(opt, None)
    if rel is not None:
        rel._leave_record(opt)
        rel._fold(opt)
        rel.remove()
        opt.__class__ = type(opt).__bases__[1]  # the class before attach (see _attached_class)
        nonfinite.defer_scans(opt, False)


def _refuse_distributed(named) -> None:
    sharded = [n for n, p in named if hasattr(p, "to_local")]
    if sharded:
        raise RuntimeError(f"gradient release: parameter {sharded[0]!r} is a DTensor (FSDP2 / tensor parallel): its "
                           "hook would step a gradient before it is reduced across processes. Train without "
                           "gradient_release under FSDP")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(f"gradient release runs in one process: this one is in a group of "
                           f"{dist.get_world_size()}, where each hook would step a local gradient before DDP / "
                           "DeepSpeed reduce it, and the replicas would diverge. Launch one process, "
                           + _OFF)


def _group_up() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _refuse_ddp(named) -> None:
    """Refuse a live DistributedDataParallel over these parameters, whatever its number of processes: its reducer
    writes the reduced gradients back when backward ends, after the hooks stepped and freed them (step() would step
    them again), and with more than one process the hooks would step local gradients."""
    from torch.nn.parallel import DistributedDataParallel

    ids = {id(p) for _, p in named}
    for ddp in _live(DistributedDataParallel):
        if any(id(q) in ids for q in ddp.module.parameters()):
            raise RuntimeError(
                "gradient release cannot run under DistributedDataParallel (here over a process group of "
                f"{ddp.process_group.size()}): DDP reduces the gradients in its own hooks and writes them back when "
                "backward ends, after release stepped and freed them, so step() would step every tensor again; "
                "nothing of this backward was stepped. Train the unwrapped model (one process needs no DDP), " + _OFF)


class _Attached:
    """Mixed in before the optimizer's class while it is attached (see :func:`_attached_class`): release must see
    ``zero_grad(set_to_none=False)`` (it keeps zero gradients that ``step()`` steps) and hook the parameters of a
    group added later. A class, like the guard's, so that copies (rebuilt from the backend's class) are not attached.
    """

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        rel = _ATTACHED.get(self)
        if rel is not None:
            rel.zeroed(set_to_none)

    def add_param_group(self, group: dict) -> None:
        super().add_param_group(group)  # the guard validates it first
        rel = _ATTACHED.get(self)
        if rel is not None:
            rel.hook(named_params(self.param_groups))


_CLASSES: dict[type, type] = {}


def _attached_class(cls: type) -> type:
    if cls not in _CLASSES:  # same name and module: isinstance, repr and logs read as before
        _CLASSES[cls] = type(cls.__name__, (_Attached, cls), {"__module__": cls.__module__,
                                                              "__qualname__": cls.__qualname__})
    return _CLASSES[cls]


class _Release:
    """The hooks of one optimizer, and the per-backward bookkeeping (a window per autograd graph task)."""

    def __init__(self, opt, bucket_bytes: int | None):
        self.ref = weakref.ref(opt)
        self.bucket_bytes = bucket_bytes  # None: default_bucket_bytes, decided per backward (self.limit)
        self.limit = BUCKET_BYTES
        self.pending: list[torch.Tensor] = []  # completed gradients waiting for the bucket to fill
        self.pending_bytes = 0
        self.backend = guard.backend_class(opt)
        self.step = _raw_step(self.backend)
        self.handles: dict[int, torch.utils.hooks.RemovableHandle] = {}
        self.names: dict[int, str] = {}
        self.info = ReleaseInfo(params=0)
        self.task = None  # graph task id of the backward in progress (the open window)
        self.stepped = 0
        self.skipped: list[str] = []
        # What the ordinary loop would hold in .grad (ids): a gradient since the last zero_grad(set_to_none=True),
        # and, of those, zeros (zero_grad(set_to_none=False), no backward reached them since): step() steps these.
        self.held: set[int] = set()
        self.zeros: set[int] = set()
        self.backward_done = False  # a backward completed since the last step(): a second one is refused
        self.warned_zero = False
        self.check_scaler = True  # until a backward whose loss is a product found no GradScaler (see _open)
        self.check_ddp = True  # until a backward with a process group up found no DistributedDataParallel (_open)
        self.released: set[int] = set()  # ids stepped inside backward since the last step() (see _on_step)
        # The buckets' checks on the device (see "inf/NaN on CUDA" in the module docstring): per bucket checked there
        # (kernel flag, per-gradient flags, names, tensors), the sticky flag under "raise", the scan's pointer tables
        # per bucket (kept between steps: a bucket is the same tensors each step), and the counts left for a read.
        self.checks: list[tuple] = []
        self.void: torch.Tensor | None = None
        self.tables: dict[tuple, dict] = {}
        self.unread: list[tuple] = []
        # torch's step hooks run once per step() call (not for the release's own steps: see _raw_step)
        self.step_hook = opt.register_step_pre_hook(lambda opt, args, kwargs: self._on_step(opt))
        weakref.finalize(opt, _remove_handles, self.handles)  # a dead optimizer leaves no hooks behind

    def hook(self, named) -> None:
        self.info.frozen = []
        for name, p in named:
            self.names[id(p)] = name
            if id(p) in self.handles:
                continue
            if not p.requires_grad:
                self.info.frozen.append(name)
                continue
            self.handles[id(p)] = p.register_post_accumulate_grad_hook(self._on_grad)
        self.info.params = len(self.handles)

    def remove(self) -> None:
        _remove_handles(self.handles)
        self.step_hook.remove()

    # -- per backward ------------------------------------------------------------------------------------------

    def _open(self, opt, p) -> None:
        """First hook of a backward (of each autograd graph task): refuse, before this backward steps anything, what
        release cannot step as the ordinary step would; then open its window, closed at the backward's end."""
        self._leave_record(opt)  # a backward that raised before step(): its buckets' checks
        try:
            guard.raise_if_voided(opt, where="the next backward")  # "raise" on the device: the last one's flag
        except FloatingPointError:
            self._drop(p)
            raise
        self._fold(opt, wait=False)
        named = named_params(opt.param_groups)
        try:
            _refuse_distributed(named)  # a process group started since attach
            if self.check_ddp and _group_up():
                self.check_ddp = False  # one pass over gc's objects; a DDP made later is caught at step()
                _refuse_ddp(named)
        except RuntimeError:
            self._drop(p)
            raise
        self.limit = self.bucket_bytes if self.bucket_bytes is not None else default_bucket_bytes(
            q for _, q in named)
        nested, roots = _backward_context()
        if nested:
            self._drop(p)
            raise RuntimeError(
                "gradient release cannot run under a reentrant backward (torch.utils.checkpoint.checkpoint(..., "
                "use_reentrant=True), or model.gradient_checkpointing_enable() on transformers < 5, whose default it "
                "is): each checkpointed segment runs a backward of its own, which adds to a weight's gradient once per "
                "segment using it, so no hook can tell when a gradient is complete. "
                f"{self.stepped if self.task is not None else 0} tensor(s) completed outside the segments were stepped "
                "in this backward, no other. Pass use_reentrant=False (gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False})), " + _OFF)
        if self.backward_done:
            self._drop(p)
            raise RuntimeError(
                "gradient release: a second backward() before optimizer.step(). Each backward steps the weights, so "
                "two backward passes would be two optimizer steps counted as one, not one step of their summed "
                "gradients. Call optimizer.step() after every backward (zero_grad() clears this one's gradient); for "
                "a larger batch, run one backward on it, " + _OFF)
        if self.check_scaler and _mul_root(roots):
            if _enabled_scaler():
                self._drop(p)
                raise RuntimeError(
                    "gradient release with a torch.amp.GradScaler (scaler.scale(loss).backward()): backward would step "
                    "the weights with the scaled gradients, before scaler.step() could unscale them and skip "
                    "overflowing steps; nothing was stepped. Train in bf16 (torch.autocast(dtype=torch.bfloat16), "
                    "no scaler) or fp32, " + _OFF)
            self.check_scaler = False  # scanned once (it reads every object gc tracks); a loop starts with its scaler
        unhooked = [(name, q) for name, q in named if q.requires_grad and id(q) not in self.handles]
        if unhooked:  # their gradients, if any, come from this backward (no hook to step them): dropped with p's
            self._drop(p, *(q for _, q in unhooked))
            raise RuntimeError(f"gradient release: parameter {unhooked[0][0]!r} requires a gradient but has no "
                               "release hook (it was frozen when attach ran); nothing of this backward was stepped or "
                               "kept. Call hf_efficient.release.attach(optimizer) again after unfreezing parameters, "
                               "then run the backward again")
        stale = [name for name, q in named if q is not p and q.grad is not None]
        if stale:
            self._drop(p)
            raise RuntimeError(
                f"gradient release: parameter {stale[0]!r} holds a gradient from before this backward (set by hand, or "
                "left by an earlier backward that raised); the per-tensor steps would apply it with this backward's, "
                "so nothing of this backward was stepped or kept. Call optimizer.zero_grad(set_to_none=True) before "
                "backward")
        self.task, self.stepped, self.skipped = torch._C._current_graph_task_id(), 0, []
        self.pending, self.pending_bytes = [], 0  # left by a backward that raised: zero_grad() cleared them
        task = self.task
        Variable._execution_engine.queue_callback(lambda: self._close(task))

    def _drop(self, *params) -> None:
        """A refused backward leaves nothing: its gradients so far (``params``', the window's pending ones) are
        dropped, so that neither step() nor the next backward applies them."""
        for q in [*params, *self.pending]:
            q.grad = None
        self.pending, self.pending_bytes = [], 0

    def _close(self, task) -> None:
        if task != self.task:  # a later backward opened its own window already
            return
        self.task = None
        self.backward_done = True
        opt = self.ref()
        if opt is not None:
            self._flush(opt)
        if self.skipped and opt is not None:
            info = opt.hf_efficient
            logger.warning("%s: step %d (gradient release): %d tensor(s) with a non-finite gradient skipped (%s), "
                           "%d stepped; %d tensors skipped so far", info.resolution.spec.trainer_name, info.steps + 1,
                           len(self.skipped), ", ".join(map(repr, self.skipped[:3])), self.stepped,
                           self.info.skipped_tensors)

    def _on_grad(self, p: torch.Tensor) -> None:
        opt = self.ref()
        if opt is None or p.grad is None:
            return
        if self.task != torch._C._current_graph_task_id():
            self._open(opt, p)
        self.held.add(id(p))
        self.zeros.discard(id(p))  # it holds this backward's gradient now, not zeros
        info = opt.hf_efficient
        checked = info.options.get("nonfinite", "ignore") != "ignore" and not p.grad.is_sparse
        if checked and not nonfinite.checked_per_bucket(p.grad) and nonfinite.is_bad(opt, p.grad):
            self._nonfinite(opt, p, info)
            return
        self._add(opt, p)

    def _add(self, opt, p: torch.Tensor) -> None:
        self.pending.append(p)
        self.pending_bytes += p.grad.numel() * p.grad.element_size()
        if self.pending_bytes >= self.limit:
            self._flush(opt)

    # -- per step() and zero_grad() ----------------------------------------------------------------------------

    def zeroed(self, set_to_none: bool) -> None:
        """``optimizer.zero_grad``: the ordinary loop drops its gradients, or keeps them as zeros that step() steps."""
        if self.backward_done and not self.warned_zero:
            self.warned_zero = True
            logger.warning("gradient release: zero_grad() between backward() and step() cannot discard that "
                           "backward's gradients: release stepped them inside backward. Call zero_grad() after step() "
                           "(or before backward)")
        self.zeros = set() if set_to_none else set(self.held)
        if set_to_none:
            self.held = set()

    def _on_step(self, opt) -> None:
        """``step()`` (torch's pre-hook): the next backward may run. The ordinary step would also step the zero
        gradients ``zero_grad(set_to_none=False)`` kept on parameters that no backward reached since (momentum,
        weight decay, step count move): step those with zeros, a bucket at a time, so release equals it."""
        self.backward_done = False
        self.pending, self.pending_bytes = [], 0  # left by a backward that raised; their gradients stay in .grad
        named = named_params(opt.param_groups)
        again = [(name, q) for name, q in named if id(q) in self.released and q.grad is not None]
        self.released = set()
        if again:  # written after the hooks stepped them: the step would apply them a second time
            for _, q in again:
                q.grad = None
            raise RuntimeError(
                f"gradient release: parameter(s) {[n for n, _ in again[:3]]} hold a gradient again after release "
                "stepped them inside backward, written after its hooks (DistributedDataParallel writes its reduced "
                "gradients back when backward ends, in any number of processes); step() would apply them a second "
                "time, so they were dropped and nothing was stepped. Train without DDP: one process needs none, "
                + _OFF)
        for _, q in named:
            if id(q) in self.zeros and q.grad is None:
                q.grad = torch.zeros_like(q)
                self._add(opt, q)
        self._flush(opt)
        self.released = set()  # stepped by this step(), as the ordinary step steps them
        self._leave_record(opt, counted=True)

    def _flush(self, opt) -> None:
        """Step the pending parameters (the only ones holding gradients) in one call of the backend's step, after
        checking them as a bucket where their checks were left to it (:func:`.nonfinite.checked_per_bucket`)."""
        if not self.pending:
            return
        found = None
        if (opt.hf_efficient.options.get("nonfinite", "ignore") != "ignore"
                and nonfinite.checked_per_bucket(self.pending[0].grad)):
            found = self._check_bucket(opt)
        self._step_pending(opt, found)

    def _check_bucket(self, opt) -> torch.Tensor | None:
        """Check the pending gradients together. Where the backend takes the device flag: on the device, no read;
        returns the flag for its step (under "raise" sticky: it voids every later bucket of the backward too).
        Elsewhere: one host read, then each bad tensor as its hook would have had it (:meth:`_nonfinite`)."""
        info = opt.hf_efficient
        grads = [q.grad for q in self.pending]
        if nonfinite.checks_on_device(opt, self.backend, scaled=False):
            live = [i for i, g in enumerate(grads) if g.numel() and not g.is_sparse]
            if not live:
                return None
            bucket = tuple(id(self.pending[i]) for i in live)
            if bucket not in self.tables and len(self.tables) > 2 * len(self.handles):
                self.tables.clear()  # buckets that keep changing (the same every step otherwise): bounded
            found, flags = nonfinite.flag_grads([grads[i] for i in live], self.tables.setdefault(bucket, {}))
            if info.options["nonfinite"] == "raise":
                found = self.void = found if self.void is None else torch.maximum(self.void, found)
            self.checks.append((found, flags, [self.names[i] for i in bucket], len(self.pending)))
            return found
        bad = nonfinite.bad_grads(grads)
        if bad and info.options["nonfinite"] == "raise":
            first = bad[0]
            for q in self.pending[first + 1:]:  # completed after the bad one: not stepped, as if backward stopped there
                q.grad = None
            p, self.pending = self.pending[first], self.pending[:first]
            self._nonfinite(opt, p, info)  # steps the earlier ones, raises
        for i in bad:
            self._nonfinite(opt, self.pending[i], info)
        self.pending = [q for q in self.pending if q.grad is not None]
        return None

    def _step_pending(self, opt, found: torch.Tensor | None = None) -> None:
        """The backend's step over the pending (checked) parameters; ``found``: the device flag it then takes."""
        if self.pending:
            guard.grads_in_param_layout(opt)  # gradients whose strides differ from their parameter's: a copy
            if found is not None:
                opt.found_inf = found
            try:
                with torch.no_grad():
                    self.step(opt)
            finally:
                if found is not None:
                    del opt.found_inf
        for q in self.pending:
            q.grad = None
            self.released.add(id(q))
        self.stepped += len(self.pending)
        self.info.stepped_tensors += len(self.pending)
        self.pending, self.pending_bytes = [], 0

    def _leave_record(self, opt, counted: bool = False) -> None:
        """What this backward's device checks found, for the host to read later (queued copies, nothing read now):
        under "raise" the guard's record (:func:`.guard.void_later`: the next backward's first hook, ``step()``,
        ``state_dict()`` or ``raise_if_voided`` raises), and where ``counted`` (left by the ``step()`` the guard is
        about to count) that step is taken back when the flag is read, as the guard's own device check takes back
        the step it voids; under "skip" the counts :meth:`_fold` reads."""
        checks, void, self.checks, self.void = self.checks, self.void, [], None
        if not checks:
            return
        flags = torch.cat([c[1].reshape(-1).float() for c in checks])
        names = [n for c in checks for n in c[2]]
        info = opt.hf_efficient
        if info.options.get("nonfinite") == "raise":
            guard.void_later(opt, void, flags, names, "under gradient release, the buckets stepped before the one "
                             "holding it were applied; that bucket and every later one of that backward were not "
                             "(nothing updated by them, step counts included)")
            if counted:
                info.count_voids(void)
            return
        found = torch.cat([torch.stack([c[0].reshape(()).float() for c in checks]), flags])
        cuda = found.device.type == "cuda"
        host = torch.empty(found.shape, dtype=torch.float32, pin_memory=cuda).copy_(found, non_blocking=cuda)
        event = torch.cuda.Event() if cuda else None
        if cuda:
            event.record()  # this copy alone is waited for when read: long done by the next backward
        self.unread.append((host, event, [c[3] for c in checks], names, info.counted_steps + 1))

    def _fold(self, opt, wait: bool = True) -> None:
        """Count the tensors that earlier backward passes' voided buckets held (under "skip"), and say so once per
        backward. ``wait=False`` (at a backward's first hook): only the counts whose copy is done, no waiting."""
        while self.unread and (wait or self.unread[0][1] is None or self.unread[0][1].query()):
            self._fold_one(opt, *self.unread.pop(0))

    def _fold_one(self, opt, host, event, sizes, names, step) -> None:
        if event is not None:
            event.synchronize()  # recorded after this copy alone: done when query() said so
        values = host.numpy()  # the pinned host copy, not a device read
        voided = sum(n for v, n in zip(values[:len(sizes)], sizes) if v)
        if not voided:
            return
        bad = [n for n, v in zip(names, values[len(sizes):]) if v]
        info = opt.hf_efficient
        info.counted_skips += 1
        self.info.skipped_tensors += voided
        self.info.stepped_tensors -= voided
        logger.warning("%s: step %d (gradient release): non-finite gradient in %s, found on the device: the %d "
                       "tensor(s) stepped in the same call(s) were not stepped, the others were; %d tensors skipped so "
                       "far",
                       info.resolution.spec.trainer_name, step, ", ".join(map(repr, bad[:3])), voided,
                       self.info.skipped_tensors)

    def _nonfinite(self, opt, p, info) -> None:
        name, spec = self.names[id(p)], info.resolution.spec
        if info.options["nonfinite"] == "raise":
            bad, p.grad = p.grad, None
            self._step_pending(opt)  # the (checked) tensors completed before this one, as the docstring promises
            p.grad = bad
            raise FloatingPointError(
                f"{spec.trainer_name}: non-finite gradient (inf or NaN, or a value of magnitude >= 2**64 whose square "
                f"overflows) in parameter {name!r} at step {info.steps + 1}, under gradient release: the {self.stepped} "
                "tensor(s) completed earlier in this backward were stepped, this one and all later ones were not "
                "(its gradient is left in .grad; call optimizer.zero_grad() before the next backward). Find the cause "
                "(learning rate, bad data), or set optim_args='nonfinite=skip' to skip such tensors")
        p.grad = None
        if not self.skipped:
            info.skipped_steps += 1
        self.skipped.append(name)
        self.info.skipped_tensors += 1


_FUNCTION_BACKWARD = torch.autograd.function.BackwardCFunction.apply.__code__  # a Python Function's backward
_RUN_BACKWARD = getattr(getattr(torch.autograd.graph, "_engine_run_backward", None), "__code__", None)


def _backward_context() -> tuple[bool, list]:
    """Read from the Python stacks, at a backward's first hook: whether it runs nested inside a Python autograd
    Function's backward (reentrant checkpointing starts one backward per segment there), and the root tensors of the
    backward passes in progress (the calling thread's: on CUDA the hooks run on the device's thread)."""
    nested, roots, frame = False, [], sys._getframe(1)
    while frame is not None:
        nested = nested or frame.f_code is _FUNCTION_BACKWARD
        if frame.f_code is _RUN_BACKWARD:
            roots = frame.f_locals.get("t_outputs", ())
        frame = frame.f_back
    if not roots and _RUN_BACKWARD is not None:
        for top in sys._current_frames().values():
            while top is not None:
                if top.f_code is _RUN_BACKWARD:
                    roots = [*roots, *top.f_locals.get("t_outputs", ())]
                top = top.f_back
    return nested, list(roots)


def _mul_root(roots) -> bool:
    """A root is a product, as ``scaler.scale(loss)`` is (its factor, saved by the node, is freed by now)."""
    return any(type(getattr(t, "grad_fn", None)).__name__ == "MulBackward0" for t in roots)


def _enabled_scaler() -> bool:
    """An enabled GradScaler (or subclass) whose scale() ran is alive (:func:`_live`: :meth:`_Release._open` runs it
    once)."""
    return any(r.is_enabled() and getattr(r, "_scale", None) is not None for r in _live(torch.amp.GradScaler))


def _live(base: type) -> list:
    """The live instances of ``base`` and its subclasses. gc finds them by the class they refer to: one pass over the
    objects gc tracks."""
    classes, todo = set(), [base]
    while todo:
        cls = todo.pop()
        classes.add(cls)
        todo.extend(cls.__subclasses__())
    return [r for r in gc.get_referrers(*classes) if isinstance(r, base)]


def _remove_handles(handles: dict) -> None:
    for h in handles.values():
        h.remove()
    handles.clear()


# --------------------------------------------------------------------------------------- settings it cannot hold


def _refuse(problems: list[str], where: str) -> None:
    if problems:
        raise ValueError(f"gradient_release cannot hold with these {where} settings:\n- " + "\n- ".join(problems))


def check_trainer_args(args) -> None:
    """Refuse ``TrainingArguments`` under which gradient release would be wrong (all problems in one ValueError).

    Call where ``gradient_release`` is on, before the model loads (e.g. at the end of ``__post_init__``).
    """
    problems = []
    ga = getattr(args, "gradient_accumulation_steps", 1)
    if ga > 1:
        problems.append(f"gradient_accumulation_steps={ga}: {_WHY_ACCUMULATION}. Set gradient_accumulation_steps=1 "
                        f"(a larger per_device_train_batch_size gives the same batch) {_OFF}")
    norm = getattr(args, "max_grad_norm", 0) or 0
    if norm > 0:
        problems.append(f"max_grad_norm={norm}: clipping by the global norm needs every gradient before the first "
                        "step, and released gradients are gone when the Trainer clips (it would clip nothing). Set "
                        f"max_grad_norm=0 (no clipping) {_OFF}")
    if getattr(args, "fp16", False):
        problems.append("fp16=True: the GradScaler unscales and skips overflowing steps at optimizer.step(), after "
                        "the release already stepped scaled gradients. Use bf16=True (no scaler) " + _OFF)
    dist = [k for k in ("deepspeed", "fsdp") if getattr(args, k, None)]
    world = getattr(args, "world_size", 1)
    mode = getattr(getattr(args, "parallel_mode", None), "value", "")
    if dist or world > 1:
        what = f"{' and '.join(dist)} set" if dist else f"world_size={world}"
        problems.append(f"{what}: each hook would step a local gradient before it is reduced across processes. "
                        "Train in one process " + _OFF)
    elif mode == "distributed":  # torchrun with one process: the Trainer still wraps the model in DDP
        problems.append("a distributed launch (parallel_mode=distributed, here of 1 process): the Trainer wraps the "
                        "model in DistributedDataParallel, which writes the reduced gradients back after release "
                        "stepped them, so each would be stepped twice. Launch with python, not torchrun / accelerate "
                        "launch, " + _OFF)
    if _trainer_reentrant(args):
        problems.append("activation (gradient) checkpointing with use_reentrant=True (transformers < 5 and torch "
                        "default to it when gradient_checkpointing_kwargs does not say): each checkpointed segment "
                        "runs a backward of its own, so release cannot tell when a gradient is complete. Set "
                        "gradient_checkpointing_kwargs={'use_reentrant': False} " + _OFF)
    _refuse(problems, "TrainingArguments")


def _trainer_reentrant(args) -> bool:
    """Whether the Trainer will checkpoint with ``use_reentrant=True``. No kwargs: the model's default,
    ``{"use_reentrant": True}`` in transformers 4.x, ``False`` from 5.0; kwargs without the key go to
    ``torch.utils.checkpoint.checkpoint``, whose default is True. transformers 5.x names the fields
    ``activation_checkpointing*`` (the ``gradient_checkpointing*`` aliases mirror them)."""
    on = getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False)
    if not on:
        return False
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or getattr(args, "gradient_checkpointing_kwargs",
                                                                                None)
    kwargs = {k: v for k, v in (kwargs if isinstance(kwargs, dict) else {}).items()
              if k not in ("every_n_layers", "offload")}  # transformers' own keys, not torch's
    if kwargs.get("use_reentrant") is not None:
        return bool(kwargs["use_reentrant"])
    return bool(kwargs) or _transformers_major() < 5


def _transformers_major() -> int:
    try:
        return int(importlib.metadata.version("transformers").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return 5  # no Trainer to check then: the current default


def check_accelerate(accelerator) -> None:
    """Refuse an ``Accelerator`` under which gradient release would be wrong (all problems in one ValueError).

    Clipping cannot be seen here: with gradient release, do not call ``accelerator.clip_grad_norm_`` (it finds no
    gradients and clips nothing).
    """
    problems = []
    ga = getattr(accelerator, "gradient_accumulation_steps", 1)
    if ga > 1:
        problems.append(f"gradient_accumulation_steps={ga} (Accelerator / EfficientOptimPlugin, "
                        f"HF_EFF_GRADIENT_ACCUMULATION_STEPS): {_WHY_ACCUMULATION}. Set gradient_accumulation_steps=1 "
                        f"(a larger batch is the same math) {_OFF}")
    if str(getattr(accelerator, "mixed_precision", "no")) == "fp16" or getattr(accelerator, "scaler", None):
        problems.append("mixed_precision='fp16': the GradScaler unscales and skips at optimizer.step(), after the "
                        "release already stepped scaled gradients. Use mixed_precision='bf16' " + _OFF)
    kind = getattr(getattr(accelerator, "distributed_type", None), "value", "NO")
    processes = getattr(accelerator, "num_processes", 1)
    if kind not in ("NO", "MPS", "XLA") or processes > 1:
        problems.append(f"distributed_type={kind} with {processes} process(es): each hook would step a local "
                        "gradient before it is reduced across processes. Launch one process " + _OFF)
    _refuse(problems, "Accelerate")
