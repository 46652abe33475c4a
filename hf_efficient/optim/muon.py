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
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
from torch import Tensor

from . import _muon_sharded, _sharded
from .compensation import check_compensation, step_in_fp32

__all__ = ["muon", "momentum_update_", "newton_schulz_", "orthogonalized", "same_shape_batches", "update_scale",
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
    ``grads`` and fp32 ``momentum_buffers`` (plain, or DTensors placed as their parameter).

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
        if g.shape != p.shape or b.shape != p.shape or b.dtype != torch.float32:
            raise ValueError(f"Muon: parameter {i} of shape {tuple(p.shape)} has a gradient of {tuple(g.shape)} and "
                             f"a momentum buffer of {tuple(b.shape)} {b.dtype} (expected its shape, fp32)")
        if not _sharded.is_sharded(p) == _sharded.is_sharded(g) == _sharded.is_sharded(b):
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
        out.copy_(momentum_update_(_sharded.local(grads[i]), _sharded.local(momentum_buffers[i]), momentum, nesterov))

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
