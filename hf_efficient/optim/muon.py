"""Muon's math as pure functions: momentum, Newton-Schulz orthogonalisation in batches of same-shaped matrices, the
scaled update and its compensated write. A thin optimizer class calls :func:`muon`.

Math (Keller Jordan 2024; ``torch.optim.Muon``; the scaling of Moonlight, Liu et al. 2025), per 2-D parameter ``p``
with gradient ``g``, in fp32 but for the orthogonalisation::

    buf = momentum * buf + (1 - momentum) * g                  # torch's buf.lerp_(g, 1 - momentum)
    u   = (1 - momentum) * g + momentum * buf  if nesterov else buf
    O   = NS(u)                                                # ~ U V^T where u = U S V^T
    p   = p * (1 - lr * weight_decay) - lr * scale(rows, cols) * O

This is torch's formulation (and the reference's): the buffer is an average, on the gradient's scale, so that its
state is ``torch.optim.Muon``'s ``momentum_buffer`` and an 8-bit codec sees gradient-sized numbers. The SGD-style
``buf = momentum * buf + g`` (Moonlight) is ``1 / (1 - momentum)`` times it; Newton-Schulz's normalisation removes
that factor, up to ``eps`` and the rounding of the scaled input.

``NS``: 5 steps of the quintic ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` and (a, b, c) = (3.4445, -4.7750,
2.0315), after ``X = u / max(||u||_F, eps)``, on the transpose where ``u`` has more rows than columns (so ``A`` is
the smaller Gram matrix), in bf16 by default as the reference and torch run it (fp32 as an option). Same-shaped
matrices go through it together, stacked in a batch (``torch.bmm`` / ``torch.baddbmm``): 15 launches per batch
instead of per matrix. A batch holds at most :data:`NS_CHUNK` elements (a larger matrix alone), so its stack and
Gram matrices are bounded by that, not by the model.

``scale``: ``"match_rms_adamw"`` (default) ``0.2 * sqrt(max(rows, cols))`` makes the update's RMS that of AdamW's
(~0.2), so AdamW's learning rate and weight decay carry over; ``"original"`` (the reference's) ``sqrt(max(1, rows /
cols))``, rows being the output features of ``nn.Linear``'s ``(out, in)`` weight. The decay is decoupled and
unscaled (``lr * weight_decay``), as torch's.

Weights that are bf16 / fp16 receive their new value through :mod:`.compensation` (``stochastic`` / ``kahan`` /
``none``); fp32 weights are updated in place with torch's operations (``mul_`` then ``add_``), as
``torch.optim.Muon`` does.

The optimizer (:class:`Muon`, ``hf_eff_muon``) is :class:`.adamw.AdamW` whose groups marked ``"muon": True``
(:func:`..param_groups.build_muon_param_groups`: the matrices inside the model's blocks) are stepped by :func:`muon`
instead: one class, one state dict, one param-group list, so LR schedulers, checkpoints, the guard and gradient
release see one optimizer, and the AdamW half is the very code of ``hf_eff_adamw`` (fp32 moments, compensated bf16
writes). Its 8-bit sibling is :mod:`.muon8bit`. Both keep, per Muon matrix, ``step`` (for the noise of stochastic
rounding) and ``momentum_buffer`` (``torch.optim.Muon``'s), and the Kahan buffer where compensation asks for one.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
from torch import Tensor

from ..options import Option, check_group, start_step
from ..param_groups import build_muon_param_groups
from . import _muon_sharded, _sharded
from .adamw import AdamW
from .compensation import LOW_PRECISION, check_compensation, step_in_fp32, weight_key
from .facts import FIRST_MOMENT, KAHAN, SECOND_MOMENT, STEP, Family, StateKey, kahan_keys

__all__ = ["MUON", "Muon", "MuonSteps", "MUON_OPTIONS", "muon_required", "muon_groups", "check_muon_group",
           "NO_ZERO", "muon", "momentum_update_", "newton_schulz_", "orthogonalized", "same_shape_batches", "update_scale",
           "apply_updates", "check_muon_args", "NS_COEFFICIENTS", "NS_STEPS", "NS_EPS", "NS_DTYPES", "NS_CHUNK",
           "ADJUST_LR"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the reference's quintic: steepest slope at 0 that still converges
NS_STEPS = 5
NS_EPS = 1e-7
NS_DTYPES = (torch.bfloat16, torch.float32)
ADJUST_LR = ("match_rms_adamw", "original")
# Elements of one stacked batch (2**24: 32 MiB in bf16, plus its output and Gram matrices at most as large): four
# 2048 x 2048 attention matrices of a 1B model go together, while the stack stays a fixed size whatever the model.
NS_CHUNK = 1 << 24


def check_muon_args(params, *, momentum: float, ns_steps: int, ns_coefficients, eps: float, ns_dtype, adjust_lr: str,
                    compensation: str, shapes=None) -> None:
    """Raise ValueError, naming the value, for anything :func:`muon` cannot run with; called before any change."""
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"Invalid momentum={momentum!r}: expected 0 <= momentum < 1")
    if not (isinstance(ns_steps, int) and 1 <= ns_steps < 100):
        raise ValueError(f"Invalid ns_steps={ns_steps!r}: expected an integer in [1, 100)")
    if len(tuple(ns_coefficients)) != 3:
        raise ValueError(f"Invalid ns_coefficients={ns_coefficients!r}: expected three numbers (a, b, c)")
    if not eps > 0:
        raise ValueError(f"Invalid eps={eps!r}: expected a positive number")
    if ns_dtype not in NS_DTYPES:
        raise ValueError(f"Invalid ns_dtype={ns_dtype!r}: expected torch.bfloat16 (the reference) or torch.float32")
    if adjust_lr not in ADJUST_LR:
        raise ValueError(f"Invalid adjust_lr={adjust_lr!r}: expected one of {list(ADJUST_LR)}")
    check_compensation(compensation)
    for i, p in enumerate(params):
        if p.ndim != 2 or (shapes is not None and len(shapes[i]) != 2):
            raise ValueError(f"Muon orthogonalises matrices: parameter {i} has shape {tuple(p.shape)}; give tensors "
                             "that are not 2-D to AdamW (param_groups.build_muon_param_groups splits a model)")


def momentum_update_(grad: Tensor, buf: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Advance ``buf`` (fp32) by ``grad`` and return the update to orthogonalise, in fp32: torch's operations, so the
    numbers equal ``torch.optim.Muon``'s on fp32 gradients. The result may be ``buf`` itself (no Nesterov)."""
    g = grad.float()
    buf.lerp_(g, 1 - momentum)
    return g.lerp(buf, momentum) if nesterov else buf


def newton_schulz_(x: Tensor, *, steps: int = NS_STEPS, coefficients=NS_COEFFICIENTS, eps: float = NS_EPS) -> Tensor:
    """Orthogonalise each matrix of the batch ``x`` (``(b, r, c)``, ``r <= c``, contiguous) in its dtype; ``x`` is
    overwritten (a caller's stack). Returns the result, ``x`` or a buffer of its shape.

    The operations of ``torch.optim.Muon`` per matrix (Frobenius norm in ``x``'s dtype, clamped at ``eps``; ``A = X
    X^T``; ``B = b A + c A A``; ``X = a X + B X``), batched: each matrix's numbers do not depend on the batch it is
    in (checked on CPU by the tests), so a subset of a batch orthogonalised elsewhere (FSDP2) gives the same bits."""
    a, b, c = coefficients
    x.div_(x.norm(dim=(-2, -1), keepdim=True).clamp_(min=eps))
    gram = x.new_empty(x.shape[0], x.shape[1], x.shape[1])
    poly, y = torch.empty_like(gram), torch.empty_like(x)  # out= buffers: no allocation per step
    for _ in range(steps):
        torch.bmm(x, x.mT, out=gram)
        torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)
        torch.baddbmm(x, poly, x, beta=a, out=y)
        x, y = y, x
    return x


def same_shape_batches(keys: list, sizes: list[int], chunk: int = NS_CHUNK) -> list[list[int]]:
    """Indices grouped by equal ``keys`` (shape, device), in order of first appearance, each group cut into runs of at
    most ``chunk`` elements in all (``sizes``: each one's; a larger matrix in a run of its own)."""
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    batches = []
    for idx in groups.values():
        per = max(1, chunk // max(1, sizes[idx[0]]))
        batches += [idx[k:k + per] for k in range(0, len(idx), per)]
    return batches


def orthogonalized(shapes: list[torch.Size], fill: Callable[[int, Tensor], object], *, device, dtype=torch.bfloat16,
                   steps: int = NS_STEPS, coefficients=NS_COEFFICIENTS, eps: float = NS_EPS,
                   chunk: int = NS_CHUNK) -> Iterator[tuple[list[int], Tensor]]:
    """Orthogonalise matrices ``0..len(shapes)-1`` (all on ``device``) in same-shaped batches of at most ``chunk``
    elements. ``fill(i, out)`` writes matrix ``i`` into ``out``, a ``shapes[i]`` view of the batch (of ``dtype``:
    the cast is the copy); yields ``(indices, results)``, ``results[j]`` matrix ``indices[j]`` orthogonalised, in its
    own shape (a view, valid until the next batch is made). Tall matrices are stacked transposed (rows <= cols)."""
    shapes = [torch.Size(s) for s in shapes]
    for idx in same_shape_batches(shapes, [s.numel() for s in shapes], chunk):
        rows, cols = shapes[idx[0]]
        tall = rows > cols
        x = torch.empty(len(idx), min(rows, cols), max(rows, cols), dtype=dtype, device=device)
        view = x.mT if tall else x
        for j, i in enumerate(idx):
            fill(i, view[j])
        out = newton_schulz_(x, steps=steps, coefficients=coefficients, eps=eps)
        yield idx, out.mT if tall else out


def update_scale(shape, adjust_lr: str = "match_rms_adamw") -> float:
    """The factor of ``lr`` for a ``(rows, cols)`` matrix's orthogonalised update (torch's ``_adjust_lr``)."""
    rows, cols = shape
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))


def apply_updates(params: list[Tensor], updates: list[Tensor], *, lr: float, weight_decay: float,
                  scales: list[float], compensation: str = "none", comps=None, keys=None, offsets=None) -> None:
    """``p = p * (1 - lr * weight_decay) - lr * scale * update`` for each of ``params`` (plain tensors: an FSDP2
    shard's local rows), fp32 weights in place with torch's two operations, bf16 / fp16 ones through
    :func:`.compensation.step_in_fp32` under ``compensation`` (``comps``, ``keys``, ``offsets``: as there)."""
    decay = 1 - lr * weight_decay

    def step(idx, work):
        for i, p32 in zip(idx, work):
            p32.mul_(decay).add_(updates[i], alpha=-lr * scales[i])

    step_in_fp32(params, step, compensation, comps, keys, offsets)


def muon(params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor], *, lr: float,
         weight_decay: float = 0.0, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = NS_STEPS,
         ns_coefficients=NS_COEFFICIENTS, eps: float = NS_EPS, ns_dtype: torch.dtype = torch.bfloat16,
         adjust_lr: str = "match_rms_adamw", compensation: str = "none", comps=None, keys=None, shapes=None,
         chunk: int = NS_CHUNK) -> None:
    """One Muon step of 2-D ``params`` (plain tensors on one device, or FSDP2's Shard(0) DTensors) with their
    ``grads`` and ``momentum_buffers``: fp32 tensors (plain, or DTensors placed as their parameter), or quantized
    ones (:class:`.muon8bit.QuantizedMomentum`: ``shape``, ``sharded``, ``decode()`` to this rank's fp32 rows,
    ``encode_(rows)``), decoded whole, advanced and encoded as each matrix's update is made.

    Validates everything first, then steps batch by batch, so the temporaries are one batch's (:data:`NS_CHUNK`
    elements) whatever the model: its momentum updates are written straight into the stack, orthogonalised, applied.
    Sharded parameters are orthogonalised whole on an owner rank (:mod:`._muon_sharded`), with the same numbers.

    Args:
        lr, weight_decay: the step size before :func:`update_scale`, and the decoupled decay (``p *= 1 - lr * wd``).
        momentum, nesterov: the momentum average's factor and whether the update looks ahead (torch's formulation).
        ns_steps, ns_coefficients, eps, ns_dtype: Newton-Schulz's steps, quintic, normalisation floor and dtype
            (bf16: the reference; fp32: 2x the memory traffic and several times the matmul time on GPUs).
        adjust_lr: ``"match_rms_adamw"`` (AdamW's lr and decay carry over) or ``"original"``.
        compensation, comps, keys: how bf16 / fp16 weights are written (:mod:`.compensation`): the mode, each
            tensor's Kahan buffer, its int noise key.
        shapes: each parameter's ``(rows, cols)`` for :func:`update_scale` where its storage is transposed
            (transformers' ``Conv1D`` keeps ``(in, out)``: ``"original"`` scales by rows = out); default its shape.
        chunk: elements per stacked batch.
    """
    check_muon_args(params, momentum=momentum, ns_steps=ns_steps, ns_coefficients=ns_coefficients, eps=eps,
                    ns_dtype=ns_dtype, adjust_lr=adjust_lr, compensation=compensation, shapes=shapes)
    if not len(params) == len(grads) == len(momentum_buffers):
        raise ValueError(f"Muon: {len(params)} parameters, {len(grads)} gradients, {len(momentum_buffers)} buffers")
    for i, (p, g, b) in enumerate(zip(params, grads, momentum_buffers)):
        plain = torch.is_tensor(b)  # else quantized
        if g.shape != p.shape or b.shape != p.shape or (plain and b.dtype != torch.float32):
            raise ValueError(f"Muon: parameter {i} of shape {tuple(p.shape)} has a gradient of {tuple(g.shape)} and "
                             f"a momentum buffer of {tuple(b.shape)} {b.dtype if plain else 'quantized'} (expected "
                             "its shape, fp32 or quantized)")
        if not _sharded.is_sharded(p) == _sharded.is_sharded(g) == (_sharded.is_sharded(b) if plain else b.sharded):
            raise ValueError(f"Muon: parameter {i}, its gradient and its buffer must all be DTensors or all be plain")
        _sharded.check(p, "Muon", f"parameter {i}")
    sharded = [i for i, p in enumerate(params) if _sharded.is_sharded(p)]
    if not params:
        return
    n = len(params)
    comps, keys = comps or [None] * n, keys or [0] * n
    scales = [update_scale(shapes[i] if shapes is not None else params[i].shape, adjust_lr) for i in range(n)]
    local = [_sharded.local(p).detach() for p in params]
    offsets = [_sharded.global_offset(p) for p in params] if sharded else None
    ns = dict(dtype=ns_dtype, steps=ns_steps, coefficients=tuple(ns_coefficients), eps=eps, chunk=chunk)
    orthogonalize = lambda shapes, fill, device: orthogonalized(shapes, fill, device=device, **ns)  # noqa: E731

    def fill(i, out):
        buf, grad = momentum_buffers[i], _sharded.local(grads[i])
        if torch.is_tensor(buf):
            out.copy_(momentum_update_(grad, _sharded.local(buf), momentum, nesterov))
            return
        values = buf.decode()  # the update is made from the fp32 values, then they are stored in the codec's codes
        out.copy_(momentum_update_(grad, values, momentum, nesterov))
        buf.encode_(values)

    def apply(idx, results):
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        apply_updates(pick(local), list(results), lr=lr, weight_decay=weight_decay, scales=pick(scales),
                      compensation=compensation, comps=pick(comps), keys=pick(keys),
                      offsets=None if offsets is None else pick(offsets))

    plain = [i for i in range(n) if not _sharded.is_sharded(params[i])]
    for device in {local[i].device for i in plain}:
        mine = [i for i in plain if local[i].device == device]
        for idx, results in orthogonalize([params[i].shape for i in mine], lambda j, out: fill(mine[j], out),
                                          device):
            apply([mine[j] for j in idx], results)
    if sharded:
        for idx, rows in _muon_sharded.orthogonalized_shards([params[i] for i in sharded],
                                                             lambda j, out: fill(sharded[j], out), orthogonalize,
                                                             dtype=ns_dtype, chunk=chunk):
            apply([sharded[j] for j in idx], rows)


# --- the optimizer ------------------------------------------------------------------------------------------------

NS_DTYPE_NAMES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MUON_OPTIONS = (
    Option("momentum", float, 0.95, "Muon's momentum, torch's average: buf = m * buf + (1 - m) * grad",
           check=lambda m: 0.0 <= m < 1.0, check_text="must be in [0, 1)"),
    Option("nesterov", bool, True, "Muon orthogonalises the look-ahead (1 - m) * grad + m * buf instead of buf"),
    Option("ns_steps", int, NS_STEPS, "Muon's Newton-Schulz iterations", check=lambda n: 1 <= n < 100,
           check_text="must be in [1, 100)"),
    Option("ns_dtype", str, "bf16", "Muon's Newton-Schulz dtype (bf16: the reference's; fp32: closer to exact, "
           "slower)", tuple(NS_DTYPE_NAMES)),
    Option("adjust_lr", str, "match_rms_adamw", "Muon's update scale: match_rms_adamw (0.2 * sqrt(max(rows, cols)): "
           "AdamW's lr and weight decay carry over) or original (sqrt(max(1, rows / cols)): the reference's; the same "
           "step then takes an lr 0.2 * sqrt(max(rows, cols)) times larger)", ADJUST_LR),
    Option("muon_include", str, None, "Muon: fnmatch patterns ('|'-separated) of 2-D parameters Muon takes besides "
           "the linear layers inside the model's blocks", optional=True),
    Option("muon_exclude", str, None, "Muon: fnmatch patterns ('|'-separated) of parameters AdamW takes instead "
           "(wins over muon_include)", optional=True),
)
_GROUP_OPTIONS = MUON_OPTIONS[:5]  # the hyperparameters groups carry; muon_include / muon_exclude make the groups
# Read in DeepSpeed's ZeRO optimizers: each param group is flattened into one 1-D fp32 partition per rank, and the
# wrapped optimizer steps those vectors. No matrix is left whole on any rank.
NO_ZERO = ("ZeRO flattens each param group into one 1-D partition per rank and steps the optimizer on those vectors: "
           "no matrix is left whole to orthogonalise (orthogonalising slices of a flattened vector is another "
           "optimizer, not Muon)")


def muon_required(p, group: dict) -> set[str]:
    """The state keys a parameter of ``group`` always holds: Muon's (``muon``) or AdamW's, and Kahan's buffer where
    the group compensates by it."""
    keys = {"step", "momentum_buffer"} if group.get("muon") else {"step", "exp_avg", "exp_avg_sq"}
    return keys | kahan_keys(p, group)


def muon_groups(model, weight_decay: float, split, options: dict) -> list[dict]:
    """How ``create_optimizer`` groups a module for a Muon name: :func:`..param_groups.build_muon_param_groups`
    under the options ``decay_embeddings``, ``muon_include`` and ``muon_exclude``."""
    return build_muon_param_groups(model, weight_decay, options["decay_embeddings"], options["muon_include"],
                                   options["muon_exclude"], split=split)


MOMENTUM_KEY = StateKey("param", signed=True, label="Muon momentum")
MUON = Family("muon", {"step": STEP, "momentum_buffer": MOMENTUM_KEY, "exp_avg": FIRST_MOMENT,
                       "exp_avg_sq": SECOND_MOMENT, "kahan_comp": KAHAN},
              "muon", muon_required, options=MUON_OPTIONS, deepspeed=NO_ZERO, param_groups=muon_groups)


def check_muon_group(group: dict, owner: str) -> None:
    """A param group (completed by the optimizer's defaults) that Muon's classes can step, or a ValueError naming the
    value: its ``muon`` flag, its ``transposed`` flag, the options it carries, and, in a Muon group, 2-D parameters."""
    flag = group.get("muon")
    if not isinstance(flag, bool):
        raise ValueError(f"{owner}: each param group says whether Muon steps it, 'muon': True (its matrices) or False "
                         f"(AdamW steps it); got muon={flag!r}. hf_efficient.build_muon_param_groups(model) splits a "
                         "model so (create_optimizer and the Trainer do it from the model)")
    if not isinstance(group.get("transposed", False), bool):
        raise ValueError(f"{owner}: invalid transposed={group['transposed']!r}: expected True (matrices stored as "
                         "(in, out), transformers' Conv1D) or False")
    for option in _GROUP_OPTIONS:
        if option.name in group:
            option.check_value(group[option.name], owner)
    for i, p in enumerate(group.get("params", ()) if flag else ()):
        if torch.is_tensor(p) and p.ndim != 2:
            raise ValueError(f"{owner}: parameter {i} of a Muon group ('muon': True) has shape {tuple(p.shape)}: Muon "
                             "orthogonalises matrices; put it in a group with 'muon': False (AdamW steps it)")


class MuonSteps:
    """What both Muon classes add to their AdamW class (mixed in before it): the groups marked ``"muon"`` stepped by
    :func:`muon`, the others by the AdamW class's own ``_step_group``, in group order. A class gives
    :meth:`_muon_state` (a Muon parameter's state, made at its first step) and, where its momentum is not an fp32
    tensor, :meth:`_momentum`."""

    # "muon": no default (None), each group says; kept among the defaults so that saved groups keep it when checked
    MUON_DEFAULTS = {o.name: o.default for o in _GROUP_OPTIONS} | {"transposed": False, "muon": None}

    def _muon_state(self, p: Tensor, group: dict) -> dict:
        raise NotImplementedError

    def _momentum(self, p: Tensor, group: dict, state: dict):
        return state["momentum_buffer"]

    @classmethod
    def check_muon_keys(cls, group: dict) -> None:
        check_muon_group(group, cls.__name__)

    def takes_found_inf(self) -> bool:
        """False while a Muon matrix has a gradient: :func:`muon` reads no device-side flag, so the guard reads its
        check on the host (one sync a step, small beside Newton-Schulz); else the AdamW class's answer."""
        if any(p.grad is not None for g in self.param_groups if g["muon"] for p in g["params"]):
            return False
        return super().takes_found_inf()

    @torch.no_grad()
    def step(self, closure=None):
        owner = type(self).__name__
        loss = start_step(self, closure, owner)  # closure, then sparse gradients refused: nothing half-done
        _sharded.check_placements(self.param_groups, owner)  # every check before any group steps
        for group in self.param_groups:
            if group["muon"]:
                check_muon_args([p for p in group["params"] if p.grad is not None], **self._ns_args(group),
                                momentum=group["momentum"], compensation=group["compensation"])
        position = 0  # a parameter's index across groups, as in state_dict(): its stochastic-rounding stream
        for group in self.param_groups:
            (self._step_muon_group if group["muon"] else self._step_group)(group, position)
            position += len(group["params"])
        return loss

    @staticmethod
    def _ns_args(group: dict) -> dict:
        return dict(ns_steps=group["ns_steps"], ns_coefficients=NS_COEFFICIENTS, eps=NS_EPS,
                    ns_dtype=NS_DTYPE_NAMES[group["ns_dtype"]], adjust_lr=group["adjust_lr"])

    def _step_muon_group(self, group: dict, position: int) -> None:
        items = [(p, i) for i, p in enumerate(group["params"], position) if p.grad is not None]
        if not items:
            return
        params = [p for p, _ in items]
        states = [self._muon_state(p, group) for p in params]
        # the noise of the step about to be counted (steps live on the host: no sync), as the other families key it
        keys = [weight_key(i, int(st["step"].item()) + 1) for (_, i), st in zip(items, states)]
        muon(params, [p.grad for p in params], [self._momentum(p, group, st) for p, st in zip(params, states)],
             lr=group["lr"], weight_decay=group["weight_decay"], momentum=group["momentum"],
             nesterov=group["nesterov"], compensation=group["compensation"],
             comps=[st.get("kahan_comp") for st in states], keys=keys,
             shapes=[p.shape[::-1] for p in params] if group["transposed"] else None, **self._ns_args(group))
        for st in states:
            st["step"] += 1


class Muon(MuonSteps, AdamW):
    """Muon on the groups marked ``"muon": True``, AdamW (this package's: fp32 moments, compensated bf16/fp16
    writes) on the others; see the module docstring.

    Args:
        params: param groups, each with ``"muon": True`` (2-D parameters) or ``False``
            (:func:`..param_groups.build_muon_param_groups` makes them from a model).
        lr, weight_decay: of both halves (Muon's update scaled by ``adjust_lr``; decoupled decay ``lr * wd``).
        betas, eps: AdamW's.
        momentum, nesterov, ns_steps, ns_dtype, adjust_lr: Muon's (:data:`MUON_OPTIONS`); ``ns_dtype`` ``"bf16"`` or
            ``"fp32"``.
        compensation: how updates reach bf16 / fp16 weights (:mod:`.compensation`); default the family's.

    Example::

        opt = Muon(build_muon_param_groups(model, weight_decay=0.01), lr=2e-4, weight_decay=0.01)
    """

    FACTS = MUON

    def __init__(self, params, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, momentum: float = MUON_OPTIONS[0].default, nesterov: bool = True,
                 ns_steps: int = NS_STEPS, ns_dtype: str = "bf16", adjust_lr: str = "match_rms_adamw",
                 compensation: str = MUON.compensation):
        # set before AdamW's __init__ adds the groups: add_param_group completes each one with them
        self._muon_defaults = dict(self.MUON_DEFAULTS, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                   ns_dtype=ns_dtype, adjust_lr=adjust_lr)
        check_muon_group({**self._muon_defaults, "muon": False}, "Muon")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, compensation=compensation)
        self.defaults.update(self._muon_defaults)

    def add_param_group(self, param_group: dict) -> None:
        """As AdamW's, the group completed with Muon's defaults and checked (:func:`check_muon_group`) first."""
        if isinstance(param_group, dict):
            param_group = check_group(self, {**self._muon_defaults, **param_group}, "Muon", self.check_muon_keys)
        super().add_param_group(param_group)

    def _muon_state(self, p: Tensor, group: dict) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)  # on the host: read for the noise keys without a sync
            state["momentum_buffer"] = _sharded.zeros(p, p.shape, torch.float32)
        if group["compensation"] == "kahan" and p.dtype in LOW_PRECISION and "kahan_comp" not in state:
            state["kahan_comp"] = _sharded.zeros(p, p.shape, torch.bfloat16)
        return state
