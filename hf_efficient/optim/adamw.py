"""AdamW with fp32 moments for bf16 / fp16 weights, whose updates are not lost to rounding.

``torch.optim.AdamW`` on a bf16 model keeps bf16 moments and rounds each new weight to nearest: an update below half
a bf16 ulp of its weight is lost (stale weights). Here the step runs on an fp32 copy of each low-precision weight
(torch's own kernel: fused on CPU and CUDA) with fp32 moments, and the new weight is written by
:func:`.compensation.write` (``compensation``: kahan, stochastic or none). fp32 weights get torch's AdamW as is.
State per low-precision parameter: ``exp_avg``, ``exp_avg_sq`` (fp32, 8 bytes) and, under kahan, ``kahan_comp``
(bf16, 2 bytes), against 4 + 8 for an fp32 master copy with fp32 moments.

On CPU, bf16 weights (fp32 or bf16 gradients, no amsgrad or maximize) go through a C kernel instead
(``adamw_cpu.c``, the op ``hf_efficient::adamw_step``): torch's fused step and the compensated write in one pass over
the tensors, no copy. It gives the torch path's bits (torch 2.13, x86), and must agree with it on a probe before
it is used. 8-bit AdamW's fp32-state tensors (biases, norms) take this path too.

On CUDA, every weight dtype (no amsgrad, maximize or tensor lr: those keep the torch path) goes through a Triton
kernel (:mod:`.adamw_triton`), once it agreed with the torch path on a probe on that device: the same one pass,
no fp32 copy, no host synchronisation (step counts live on the device, the guard's ``found_inf`` voids the step
there). Without Triton, or where the probe fails, the torch path runs, one warning logged; its fp32 copies are
made in bounded chunks (:func:`.compensation.step_in_fp32`).
"""

from __future__ import annotations

import math
from array import array

import torch
from torch import Tensor
from torch.optim.adamw import adamw as _torch_adamw

from ..options import check_saved, start_step
from . import _dispatch, _sharded, _triton
from .compensation import (COMPENSATIONS, LOW_PRECISION, check_compensation, drop_unused_buffers, step_in_fp32,
                           weight_key)
from .facts import FIRST_MOMENT, KAHAN, SECOND_MOMENT, STEP, Family, kahan_keys

__all__ = ["ADAMW", "AdamW", "adamw_fp32_state", "fused_takes"]

_MOMENTS = {"step", "exp_avg", "exp_avg_sq"}


def _adamw_required(p, group) -> set[str]:
    return _MOMENTS | ({"max_exp_avg_sq"} if group.get("amsgrad") else set()) | kahan_keys(p, group)


# the family of hf_eff_adamw: torch.optim.AdamW's state (the state torch's own optimizers write), and this module's
ADAMW = Family("adamw", {"step": STEP, "exp_avg": FIRST_MOMENT, "exp_avg_sq": SECOND_MOMENT,
                         "max_exp_avg_sq": SECOND_MOMENT, "kahan_comp": KAHAN},
               "adamw", _adamw_required, flags=("maximize", "amsgrad"))


def adamw_fp32_state(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, beta1, beta2, eps,
                     weight_decay, amsgrad: bool = False, maximize: bool = False, compensation: str = "none",
                     comps=None, keys=None, c_kernel: bool = True, positions=None, found_inf=None,
                     offsets=None, tables=None) -> None:
    """torch's own AdamW (fused on CPU and CUDA) on fp32 moments; weights of other dtypes are stepped as fp32 copies
    and written back by :func:`.compensation.step_in_fp32` (``comps``: each tensor's Kahan buffer or None; ``keys``:
    each tensor's noise key, or ``positions``: each tensor's index across groups, its key then being
    ``weight_key(position, step)`` of the step being taken), bf16 weights on CPU by the C kernel where it applies
    (``_KERNEL.split``; ``c_kernel`` False: never, nor the Triton kernel). On CUDA, the Triton kernel
    (:mod:`.adamw_triton`) steps the tensors whose step count lives on their device, without reading anything on the
    host; ``found_inf`` (a float32 scalar, torch's name) set voids the step, step counts included. Increments
    ``steps``. ``offsets``: each tensor's first global element number where the tensors are FSDP2 shards (the
    stochastic noise's index, :func:`.compensation.write_all`); those go through torch's path (pass ``c_kernel``
    False). ``tables``: a dict the caller keeps between steps for the Triton launches' pointer tables (one per
    param group; None: a process-wide cache of the recent ones, which a model of many groups outgrows)."""
    n = len(params)
    comps = [None] * n if comps is None else comps
    if c_kernel and not (amsgrad or maximize or torch.is_tensor(lr)):
        mine, rest = _triton_split(params, grads, exp_avgs, exp_avg_sqs, comps, steps, compensation)
        for device, idx in mine.items():
            pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
            flag = found_inf if found_inf is not None and found_inf.device == device else _triton.zero_flag(device)
            _triton_kernel(device)(
                pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), pick(comps), pick(steps),
                pick(positions) if keys is None and positions is not None else pick(keys or [0] * n), flag,
                keyed=keys is not None or positions is None, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay, compensation=compensation, tables=tables)
        if mine:
            pick = lambda xs: None if xs is None else [xs[i] for i in rest]  # noqa: E731
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, comps, keys, positions = map(
                pick, (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, comps, keys, positions))
            if not params:
                return
    if found_inf is not None and bool(found_inf):  # off the Triton path the flag is read here (a sync), as torch's
        return
    if keys is None:  # the noise key of the step about to be counted, read on the host (these paths read it anyway)
        keys = [0] * len(params) if positions is None else [
            weight_key(pos, int(s.item()) + 1) for pos, s in zip(positions, steps)]
    states = list(zip(exp_avgs, exp_avg_sqs))
    native, rest = ([], None) if not c_kernel or amsgrad or maximize or torch.is_tensor(lr) else _KERNEL.split(
        params, grads, states, comps, compensation)
    if native:
        pick = lambda xs, idx: [xs[i] for i in idx]  # noqa: E731
        torch._foreach_add_(pick(steps, native), 1)
        coef, by_step = [], {}  # the tensors of a group mostly share their step: its scalars computed once
        for i in native:
            step = int(steps[i].item())
            if step not in by_step:
                by_step[step] = _c_coefficients(step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                                weight_decay=weight_decay)
            coef += by_step[step]
        _KERNEL(pick(params, native), pick(grads, native), pick(states, native), pick(comps, native),
                pick(keys, native), coef, compensation)
        if not rest:
            return
        params, grads, exp_avgs, exp_avg_sqs, steps, comps, keys = (
            pick(xs, rest) for xs in (params, grads, exp_avgs, exp_avg_sqs, steps, comps, keys))
    _torch_path(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=lr, beta1=beta1, beta2=beta2,
                eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize, compensation=compensation,
                comps=comps, keys=keys, offsets=offsets)


def _torch_path(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay,
                amsgrad, maximize, compensation, comps, keys, offsets=None) -> None:
    """:func:`adamw_fp32_state` with torch's kernels: fp32 weights in place, the others through fp32 copies."""
    def step(idx, ps):
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        # torch's fused kernel walks each tensor's memory flat (aten's FusedAdamKernel.cpp checks nothing on CPU;
        # CUDA's refuses differing strides): the weight's fp32 copy is row-major, so everything it meets must be too,
        # else a transposed or channels_last weight's elements meet other elements' gradients and moments
        gs = [grads[i].float().contiguous() for i in idx]
        ms, vs, maxs = pick(exp_avgs), pick(exp_avg_sqs), pick(max_exp_avg_sqs) if amsgrad else []
        ps = list(ps)
        back = _row_major(ps, ms, vs, maxs)
        # torch's fused kernel: on CPU, and on CUDA where the steps live on the device (CUDA's wants them there)
        fused = all(p.device.type == "cpu" or steps[i].device == p.device for i, p in zip(idx, ps))
        _torch_adamw(ps, gs, ms, vs, maxs, pick(steps), foreach=None if fused else False, fused=fused,
                     amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps,
                     maximize=maximize)
        for t, copy in back:
            t.copy_(copy)

    step_in_fp32(params, step, compensation, comps, keys, offsets)


def fused_takes(p: Tensor, *others: Tensor) -> bool:
    """Whether torch's fused AdamW kernel steps ``p`` right beside ``others`` (its gradient, moments): it walks each
    tensor's memory flat (aten's FusedAdamKernel.cpp checks nothing on CPU), so ``p`` must fill its memory (not a
    slice of a larger tensor) and the others share its strides, as torch.optim.AdamW's moments and autograd's
    gradients do for such a weight."""
    expected = 1
    for stride, size in sorted((stride, size) for stride, size in zip(p.stride(), p.shape) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return all(t.stride() == p.stride() for t in others)


def _row_major(*lists) -> list[tuple[Tensor, Tensor]]:
    """Each tensor of ``lists`` that is not row-major replaced in its list by a row-major copy (an fp32 weight that
    is a view, state loaded or made in the weight's strides: 8-bit AdamW's fp32 state); the (tensor, copy) pairs to
    write back once stepped."""
    back = []
    for ts in lists:
        for k, t in enumerate(ts):
            if not t.is_contiguous():
                ts[k] = t.contiguous()
                back.append((t, ts[k]))
    return back


# ----------------------------------------------------------------------------------------------------
# The C kernel (bf16 weights on CPU), cached, probed and published by :mod:`._dispatch`
# ----------------------------------------------------------------------------------------------------

def _c_coefficients(step: int, *, lr, beta1, beta2, eps, weight_decay) -> list[float]:
    """The C kernel's scalars for ``step``, in the order of ``adamw_cpu.c``'s ``adamw_coef_t`` (decay: the
    multiplicative ``1 - lr * wd`` every AdamW-family C kernel takes): computed in double, as torch's fused CPU kernel
    computes them, then rounded to fp32 once."""
    lerp = array("f", [1.0 - beta1])[0]
    toward_m = abs(lerp) < 0.5  # torch's lerp: from the moment's side for small weights, else from the gradient's
    raw = [lerp if toward_m else lerp - 1.0, float(toward_m), beta2, 1.0 - beta2, math.sqrt(1.0 - beta2**step), eps,
           1.0 - lr * weight_decay, -(lr / (1.0 - beta1**step))]
    return array("f", raw).tolist()  # each rounded to fp32 once


_PROBE = dict(lr=2e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)  # the probe's step 3


def _probe_reference(params, grads, states, comps, keys, mode: str) -> None:
    _torch_path(params, grads, [m for m, _ in states], [v for _, v in states], [],
                [torch.tensor(2.0) for _ in params], amsgrad=False, maximize=False, compensation=mode, comps=comps,
                keys=keys, **_PROBE)


_KERNEL = _dispatch.Bf16WeightKernel("adamw_step", "adamw_cpu.c", "adamw_step", _probe_reference, (1e-3, 1e-4),
                                     lambda: _c_coefficients(3, **_PROBE))


# ----------------------------------------------------------------------------------------------------
# The Triton kernel (CUDA; CPU tensors under the interpreter in tests), probed once per device
# ----------------------------------------------------------------------------------------------------

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _triton_eligible(p, g, m, v, comp, step, compensation: str) -> bool:
    """Whether the Triton kernel can step this tensor: every tensor plain, contiguous and on one device (the step
    count too: the kernel reads it there), fp32 moments, a bf16 Kahan buffer where the write uses one."""
    kahan = compensation == "kahan" and p.dtype in LOW_PRECISION
    tensors = (p, g, m, v, step) + ((comp,) if kahan else ())
    return (p.dtype in _TRITON_DTYPES and g.dtype in _TRITON_DTYPES and m.dtype == v.dtype == step.dtype
            == torch.float32 and (not kahan or (comp is not None and comp.dtype == torch.bfloat16))
            and _triton.applies(*tensors) and all(t.is_contiguous() for t in tensors))


def _triton_split(params, grads, exp_avgs, exp_avg_sqs, comps, steps, compensation: str):
    """``({device: indices}, other indices)``: the tensors the Triton kernel steps (:func:`._dispatch.triton_split`
    by :func:`_triton_eligible`), and the others."""
    return _dispatch.triton_split(range(len(params)), params, lambda i: _triton_eligible(
        params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], comps[i], steps[i], compensation), _triton_kernel)


def _triton_kernel(device: torch.device):
    """:func:`.adamw_triton.fp32_state_step`, once its probe on ``device`` passed; else None (logged once)."""
    def load():
        from . import adamw_triton
        return adamw_triton.fp32_state_step

    return _dispatch.probed("adamw_fp32_state", device, load, _triton_probe, "torch's AdamW")


def _triton_probe(kernel, device: torch.device) -> bool:
    """On fresh tensors of ``device`` (a launch of its own and a batched one, every mode and weight dtype), the
    kernel agrees with the torch path: moments within 1e-6 of their largest value, weights within one spacing of
    their dtype, Kahan buffers within 1% (weights 1.0, updates of about a quarter of a bf16 spacing: a lost
    compensation fails)."""
    gen = torch.Generator().manual_seed(0)
    sizes = (3000, 37)
    grads = [torch.randn(n, generator=gen).to(device) for n in sizes]
    for mode in COMPENSATIONS:
        for dtype in _TRITON_DTYPES:
            runs = []
            for triton in (True, False):
                ps = [torch.ones(n, dtype=dtype, device=device) for n in sizes]
                ms, vs = ([torch.full((n,), x, device=device) for n in sizes] for x in (1e-3, 1e-4))
                cs = [torch.zeros(n, dtype=torch.bfloat16, device=device) if mode == "kahan" and dtype != torch.float32
                      else None for n in sizes]
                if triton:
                    steps = [torch.tensor(2.0, device=device) for _ in sizes]
                    kernel(ps, grads, ms, vs, cs, steps, [7, -9], _triton.zero_flag(device), keyed=True,
                           compensation=mode, small=1024, **_PROBE)
                else:
                    _probe_reference(ps, grads, list(zip(ms, vs)), cs, [7, -9], mode)
                runs.append((ps, ms + vs, [c for c in cs if c is not None]))
            (pt, st, ct), (pr, sr, cr) = runs
            spacing = torch.finfo(dtype).eps
            # relative to each tensor's scale: a moment near zero is the difference of two larger numbers, whose
            # last bits a device's multiply-add contraction (torch's lerp on CUDA) may round otherwise
            close = all(torch.allclose(a, b, rtol=0.0, atol=1e-6 * float(b.abs().max())) for a, b in zip(st, sr))
            close &= all(bool(((a.float() - b.float()).abs() <= spacing).all()) for a, b in zip(pt, pr))
            close &= all(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=0.0) for a, b in zip(ct, cr))
            if not close:
                return False
    return True


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (its groups, flags and state keys) with fp32 moments and a compensated write for
    bf16/fp16 weights; see the module docstring. ``compensation``: ``"stochastic"``, ``"kahan"`` or ``"none"`` (round
    to nearest: torch's stale weights, with fp32 moments); default: the family's (``ADAMW.compensation``)."""

    FACTS = ADAMW

    def __init__(self, params, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False,
                 compensation: str = ADAMW.compensation):
        check_compensation(compensation)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize)
        self.defaults["compensation"] = compensation
        for group in self.param_groups:
            group.setdefault("compensation", compensation)
        self._tables = {}  # id(param group) -> its Triton launches' pointer tables (_triton.launch)

    def add_param_group(self, param_group: dict) -> None:
        check_compensation(param_group.get("compensation", self.defaults.get("compensation", ADAMW.compensation)))
        super().add_param_group(param_group)

    def _init_state(self, p: Tensor, group: dict) -> dict:
        state, where = self.state[p], _dispatch.step_device(p)
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=where)
            keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
            for key in keys:  # row-major whatever the weight's strides, as every kernel here steps them; an FSDP2
                state[key] = _sharded.zeros(p, p.shape, torch.float32)  # shard's: a DTensor placed as its weight
        elif (p.is_cuda or state["step"].is_cuda) and state["step"].device != where:
            state["step"] = state["step"].to(where)  # loaded, or saved by the other path: moved once
        if group["compensation"] == "kahan" and p.dtype in LOW_PRECISION and "kahan_comp" not in state:
            state["kahan_comp"] = _sharded.zeros(p, p.shape, torch.bfloat16)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but moments stay fp32 (torch casts them to the parameter's dtype) and Kahan buffers bf16, both
        row-major; a buffer no tensor uses any more is dropped (:func:`.compensation.drop_unused_buffers`)."""
        check_saved(self, state_dict, "AdamW")
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for i, p in zip(saved_ids, (p for g in self.param_groups for p in g["params"])):
            # .get: indexing would give a parameter without state an empty entry, which outlives the parameter
            # (accelerate's FSDP2 prepare swaps it for a DTensor) and breaks torch's state_dict() with a KeyError
            saved, state = state_dict["state"].get(i, {}), self.state.get(p, {})
            for key, value in saved.items():
                if key != "step" and key in state and torch.is_tensor(value):
                    state[key] = value.to(device=p.device, dtype=torch.bfloat16 if key == "kahan_comp"
                                          else torch.float32).contiguous()  # row-major, as _init_state makes it
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(torch.float32)
        drop_unused_buffers(self, "AdamW")

    def takes_found_inf(self) -> bool:
        """Whether the coming step sends every tensor with a gradient to the Triton kernel, which reads the guard's
        device-side flag (:func:`._dispatch.takes_found_inf`). False before a tensor's first step (its state is made
        in step())."""
        def takes(p, group, st):
            return (bool(st) and not (group["amsgrad"] or group["maximize"] or torch.is_tensor(group["lr"]))
                    and bool(_triton_split([p], [p.grad], [st["exp_avg"]], [st["exp_avg_sq"]],
                                           [st.get("kahan_comp")], [st["step"]], group["compensation"])[0]))

        return _dispatch.takes_found_inf(self, takes)

    @torch.no_grad()
    def step(self, closure=None):
        loss = start_step(self, closure, "AdamW")  # closure, then sparse gradients refused: nothing half-done
        position = 0  # a parameter's index across groups, as in state_dict(): its stochastic-rounding stream
        for group in self.param_groups:
            self._step_group(group, position)
            position += len(group["params"])
        return loss

    def _step_group(self, group: dict, position: int) -> None:
        """Step the parameters of ``group`` that have a gradient; ``position``: the index of its first parameter
        across groups (the noise stream of each). One group at a time, so that a class stepping some groups by
        another rule (:class:`.muon.Muon`) steps the others with this code."""
        items = [(p, self._init_state(p, group), i) for i, p in enumerate(group["params"], position)
                 if p.grad is not None]
        if not items:
            return
        shards = [it for it in items if _sharded.is_sharded(it[0])]
        if shards:
            self._step_shards(group, shards)
            items = [it for it in items if not _sharded.is_sharded(it[0])]
            if not items:
                return
        states = [st for _, st, _ in items]
        beta1, beta2 = group["betas"]
        adamw_fp32_state([p for p, _, _ in items], [p.grad for p, _, _ in items],
                         [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states],
                         [st.get("max_exp_avg_sq") for st in states], [st["step"] for st in states],
                         lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"], amsgrad=group["amsgrad"],
                         maximize=group["maximize"], compensation=group["compensation"],
                         comps=[st.get("kahan_comp") for st in states], positions=[i for _, _, i in items],
                         found_inf=getattr(self, "found_inf", None),
                         tables=self.__dict__.setdefault("_tables", {}).setdefault(id(group), {}))

    def _step_shards(self, group: dict, items: list) -> None:
        """FSDP2 shards (``items``: parameter, state, position; Shard(0) on a 1-D mesh, :func:`._sharded.check`):
        their local tensors through torch's path, as AdamW is elementwise. bf16/fp16 ones because the compensated
        write has no DTensor rule (the noise numbered as in the whole tensor); fp32 ones too, because torch's fused
        kernel refuses DTensor weights beside the host step counts this class keeps (hf_eff_adamw's fp32 shards are
        torch's AdamW; this path is the AdamW half of :class:`.muon.Muon`)."""
        for p, _, position in items:
            _sharded.check(p, "AdamW", f"parameter {position}")
        states = [_sharded.to_local_state(st) for _, st, _ in items]
        beta1, beta2 = group["betas"]
        adamw_fp32_state([_sharded.local(p) for p, _, _ in items], [_sharded.local(p.grad) for p, _, _ in items],
                         [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states],
                         [st.get("max_exp_avg_sq") for st in states], [st["step"] for st in states],
                         lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"], amsgrad=group["amsgrad"], maximize=group["maximize"],
                         compensation=group["compensation"], comps=[st.get("kahan_comp") for st in states],
                         positions=[i for _, _, i in items], found_inf=getattr(self, "found_inf", None),
                         c_kernel=False, offsets=[_sharded.global_offset(p) for p, _, _ in items])

