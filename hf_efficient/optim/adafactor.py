"""Adafactor whose ``lr`` is the step size, so the Trainer's learning rate and schedulers mean what they say.

Shazeer & Stern (2018): for a matrix, keep only the row and column means of the squared gradient
(``exp_avg_sq_row``, ``exp_avg_sq_col``: n + m numbers instead of n * m) and rebuild the second moment as
their outer product. transformers' ``Adafactor`` and ``torch.optim.Adafactor`` both scale the step by the
parameter's RMS by default (``scale_parameter`` / relative step), so a Trainer learning rate of 5e-5 is
silently not the step size; here it is (transformers' ``scale_parameter=False, relative_step=False``).

bf16 / fp16 weights: the new weight is computed in fp32 and written by :func:`.compensation.write` under the
``compensation`` option (``kahan``: a bf16 ``kahan_comp`` buffer; ``stochastic``; ``none``: round to nearest, the
stale weights). Statistics and ``exp_avg`` are fp32 whatever the weight's dtype.

The RMS clip needs the sum of the update's squares before any weight is written. A vector's is summed from its
update, in double. A matrix's is factored, ``k * mean(row) * sum_j D_j / col_j`` with ``D_j = sum_i (g_ij / k) *
(g_ij / row_i)`` (the update is ``g * r * c`` with ``r**2 = mean(row) / row`` and ``c**2 = 1 / col``), so that it is
gathered in the same read of the gradient as the statistics: the C kernel then reads each gradient once from memory
and once more from cache. Where even these sums overflow (|g| near fp32's largest, late in training), the clip
factor is 0 and the matrix keeps its weights for that step.

FSDP2 (DTensor parameters, Shard(0) on a 1-D mesh: see :mod:`._sharded`): each rank steps its shard with the eager
step, whose rounds (:func:`_eager_rounds`) sum over the shard group what needs the whole matrix: the column sums and
row mean where the rows are split (one all-reduce per mesh for all of them), then the RMS clip's sums of squares
(one more). The update is single-process Adafactor's up to the order of those sums. State: DTensors placed like the
parameter; column statistics of a row-split matrix whole on every rank.

Kernels. On CPU, contiguous fp32 and bf16 weights with gradients of their dtype go through a C kernel
(``adafactor_cpu.c``, the op ``hf_efficient::adafactor_step``, built once per machine, see :mod:`._native`): all
such tensors of a step in one call on torch's threads, the compensation in the same pass as the update. It must
agree with the eager step on a probe before it is used. Everything else (fp16, other layouts, CUDA) runs
:func:`_eager_step`, the reference. The two differ only in the order of sums (the row, column and D sums in fp32),
so statistics agree to a few fp32 ulps and weights to an ulp; vectors agree bit for bit. A step moves 12 bytes per
parameter from memory where torch's fused fp32 AdamW moves 28 (step times: docs/results/bench_step.md).
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor

from ..options import Option, check_group, check_saved, start_step
from . import _dispatch, _native, _sharded, _triton
from .compensation import (C_MODES, LOW_PRECISION, check_compensation, drop_unused_buffers, element_index,
                           weight_key, write)
from .facts import FIRST_MOMENT, KAHAN, SECOND_MOMENT, STEP, Family, StateKey, kahan_keys

__all__ = ["ADAFACTOR", "Adafactor"]


def _adafactor_required(p, group) -> set[str]:
    need = {"step"} | ({"exp_avg_sq_row", "exp_avg_sq_col"} if p.dim() >= 2 else {"exp_avg_sq"})
    return need | ({"exp_avg"} if group.get("beta1") is not None else set()) | kahan_keys(p, group)


def _adafactor_check(st: dict, p, where: str, trainer_name: str) -> None:
    if p.dim() >= 2 and "exp_avg_sq" in st:
        *rows, cols = p.shape
        raise ValueError(f"{where} has a full exp_avg_sq (shape {tuple(getattr(st['exp_avg_sq'], 'shape', ()))}); "
                         f"Adafactor keeps a matrix's second moment factored, as exp_avg_sq_row of shape {tuple(rows)} "
                         f"and exp_avg_sq_col of shape {tuple(p.shape[:-2]) + (cols,)}: this state was written by "
                         f"another optimizer (AdamW-like). Resume with the optimizer that wrote it, or start "
                         f"{trainer_name} afresh (remove optimizer.pt from the checkpoint)")


_OPTIONS = (  # its hyperparameters beside lr and weight_decay: optim_args keys, its class's keywords
    Option("beta1", float, None, "Adafactor first-moment decay (None: no first moment, least memory)", optional=True,
           check=lambda b: 0.0 <= b < 1.0, check_text="must be in [0, 1)"),
    Option("decay_rate", float, -0.8, "Adafactor second-moment decay exponent: beta2_t = 1 - t**decay_rate",
           check=lambda d: d < 0, check_text="must be negative"),
    Option("clip_threshold", float, 1.0, "Adafactor update clipping (RMS)", check=lambda c: c > 0,
           check_text="must be > 0"))
ADAFACTOR = Family(
    "adafactor", {"step": STEP, "exp_avg": FIRST_MOMENT, "exp_avg_sq": SECOND_MOMENT,
                  "exp_avg_sq_row": StateKey("row"), "exp_avg_sq_col": StateKey("col"), "kahan_comp": KAHAN},
    "adafactor", _adafactor_required, options=_OPTIONS,
    marks=frozenset({"exp_avg_sq_row", "exp_avg_sq_col"}), check_state=_adafactor_check,
    deepspeed="ZeRO flattens each param group into one 1-D partition, so nothing is left to factor: it trains, but "
              "keeps a full fp32 second moment (4 bytes per parameter instead of << 1)")

_FP32_MAX = torch.finfo(torch.float32).max
_SQRT_FP32_MAX = 2.0**64 * (1 - 2.0**-24)  # the largest fp32 whose square is finite in fp32
_STATS = ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "exp_avg")  # fp32 whatever the weight's dtype


class Adafactor(torch.optim.Optimizer):
    """Factored-second-moment optimizer; fp32 statistics, any parameter dtype.

    Finite gradients keep the state and the weights finite, also where a gradient's square is beyond fp32
    (|g| >= 2**64): squares are scaled before they are summed, and a statistic beyond fp32 is held at the
    largest float; a vector's gradient elements beyond 2**64 count as +-2**64. The gradients themselves
    are never written to.

    Args:
        params: parameters or param groups (each parameter once).
        lr: step size (the update's RMS is clipped to ``clip_threshold`` before ``lr`` multiplies it).
        weight_decay: decoupled decay, ``p -= lr * weight_decay * p``.
        beta1: first-moment decay; None keeps no first moment (least memory).
        decay_rate: second-moment decay ``beta2_t = 1 - t ** decay_rate`` (the paper's -0.8).
        clip_threshold: RMS bound of the normalised update.
        eps: added to squared gradients (transformers' ``eps[0]``).
        compensation: how updates reach bf16 / fp16 weights: ``"stochastic"``, ``"kahan"`` (a bf16 buffer, 2 bytes
            per parameter) or ``"none"`` (see :mod:`.compensation`); default: the family's
            (``ADAFACTOR.compensation``); fp32 weights ignore it.
    """

    FACTS = ADAFACTOR

    def __init__(self, params, *, lr: float = 1e-3, weight_decay: float = 0.0,
                 beta1: float | None = ADAFACTOR.option("beta1").default,
                 decay_rate: float = ADAFACTOR.option("decay_rate").default,
                 clip_threshold: float = ADAFACTOR.option("clip_threshold").default, eps: float = 1e-30,
                 compensation: str = ADAFACTOR.compensation):
        defaults = dict(lr=lr, weight_decay=weight_decay, beta1=beta1, decay_rate=decay_rate,
                        clip_threshold=clip_threshold, eps=eps, compensation=compensation)
        check_group(None, defaults, "Adafactor", _check_family_keys)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """As torch's, after :func:`..options.check_group` (hyperparameters, maximize, parameters listed twice) and
        :func:`._sharded.check` (a DTensor placed as the step can serve)."""
        param_group = check_group(self, param_group, "Adafactor", _check_family_keys)
        params = param_group.get("params", ()) if isinstance(param_group, dict) else ()
        for i, p in enumerate([params] if torch.is_tensor(params) else params):
            _sharded.check(p, "Adafactor", f"parameter {i} of the new param group")
        super().add_param_group(param_group)

    def __setstate__(self, state: dict) -> None:
        # torch accepts a Python number as a saved ``step`` (older checkpoints): make it the tensor step() uses
        super().__setstate__(state)
        for group in self.param_groups:  # saved before the option existed: the optimizer's own (a Kahan buffer from 0)
            group.setdefault("compensation", self.defaults.setdefault("compensation", "kahan"))
        for per_param in self.state.values():  # not all dicts: a load hook may store a flag here (torch's tests do)
            if isinstance(per_param, dict) and "step" in per_param and not torch.is_tensor(per_param["step"]):
                per_param["step"] = torch.tensor(float(per_param["step"]), dtype=torch.float32)

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, except that statistics stay fp32 (torch casts floating state to the parameter's dtype: a bf16
        weight's row statistics would become bf16) and ``kahan_comp`` bf16; a ``kahan_comp`` no longer used is
        dropped with a warning, a missing one starts at zero. Saved steps and groups are checked first."""
        check_saved(self, state_dict, "Adafactor", _check_family_keys)
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            saved, state = state_dict["state"].get(i, {}), self.state.get(p, {})
            for key in (*_STATS, "kahan_comp") if isinstance(state, dict) else ():
                want = torch.bfloat16 if key == "kahan_comp" else torch.float32
                if key in state and state[key].dtype != want:  # from the saved tensor: no round trip through bf16
                    state[key] = saved[key].to(device=p.device, dtype=want, copy=True).contiguous()
        drop_unused_buffers(self, "Adafactor")

    def takes_found_inf(self) -> bool:
        """Whether the coming step runs the Triton kernels for every tensor with a gradient, which read the guard's
        device-side flag (:func:`._dispatch.takes_found_inf`); a fresh state fits them from the first step."""
        return _dispatch.takes_found_inf(self, lambda p, group, st: _triton_fits(p, p.grad, st, group)
                                         and _triton_module(p.device) is not None)

    @torch.no_grad()
    def step(self, closure=None):
        loss = start_step(self, closure, "Adafactor")  # closure, then sparse gradients refused: nothing half-done
        _sharded.check_placements(self.param_groups, "Adafactor")  # all of them, before any state is made
        live, position = [], 0  # position: the parameter's index across groups, as in state_dict(): its noise stream
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    live.append((p, group, position))
                position += 1
        todo = [(p, group, _fill_state(self.state[p], p, group), position) for p, group, position in live]
        todo = _step_triton(self, todo)  # CUDA (Triton): the rest, if any, takes the paths below
        if not todo:
            return loss
        steps = [state["step"] for _, _, state, _ in todo]
        fn = _native_fn() if any(p.is_cpu for p, _, _, _ in todo) else None
        native, eager = [], []  # eager: (whole parameter, item): the item's tensors are its shards where it has them
        for (p, group, state, position), step in zip(todo, (s.item() + 1 for s in steps)):
            if not p.numel():
                continue
            mode = group["compensation"]
            key = weight_key(position, int(step)) if mode == "stochastic" and p.dtype in LOW_PRECISION else 0
            if _sharded.is_sharded(p):  # FSDP2: the local shards, through the eager step's rounds
                eager.append((p, (_sharded.local(p), _sharded.local(p.grad), _sharded.to_local_state(state),
                                  _coefficients(p, group, step), mode, key, group["beta1"] is not None)))
                continue
            grad = p.grad
            if fn is not None and p.dtype in _DTYPES and p.is_contiguous() and not grad.is_contiguous():
                grad = grad.contiguous()  # a transposed gradient: one copy, and the C kernel steps it
            item = (p, grad, state, _coefficients(p, group, step), mode, key, group["beta1"] is not None)
            if fn is not None and _native_fits(*item):
                native.append(item)
            else:
                eager.append((p, item))
        if native:  # first: the one call that could fail (no memory for its scratch) before anything changed
            _native_items(_op, native)
        _drive([(whole, _eager_rounds(*item, whole=whole)) for whole, item in eager])
        torch._foreach_add_(steps, 1)
        return loss


def _fill_state(state: dict, p: Tensor, group: dict) -> dict:
    """``p``'s ``state``, with what its group needs now created at zero (a group may gain beta1 or kahan later). For
    a DTensor ``p``, DTensors placed like it (column statistics of a matrix whose rows are split: whole on every
    rank), so that torch.distributed.checkpoint saves and reshards them."""
    if not state:
        state["step"] = torch.tensor(0.0)
        if p.dim() >= 2:
            state["exp_avg_sq_row"] = _sharded.zeros(p, p.shape[:-1], torch.float32)
            state["exp_avg_sq_col"] = _sharded.zeros(p, p.shape[:-2] + p.shape[-1:], torch.float32,
                                                     replicate=_splits_rows(p))
        else:
            state["exp_avg_sq"] = _sharded.zeros(p, p.shape, torch.float32)
    if group["beta1"] is not None and "exp_avg" not in state:
        state["exp_avg"] = _sharded.zeros(p, p.shape, torch.float32)
    if group["compensation"] == "kahan" and p.dtype in LOW_PRECISION and "kahan_comp" not in state:
        state["kahan_comp"] = _sharded.zeros(p, p.shape, torch.bfloat16)
    return state


def _check_family_keys(group: dict) -> None:
    """Adafactor's own keys, by its options (:func:`..options.check_group` checks lr, eps, weight_decay and
    maximize)."""
    for option in ADAFACTOR.options:
        option.check_value(group[option.name], "Adafactor")
    check_compensation(group["compensation"])


# ----------------------------------------------------------------------------------------------------
# The step. coef = [1/k, k/m, k/n, eps, 1 - beta2_t, 1 - lr*wd, lr, 1 - beta1, clip_threshold] (Python floats:
# torch rounds each to fp32 where an op takes it, the C kernel where the same op happens).
# ----------------------------------------------------------------------------------------------------


def _coefficients(p: Tensor, group: dict, step: float) -> list[float]:
    if p.dim() >= 2:  # g * g / k with k = max(n, m): squares scaled before they are summed (see the class)
        n, m = p.shape[-2], p.shape[-1]
        k = max(n, m)
        factors = [1.0 / k, k / m, k / n]
    else:
        factors = [0.0, 0.0, 0.0]
    beta1 = group["beta1"]
    lr = group["lr"]
    return [*factors, group["eps"], step ** group["decay_rate"], 1.0 - lr * group["weight_decay"], lr,
            0.0 if beta1 is None else 1.0 - beta1, group["clip_threshold"]]


def _eager_step(p: Tensor, grad: Tensor, state: dict, coef: list[float], mode: str, key: int, beta1: bool) -> None:
    """One tensor's step in torch ops, any device, dtype and layout: the reference the C kernel is held to."""
    _drive([(p, _eager_rounds(p, grad, state, coef, mode, key, beta1))])


def _drive(entries: list) -> None:
    """Run ``(whole, generator)`` pairs of :func:`_eager_rounds` to their end, round by round: the partial sums a
    generator yields for a sharded ``whole`` are summed over its shard group, those of one mesh in one all-reduce,
    before any generator goes on. A plain ``whole``'s sums are already whole."""
    while entries:
        live, parts = [], {}
        for whole, gen in entries:
            try:
                sums = next(gen)
            except StopIteration:
                continue
            live.append((whole, gen))
            if _sharded.is_sharded(whole):
                parts.setdefault(whole.device_mesh, (whole, []))[1].extend(sums)
        for whole, sums in parts.values():
            _sharded.sum_across(sums, whole)
        entries = live


def _splits_rows(p) -> bool:
    """The shard splits each matrix's rows (Shard(0) of a 2-D DTensor): column statistics, the row mean and the
    clip's sum of squares are sums over every rank's rows. Else (a plain tensor, a batch of matrices sharded along
    the batch) every matrix is whole on its rank."""
    return _sharded.is_sharded(p) and p.dim() == 2


def _eager_rounds(p: Tensor, grad: Tensor, state: dict, coef: list[float], mode: str, key: int, beta1: bool,
                  whole=None):
    """:func:`_eager_step` as a generator, for tensors that may be shards: ``p``, ``grad`` and ``state``'s tensors are
    local (a shard of ``whole``, the DTensor parameter, where given), and it yields twice the partial sums that
    must become sums over the whole tensor, summed in place by :func:`_drive` before it goes on: the column sums and
    row mean where the rows are split, then the update's sum of squares (the RMS clip)."""
    whole = p if whole is None else whole
    inv_k, k_cols, k_rows, eps, w, decay, lr, omb1, clip = coef
    # fp32 scratch: g / k, then the update; ``grad`` is only read
    buf = torch.empty(p.shape, dtype=torch.float32, device=p.device)
    if "exp_avg_sq_row" in state:
        row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
        n, m = whole.shape[-2], whole.shape[-1]
        # g * g / k, scaled before the square completes: no sum below overflows unless the mean it gives does,
        # and a mean beyond fp32 (|g| near fp32's max) is held at fp32's max instead of becoming inf
        g_k = _scaled_copy(buf, grad, inv_k)
        sq = torch.mul(g_k, grad)
        row.lerp_(sq.sum(dim=-1).mul_(k_cols).add_(eps).clamp_(max=_FP32_MAX), w)
        col_sums = sq.sum(dim=-2)
        # v ~ outer(row, col) / mean(row): the rank-1 estimate that minimises the I-divergence
        row_mean = row.div(n).sum(dim=-1, keepdim=True, dtype=torch.float64)
        yield [col_sums, row_mean] if _splits_rows(whole) else []
        col.lerp_(col_sums.mul_(k_rows).add_(eps).clamp_(max=_FP32_MAX), w)
        row_mean = row_mean.float().clamp_(max=_FP32_MAX)
        # the update's sum of squares, factored: u = g * r * c with r**2 = mean / row and c**2 = 1 / col, so
        # sum(u * u) = k * mean * sum_j D_j / col_j, D_j = sum_i (g_ij / k) * (g_ij / row_i) (no square formed)
        d = torch.mul(grad, row.reciprocal().unsqueeze(-1), out=sq).mul_(g_k).sum(dim=-2)
        over_cols = (d.double() / col.double()).sum(dim=-1)
        sumsq = (row_mean.double().squeeze(-1) * over_cols).sum() * max(n, m)
        r = row.div(row_mean).rsqrt_().unsqueeze(-1)
        update = torch.mul(grad, r, out=buf).mul_(col.rsqrt().unsqueeze(-2))  # (g * r) * c stays finite
    else:  # vectors are small: clamp the gradient so that its square, and so g / sqrt(v), stay exact
        yield []
        update = _scaled_copy(buf, grad, 1.0).clamp_(-_SQRT_FP32_MAX, _SQRT_FP32_MAX)
        v = state["exp_avg_sq"].lerp_(update.square().add_(eps), w)
        update.mul_(v.rsqrt())
        # the update's sum of squares in double: no square overflows, and the C kernel's sum agrees
        sumsq = torch.linalg.vector_norm(update, dtype=torch.float64) ** 2
    yield [sumsq]
    scale = _clip_scale(sumsq, _sharded.global_numel(whole), clip)
    if beta1:
        if not (isinstance(scale, float) and scale == 1.0):
            update.mul_(scale)
        update, step = state["exp_avg"].lerp_(update, omb1), -lr
    else:
        step = -lr * scale
    if p.dtype not in LOW_PRECISION:
        if decay != 1.0:
            p.mul_(decay)
        p.add_(torch.mul(update, step, out=buf))
        return
    # low precision: the new weight in fp32, then written once under the compensation
    p32 = p.float()
    fresh = torch.mul(update, step, out=buf).add_(p32 if decay == 1.0 else p32 * decay)
    key_t = torch.tensor(key, dtype=torch.int32, device=p.device) if mode == "stochastic" else None
    idx = element_index(p, _sharded.global_offset(whole)) if mode == "stochastic" and whole is not p else None
    write(p, p32, fresh.sub_(p32), state.get("kahan_comp"), mode, key_t, idx)


def _clip_scale(sumsq: Tensor, numel: int, clip: float) -> float | Tensor:
    """``1 / max(rms / clip, 1)`` from the update's sum of squares (a double tensor): on CPU a Python float, as the C
    kernel computes it (torch's double sqrt is not always correctly rounded, C's is); elsewhere a tensor on the
    device, so that a step does not wait for the device once per tensor."""
    if sumsq.device.type == "cpu":
        return 1.0 / max(math.sqrt(sumsq.item() / max(numel, 1)) / clip, 1.0)
    return 1.0 / torch.clamp(torch.sqrt(sumsq / max(numel, 1)) / clip, min=1.0)


def _scaled_copy(out: Tensor, grad: Tensor, factor: float) -> Tensor:
    """``out = factor * grad`` in fp32 (a low-precision gradient is widened first, not multiplied in its dtype)."""
    if grad.dtype == torch.float32:
        return torch.mul(grad, factor, out=out)
    out.copy_(grad)
    return out.mul_(factor) if factor != 1.0 else out


# ----------------------------------------------------------------------------------------------------
# The C kernel: its op, the tensors it takes, and its probe
# ----------------------------------------------------------------------------------------------------

_SOURCE, _SYMBOL = "adafactor_cpu.c", "adafactor_step"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # adafactor_cpu.c's dtype numbers


def _native_fits(p: Tensor, grad: Tensor, state: dict, coef, mode: str, key: int, beta1: bool) -> bool:
    """Plain contiguous fp32 / bf16 CPU weight and gradient of one dtype, and the state this class makes for them
    (:func:`_state_fits`)."""
    return (p.is_cpu and p.dtype in _DTYPES and grad.dtype == p.dtype and p.is_contiguous() and grad.is_contiguous()
            and _native.plain(p, grad) and _state_fits(p, state, mode, beta1))


def _state_fits(p: Tensor, state: dict, mode: str, beta1: bool) -> bool:
    """The state this class makes for ``p``: contiguous fp32 statistics of its shapes on its device, a bf16 Kahan
    buffer. Any other state (a user's, a wrong checkpoint's) takes the eager step, which raises on a wrong shape
    where a kernel would write outside the tensor."""
    shape = p.shape
    if p.dim() >= 2:
        need = [("exp_avg_sq_row", shape[:-1]), ("exp_avg_sq_col", shape[:-2] + shape[-1:])]
    else:
        need = [("exp_avg_sq", shape)]
    if beta1:
        need.append(("exp_avg", shape))
    if mode == "kahan" and p.dtype in LOW_PRECISION:
        need.append(("kahan_comp", shape))
    return all((t := state.get(name)) is not None and t.dtype == (torch.bfloat16 if name == "kahan_comp" else
               torch.float32) and t.shape == want and t.device == p.device and t.is_contiguous()
               and _native.plain(t) for name, want in need)


# per tensor, as adafactor_cpu.c reads them: dtype, batch, rows, cols (0: a vector), mode, key, has exp_avg
_META = 7
_NCOEF = 9  # per tensor, :func:`_coefficients`' scalars (adafactor_cpu.c's NCOEF)
# gradient bytes whose passes run together: their second and third reads come from the cache (L2 + a share of L3)
_GROUP_BYTES = 6 << 20


def _native_items(op, items, threads: int = -1) -> None:
    """``items`` (as :func:`_eager_step` takes them) through ``op``, in one call. Every list holds one tensor per
    item: an empty tensor (its data pointer NULL) where the item has no such state (a vector's columns, no beta1,
    no Kahan buffer); ``meta`` tells the kernel which it has."""
    params, grads, stats, cols, exp_avgs, comps, meta, coef = ([] for _ in range(8))
    none = torch.empty(0)
    for p, grad, state, c, mode, key, beta1 in items:
        params.append(p)
        grads.append(grad)
        if p.dim() >= 2:
            stats.append(state["exp_avg_sq_row"])
            cols.append(state["exp_avg_sq_col"])
            meta += (_DTYPES[p.dtype], math.prod(p.shape[:-2]), p.shape[-2], p.shape[-1], C_MODES[mode], key, beta1)
        else:
            stats.append(state["exp_avg_sq"])
            cols.append(none)
            meta += (_DTYPES[p.dtype], 1, p.numel(), 0, C_MODES[mode], key, beta1)
        exp_avgs.append(state["exp_avg"] if beta1 else none)
        comps.append(state["kahan_comp"] if mode == "kahan" and p.dtype == torch.bfloat16 else none)
        coef += c
    op(params, grads, stats, cols, exp_avgs, comps, meta, coef, threads)


def _run(fn, params: list[Tensor], grads: list[Tensor], stats: list[Tensor], cols: list[Tensor],
         exp_avgs: list[Tensor], comps: list[Tensor], meta: list[int], coef: list[float], threads: int,
         group_bytes: int | None = None) -> None:
    """The C kernel over the tensors (lists as :func:`_native_items` makes them)."""
    if threads < 0:
        threads = max(1, min(torch.get_num_threads(), sum(p.numel() for p in params) // _native._MIN_PER_THREAD))
    group_bytes = _GROUP_BYTES if group_bytes is None else group_bytes
    if _C_KERNEL.run(fn, len(params), params, grads, stats, cols, exp_avgs, comps, meta, coef, group_bytes,
                     threads) != 0:
        raise MemoryError("Adafactor: the C kernel could not allocate its scratch memory (a few MB); nothing was "
                          "updated")


def _step_op(params: list[Tensor], grads: list[Tensor], stats: list[Tensor], cols: list[Tensor],
             exp_avgs: list[Tensor], comps: list[Tensor], meta: list[int], coef: list[float], threads: int) -> None:
    """The C kernel's step over lists, in place (``threads`` < 0: torch's count, fewer for small steps)."""
    _run(_native_fn(), params, grads, stats, cols, exp_avgs, comps, meta, coef, threads)


_op = _dispatch.custom_op("adafactor_step", _step_op, ("params", "stats", "cols", "exp_avgs", "comps"))


def _native_fn():
    """The C function of ``adafactor_cpu.c``, once its probe passed; else None (see :meth:`._dispatch.CKernel.fn`)."""
    return _C_KERNEL.fn()


# (shape, dtype, compensation, beta1) of the probe: matrices of several row slices that 3 threads share unevenly,
# more columns than one column unit, a batch of matrices, vectors of several units, every write
_PROBE = [((1031, 287), torch.float32, "none", None), ((97, 2053), torch.bfloat16, "kahan", 0.9),
          ((3, 37, 41), torch.bfloat16, "stochastic", None), ((517, 263), torch.bfloat16, "none", None),
          ((2 * 65536 + 37,), torch.float32, "none", 0.9), ((2 * 65536 + 37,), torch.bfloat16, "stochastic", 0.9),
          ((613,), torch.bfloat16, "kahan", None), ((7, 5), torch.bfloat16, "kahan", None)]


def _probe_run(fn, threads: int = 3, steps: int = 3, probe=_PROBE, device="cpu"):
    """The probe's tensors after ``steps`` steps through ``fn``: the eager step (None), a C function (groups of 64 KB
    of gradient: every tensor its own group, through every stage of the C kernel's pipeline), or the Triton module
    (``adafactor_triton``, its steps counted on ``device``). Returns weights, states, lr."""
    gen = torch.Generator().manual_seed(0)
    lr = 1e-2
    params = [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for shape, dtype, _, _ in probe]
    groups = [dict(lr=lr, weight_decay=0.1, beta1=b1, decay_rate=-0.8, clip_threshold=1.0, eps=1e-30,
                   compensation=mode) for _, _, mode, b1 in probe]
    states = [{} for _ in probe]
    for t in range(1, steps + 1):
        items, entries = [], []
        for i, (p, group, state) in enumerate(zip(params, groups, states)):
            g = torch.randn(p.shape, generator=gen).to(device=device, dtype=p.dtype)
            if t == 1 and g.numel():  # squares beyond fp32 at both ends of every tensor (fp16: its largest)
                big = torch.finfo(p.dtype).max
                g.view(-1)[0], g.view(-1)[-1] = min(3e38, big), -min(2e19, big)
            _fill_state(state, p, group)
            key = weight_key(i, t) if group["compensation"] == "stochastic" else 0
            coef = _coefficients(p, group, t) if p.numel() else None  # an empty tensor: no step, as in step()
            items.append((p, g, state, coef, group["compensation"], key, group["beta1"] is not None))
            entries.append((p, g, state, group, i))
        if fn is None:
            for item in items:
                if item[0].numel():
                    _eager_step(*item)
        elif callable(fn):
            _native_items(lambda *args: _run(fn, *args, group_bytes=1 << 16), items, threads)  # a group per tensor
        else:
            for state in states:
                state["step"] = state["step"].to(device)
            _triton.advance_steps([state["step"] for state in states], _triton.zero_flag(device))
            fn.step(entries, _triton.zero_flag(device), {})
    return params, states, lr


def _probe(fn) -> bool:
    """The C function gives the eager step's results on :data:`_PROBE`, 3 steps split over 3 threads (whatever team
    OpenMP gives, every unit must be done), as :func:`_agree` states."""
    (pn, sn, lr), (pe, se, _) = _probe_run(fn), _probe_run(None)
    return all(_agree(a, b, sa, sb, lr) for a, b, sa, sb in zip(pn, pe, sn, se))


# not split by run_split: the kernel plans its own work (groups of ``group_bytes``) over its ``threads``
_C_KERNEL = _dispatch.CKernel(_SOURCE, _SYMBOL, f"count params:ptrs grads:ptrs stats:ptrs cols:ptrs exp_avgs:ptrs "
                              f"comps:ptrs meta:i64s*{_META} coef:f64s*{_NCOEF} group_bytes:int threads:threads",
                              _probe, ctypes.c_int64, split=False)


def _agree(a: Tensor, b: Tensor, sa: dict, sb: dict, lr: float, exact_vectors: bool = True) -> bool:
    """Weight ``a`` and state ``sa`` (a kernel) agree with ``b`` and ``sb`` (eager). Vectors: everything exact (where
    ``exact_vectors``: the C kernel on CPU). Matrices, whose row and column sums of squares add in another order (and
    vectors on a GPU, whose eager ``rsqrt`` is not correctly rounded): statistics within 2**-16 relative (a few ulps
    happen; a lost row or column is 1e-3), exp_avg within 2**-16 of its largest value, weights within 2 fp32 ulps (one
    bf16 ulp) plus 2**-10 of a step, a Kahan weight plus its buffer within 2**-15 relative plus 2**-10 of a step."""
    if a.dim() < 2 and exact_vectors:
        return torch.equal(a, b) and all(torch.equal(sa[k], sb[k]) for k in sb)
    if set(sa) != set(sb):
        return False
    close = lambda x, y, rtol, atol: bool(torch.isclose(x, y, rtol=rtol, atol=atol).all())  # noqa: E731
    ok = all(close(sa[k], sb[k], 2.0**-16, 0.0) for k in ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq")
             if k in sb)
    if "exp_avg" in sb and sb["exp_avg"].numel():
        ok = ok and close(sa["exp_avg"], sb["exp_avg"], 0.0, 2.0**-16 * sb["exp_avg"].abs().max().item())
    ulp = 2.0**-22 if a.dtype == torch.float32 else 2.0**-7
    ok = ok and close(a.float(), b.float(), ulp, lr * 2.0**-10)
    if "kahan_comp" in sb:
        ok = ok and close(a.float() + sa["kahan_comp"].float(), b.float() + sb["kahan_comp"].float(), 2.0**-15,
                          lr * 2.0**-10)
    return ok


# ----------------------------------------------------------------------------------------------------
# CUDA: the Triton kernels (adafactor_triton.py), once their probe passed on the device
# ----------------------------------------------------------------------------------------------------

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (shape, dtype, compensation, beta1): rows and columns not multiples of the tiles, a batch, vectors, every write
_TRITON_PROBE = [((37, 1100), torch.float32, "none", 0.9), ((70, 33), torch.bfloat16, "kahan", None),
                 ((3, 9, 7), torch.float16, "stochastic", 0.9), ((41, 19), torch.bfloat16, "none", None),
                 ((1500,), torch.float32, "none", None), ((613,), torch.bfloat16, "kahan", 0.9),
                 ((70,), torch.float16, "stochastic", None), ((0, 5), torch.bfloat16, "kahan", None)]


def _step_triton(optimizer, todo: list) -> list:
    """Step the tensors of ``todo`` (``(p, group, state, position)``) that the Triton kernels take, on each device
    whose probe passed; return the others. Their steps live on the device (advanced there unless the step's flag
    is set, see :mod:`._triton`): nothing here reads the device."""
    mine, rest = _dispatch.triton_split(range(len(todo)), [entry[0] for entry in todo], lambda i: _triton_fits(
        todo[i][0], todo[i][0].grad, todo[i][2], todo[i][1]), _triton_module)
    for device, idx in mine.items():
        module = _triton_module(device)
        items = []
        for p, group, state, position in (todo[i] for i in idx):
            if state["step"].device != device:  # once: a new state's, or a loaded one's (torch keeps it on CPU)
                state["step"] = state["step"].to(device)
            items.append((p.detach(), p.grad.contiguous(), state, group, position))
        found_inf = _triton.flag(optimizer, device)
        _triton.advance_steps([state["step"] for _, _, state, _, _ in items], found_inf)
        module.step(items, found_inf, optimizer.__dict__.setdefault("_triton_tables", {}))
    return [todo[i] for i in rest]


def _triton_fits(p: Tensor, grad: Tensor, state: dict, group: dict) -> bool:
    """The Triton kernels can step ``p`` (a fresh, empty ``state`` always fits: :func:`_fill_state` makes it so)."""
    return ((_triton.applies(p, grad) or (p.is_cuda and not _triton.available())) and p.is_contiguous()
            and p.dtype in _TRITON_DTYPES and grad.dtype in _TRITON_DTYPES
            and (not state or _state_fits(p, state, group["compensation"], group["beta1"] is not None)))


def _triton_module(device: torch.device):
    """``adafactor_triton`` once its probe passed on ``device``; else None (why: logged once)."""
    def load():
        if not _triton.available():
            raise ImportError("Triton is not installed (CUDA builds of torch ship it)")
        from . import adafactor_triton
        return adafactor_triton

    return _dispatch.probed("adafactor", device, load, _triton_probe, "the eager step")


def _triton_probe(module, device) -> bool:
    """The Triton kernels give the eager step's results on :data:`_TRITON_PROBE` on ``device``, 3 steps (the first
    with squares beyond fp32), as :func:`_agree` states without exact vectors (the eager step's ``rsqrt`` on a GPU is
    not correctly rounded; the kernels' is)."""
    (pt, st, lr), (pe, se, _) = (_probe_run(fn, probe=_TRITON_PROBE, device=device) for fn in (module, None))
    return all(_agree(a, b, sa, sb, lr, exact_vectors=False) for a, b, sa, sb in zip(pt, pe, st, se))
