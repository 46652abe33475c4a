"""Adafactor against transformers' Adafactor (its step-size mode), and its behaviour under misuse and overflow.

Reference: ``transformers.optimization.Adafactor(scale_parameter=False, relative_step=False)`` holds the same
math; run in float64 (weights rounded to the tested dtype after every step) it is the exact answer.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_efficient.optim.adafactor import Adafactor

LR = 1e-2
SHAPES = [(8, 16), (16,), (2, 4, 8)]  # matrix, vector, batched matrices


def _reference(params, **kw):
    from transformers.optimization import Adafactor as HFAdafactor

    return HFAdafactor(params, lr=LR, scale_parameter=False, relative_step=False, warmup_init=False, **kw)


def _pair(dtype, shapes=SHAPES, seed=0, **kw):
    """Our optimizer on ``dtype`` weights beside the reference on float64 copies of the same values (rounded to
    ``dtype`` after each step: ours rounds to nearest too, ``compensation="none"``)."""
    g = torch.Generator().manual_seed(seed)
    w0 = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    ours = [nn.Parameter(w.clone()) for w in w0]
    ref = [nn.Parameter(w.double()) for w in w0]
    return ours, Adafactor(ours, lr=LR, compensation="none", **kw), ref, _reference(ref, **kw)


def _step_both(ours, opt, ref, ref_opt, grads, dtype):
    for p, r, gr in zip(ours, ref, grads):
        p.grad, r.grad = gr.to(dtype), gr.to(dtype).double()
    opt.step()
    ref_opt.step()
    with torch.no_grad():
        for r in ref:  # the weights hold dtype values: round the reference's too
            r.copy_(r.to(dtype).double())


def _error(p, r, dtype):
    """|ours - reference| beyond one rounding of the weight, in units of lr: 1 means off by a whole update."""
    ulp = torch.finfo(dtype).eps
    return ((p.double() - r).abs() - ulp * r.abs()).clamp(min=0) / LR


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [{}, {"beta1": 0.9, "weight_decay": 0.1}], ids=["plain", "beta1-wd"])
def test_matches_transformers_adafactor(dtype, kw):
    ours, opt, ref, ref_opt = _pair(dtype, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        _step_both(ours, opt, ref, ref_opt, [torch.randn(p.shape, generator=g) for p in ours], dtype)
        for p, r in zip(ours, ref):
            assert _error(p, r, dtype).max() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("big", [2e19, 3e38])  # the square overflows fp32; the square and most sums overflow
def test_gradient_whose_square_overflows_keeps_state_and_weights_finite(dtype, big):
    ours, opt, ref, ref_opt = _pair(dtype, shapes=[(8, 16), (16,)])
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in ours]
        if i == 0:
            grads[0][2, 3] = grads[1][3] = big
        _step_both(ours, opt, ref, ref_opt, grads, dtype)
        for p in ours:
            assert p.isfinite().all()
            assert all(t.isfinite().all() for t in opt.state[p].values())
        matrix, vector = (_error(p, r, dtype) for p, r in zip(ours, ref))
        # the vector's element is clamped to 2**64, which leaves its update (g / sqrt(v) = 1) as it was
        assert vector.max() < 1e-3
        if big == 2e19:  # the row and column means of the square are within fp32: exact
            assert matrix.max() < 1e-3
        else:  # beyond fp32: the big element's row and column differ; the others stay within 10% of a step
            others = matrix[[r for r in range(8) if r != 2]][:, [c for c in range(16) if c != 3]]
            assert others.max() < 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta1", [None, 0.9])
def test_step_leaves_the_gradients_as_they_were(dtype, beta1):
    params = [nn.Parameter(torch.randn(s).to(dtype)) for s in SHAPES]
    opt = Adafactor(params, lr=LR, beta1=beta1)
    for p in params:
        p.grad = torch.randn(p.shape).to(dtype)
    before = [p.grad.clone() for p in params]
    opt.step()
    for p, g in zip(params, before):
        assert torch.equal(p.grad, g)


def test_sparse_gradient_is_refused_before_anything_is_updated():
    dense, emb = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(10, 4))
    opt = Adafactor([dense, emb], lr=LR)
    dense.grad = torch.randn(4, 4)
    emb.grad = torch.sparse_coo_tensor([[1, 3]], torch.ones(2, 4), (10, 4))
    before = dense.detach().clone()
    with pytest.raises(RuntimeError, match=r"sparse gradients \(parameter 1 of param group 0, shape \(10, 4\)\).*nothing was updated"):
        opt.step()
    assert torch.equal(dense, before) and not opt.state


def _group_error(opt_kw: dict, group: dict, match: str) -> None:
    """``group`` is refused by the constructor and by add_param_group, with ``match`` in the message."""
    with pytest.raises(ValueError, match=match):
        Adafactor([{"params": [nn.Parameter(torch.zeros(2))], **group}], **opt_kw)
    opt = Adafactor([nn.Parameter(torch.zeros(2))], **opt_kw)
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], **group})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("group, match", [
    ({"maximize": True}, r"maximize=True.*Negate the loss"),
    ({"lr": torch.tensor(1e-3)}, r"lr=tensor"),
    ({"lr": -1.0}, r"lr=-1.0"),
    ({"weight_decay": -0.1}, r"weight_decay=-0.1"),
    ({"beta1": 1.5}, r"beta1=1.5"),
    ({"clip_threshold": 0.0}, r"clip_threshold=0.0"),
    ({"decay_rate": 0.5}, r"decay_rate=0.5"),
])
def test_bad_group_is_refused_at_construction_and_in_add_param_group(group, match):
    _group_error({}, group, match)


def test_maximize_false_is_accepted():
    Adafactor([{"params": [nn.Parameter(torch.zeros(2))], "maximize": False}])


def test_duplicate_parameter_is_refused():
    p, q = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"parameter 2 of the new param group \(shape \(3,\)\) is the same tensor as parameter 0"):
        Adafactor([p, q, p])
    opt = Adafactor([q])
    with pytest.raises(ValueError, match="same tensor"):
        opt.add_param_group({"params": (x for x in (p, p))})
    with pytest.raises(ValueError, match="same tensor as parameter 0 of param group 0"):  # across groups too
        opt.add_param_group({"params": [q]})
    assert len(opt.param_groups) == 1


def test_loaded_number_step_is_accepted_like_torch():
    """torch's optimizers take a Python number as ``step`` in a loaded state and make it a tensor."""
    def run(step_as_number: bool):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(s)) for s in SHAPES]
        opt = Adafactor(params, lr=LR, beta1=0.9)
        grads = [[torch.randn(s) for s in SHAPES] for _ in range(3)]
        for p, gr in zip(params, grads[0]):
            p.grad = gr
        opt.step()
        sd = opt.state_dict()
        if step_as_number:
            for st in sd["state"].values():
                st["step"] = int(st["step"].item())
        opt.load_state_dict(sd)
        for gs in grads[1:]:
            for p, gr in zip(params, gs):
                p.grad = gr
            opt.step()
        return params, opt

    as_tensor, as_number = run(False), run(True)
    for a, b in zip(as_tensor[0], as_number[0]):
        assert torch.equal(a, b)
    assert all(torch.is_tensor(st["step"]) and st["step"].item() == 3 for st in as_number[1].state.values())


def test_a_gradient_in_another_layout_gives_the_same_step():
    w, g = torch.randn(8, 16), torch.randn(8, 16)
    a, b = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    opt_a, opt_b = Adafactor([a], lr=LR), Adafactor([b], lr=LR)
    a.grad, b.grad = g, g.t().contiguous().t()  # column-major: strides (1, 8)
    opt_a.step()
    opt_b.step()
    assert torch.equal(a, b)
