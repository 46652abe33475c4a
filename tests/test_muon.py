"""Muon's functional core (hf_efficient/optim/muon.py) against torch.optim.Muon and a float64 reference.

Tolerances, per step of ``lr * scale`` (what one orthogonalised entry of size 1 would move a weight; the entries of
these updates are below 0.5):

* against ``torch.optim.Muon`` (bf16 Newton-Schulz both): 2**-6. The same operations in another grouping (a batch,
  a contiguous transpose) may sum in another order (on this CPU they do not: the weights come out equal), which
  flips a bf16 rounding inside Newton-Schulz now and then; one-ulp changes of 10% of the input's entries, far more
  than a reordered fp32 sum flips, moved the output by 2**-7 to 2**-6 (entries up to 0.45). The update's entries
  are ~0.15, so a weight moves ~10x the bound in these steps, and the variant without Nesterov fails it. The
  momentum buffers are the same elementwise operations: equal exactly.
* against float64 (fp32 Newton-Schulz): 1e-5 (measured: ~6e-7, ~20 fp32 ulps of the largest entry, after the 15
  matmuls of 5 steps).
* bf16 Newton-Schulz against float64: 2**-5 (measured up to 2**-7: bf16's own error, which the reference accepts).
"""

from __future__ import annotations

import pytest
import torch

from hf_efficient.optim.compensation import weight_key
from hf_efficient.optim.muon import (NS_COEFFICIENTS, muon, newton_schulz_, orthogonalized, same_shape_batches,
                                     update_scale)

# tall (transposed for Newton-Schulz), wide, square; two same-shaped pairs (batched together); a thin one
SHAPES = [(48, 16), (48, 16), (16, 40), (24, 24), (24, 24), (3, 64), (64, 3)]
LR, WD, STEPS = 0.02, 0.1, 4
TORCH_TOL, F64_TOL, BF16_F64_TOL = 2**-6, 1e-5, 2**-5


def _grads(seed: int, shapes=SHAPES, steps=STEPS):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]


def _weights(shapes=SHAPES, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(s, generator=g) * 0.1).to(dtype) for s in shapes]


def _run_ours(weights, grads, **kw) -> tuple[list, list]:
    params, bufs = [w.clone() for w in weights], [torch.zeros(w.shape) for w in weights]
    for step in grads:
        muon(params, step, bufs, lr=LR, weight_decay=WD, **kw)
    return params, bufs


def _bound(tol: float, adjust_lr: str = "match_rms_adamw", steps: int = STEPS):
    return [steps * LR * update_scale(s, adjust_lr) * tol for s in SHAPES]


@pytest.mark.parametrize("adjust_lr,nesterov,ns_steps", [("match_rms_adamw", True, 5), ("original", True, 5),
                                                         ("match_rms_adamw", False, 3)])
def test_equals_torch_muon_to_bf16_rounding(adjust_lr, nesterov, ns_steps):
    weights, grads = _weights(), _grads(1)
    ref = [w.clone().requires_grad_() for w in weights]
    opt = torch.optim.Muon(ref, lr=LR, weight_decay=WD, nesterov=nesterov, ns_steps=ns_steps, adjust_lr_fn=adjust_lr)
    ours, bufs = [w.clone() for w in weights], [torch.zeros(w.shape) for w in weights]
    for step in grads:
        for p, g in zip(ref, step):
            p.grad = g.clone()
        opt.step()
        muon(ours, step, bufs, lr=LR, weight_decay=WD, nesterov=nesterov, ns_steps=ns_steps, adjust_lr=adjust_lr)
        for b, p in zip(bufs, ref):
            assert torch.equal(b, opt.state[p]["momentum_buffer"])
    other, _ = _run_ours(weights, grads, nesterov=not nesterov, ns_steps=ns_steps, adjust_lr=adjust_lr)
    for mine, theirs, start, wrong, bound in zip(ours, ref, weights, other, _bound(TORCH_TOL, adjust_lr)):
        assert (mine - theirs.detach()).abs().max() <= bound
        assert (mine - start).abs().max() > 5 * bound and (wrong - theirs.detach()).abs().max() > bound


def _reference_f64(weights, grads, *, momentum=0.95, nesterov=True, steps=5, adjust_lr="match_rms_adamw"):
    """The same math in float64, matrix by matrix, written out independently of the module."""
    a, b, c = NS_COEFFICIENTS
    params, bufs = [w.double() for w in weights], [torch.zeros(w.shape, dtype=torch.float64) for w in weights]
    for step in grads:
        for i, g in enumerate(step):
            g = g.double()
            bufs[i] = momentum * bufs[i] + (1 - momentum) * g
            u = (1 - momentum) * g + momentum * bufs[i] if nesterov else bufs[i]
            x = u.T if u.shape[0] > u.shape[1] else u
            x = x / max(x.norm().item(), 1e-7)
            for _ in range(steps):
                gram = x @ x.T
                x = a * x + (b * gram + c * gram @ gram) @ x
            o = x.T if u.shape[0] > u.shape[1] else x
            rows, cols = u.shape
            scale = 0.2 * max(rows, cols) ** 0.5 if adjust_lr == "match_rms_adamw" else max(1, rows / cols) ** 0.5
            params[i] = params[i] * (1 - LR * WD) - LR * scale * o
    return params


@pytest.mark.parametrize("ns_dtype,tol", [(torch.float32, F64_TOL), (torch.bfloat16, BF16_F64_TOL)])
def test_equals_float64_reference(ns_dtype, tol):
    weights, grads = _weights(), _grads(2)
    ours, _ = _run_ours(weights, grads, ns_dtype=ns_dtype)
    for mine, ref, bound in zip(ours, _reference_f64(weights, grads), _bound(tol)):
        assert (mine.double() - ref).abs().max() <= bound


def test_batched_equals_one_by_one_bit_for_bit():
    """Each matrix's numbers do not depend on its batch: what lets an FSDP2 owner orthogonalise a subset of a
    one-process batch and get the same bits (and a chunked model equal an unchunked one)."""
    g = torch.Generator().manual_seed(3)
    shapes = [(32, 20)] * 5 + [(20, 32)] * 3 + [(17, 17)] * 2
    us = [torch.randn(s, generator=g) for s in shapes]

    def run(chunk):
        out = {}
        for idx, results in orthogonalized(shapes, lambda i, o: o.copy_(us[i]), device="cpu", chunk=chunk):
            out.update({i: r.clone() for i, r in zip(idx, results)})
        return [out[i] for i in range(len(shapes))]

    whole, single, pairs = run(1 << 20), run(1), run(2 * 32 * 20)
    for a, b, c in zip(whole, single, pairs):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_batches_are_same_shaped_and_bounded():
    shapes = [(4, 4), (2, 8), (4, 4), (100, 100), (4, 4), (2, 8)]
    sizes = [r * c for r, c in shapes]
    batches = same_shape_batches(shapes, sizes, chunk=40)
    assert batches == [[0, 2], [4], [1, 5], [3]]  # 2 x 16 <= 40; 100 x 100 alone
    assert sorted(i for b in batches for i in b) == list(range(len(shapes)))


def test_chunked_step_equals_unchunked_and_transposed_storage_is_the_transpose():
    weights, grads = _weights(), _grads(4, steps=2)
    a, _ = _run_ours(weights, grads)
    b, _ = _run_ours(weights, grads, chunk=1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # a weight stored (in, out), as transformers' Conv1D, is stacked as the same matrix: the same bits, transposed
    u = torch.randn(40, 16)
    x, y = torch.empty(1, 16, 40), torch.empty(1, 16, 40)
    x[0].copy_(u.T)
    y[0].copy_(u.T.contiguous())
    assert torch.equal(newton_schulz_(x.bfloat16()), newton_schulz_(y.bfloat16()))


def test_ns_output_is_near_orthogonal():
    """Newton-Schulz's quintic leaves singular values in about (0.7, 1.2), not exactly 1 (the reference's choice)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 32, 80, generator=g)
    sv = torch.linalg.svdvals(newton_schulz_(x.clone()).double())
    assert sv.min() > 0.6 and sv.max() < 1.25


@pytest.mark.parametrize("mode", ["stochastic", "kahan", "none"])
def test_bf16_weights_go_through_compensation(mode):
    """Updates far below half a bf16 ulp: rounded to nearest (none) the weights never move (stale weights);
    stochastic rounding moves them as fp32 weights move, on average; Kahan's weight plus its buffer moves as they do."""
    # a rank-1 gradient orthogonalises to entries ~0.7 / sqrt(32 * 64) (its one singular value ends near 0.7): steps
    # of lr * 0.2 * 8 * 0.016 ~ 2.5e-4, a sixteenth of half a bf16 ulp (2**-8) of weights in [1, 1.5); the same
    # direction every step, so the drift adds up to ~1.3 ulps
    shape, steps, lr = (32, 64), 40, 1e-2
    start = (1 + torch.rand(shape, generator=torch.Generator().manual_seed(6)) * 0.5).bfloat16().float()
    grads = [torch.ones(shape)] * steps
    p32, b32 = start.clone(), torch.zeros(shape)
    p16, b16 = start.to(torch.bfloat16), torch.zeros(shape)
    comp = torch.zeros(shape, dtype=torch.bfloat16)
    for t, g in enumerate(grads):
        muon([p32], [g], [b32], lr=lr)
        muon([p16], [g.bfloat16()], [b16], lr=lr, compensation=mode, comps=[comp], keys=[weight_key(0, t + 1)])
    held = p16.float() + (comp.float() if mode == "kahan" else 0)  # Kahan: the weight plus what it still owes
    drift32, drift16 = (p32 - start).mean(), (held - start).mean()
    assert drift32 < -5e-3  # the fp32 weights moved (~1.3 ulps)
    if mode == "none":
        assert drift16 == 0
    else:
        assert abs(drift16 / drift32 - 1) < (0.05 if mode == "stochastic" else 0.01)


def test_bad_input_is_refused_before_anything_changes():
    weights, grads = _weights(), _grads(7, steps=1)[0]
    params, bufs = [w.clone() for w in weights], [torch.zeros(w.shape) for w in weights]
    bad = [torch.zeros(5)]
    cases = [(dict(params=params + bad, grads=grads + bad, momentum_buffers=bufs + bad), "matrices"),
             (dict(adjust_lr="rms"), "adjust_lr"), (dict(ns_dtype=torch.float16), "ns_dtype"),
             (dict(momentum=1.0), "momentum"), (dict(compensation="round"), "compensation"),
             (dict(ns_steps=0), "ns_steps"), (dict(grads=grads[:-1] + [grads[0]]), "gradient of"),
             (dict(momentum_buffers=bufs[:-1] + [bufs[-1].double()]), "momentum buffer")]
    for kw, match in cases:
        args = dict(params=params, grads=grads, momentum_buffers=bufs, lr=LR) | kw
        with pytest.raises(ValueError, match=match):
            muon(**args)
    assert all(torch.equal(p, w) for p, w in zip(params, weights)) and all(not b.any() for b in bufs)
