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

from helpers import muon_f64
from hf_efficient.optim.compensation import weight_key
from hf_efficient.optim.muon import muon, newton_schulz_, orthogonalized, same_shape_batches, update_scale

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


def _reference_f64(weights, grads, **kw):
    params, bufs = [w.double() for w in weights], [torch.zeros(w.shape, dtype=torch.float64) for w in weights]
    for step in grads:
        muon_f64(params, step, bufs, lr=LR, weight_decay=WD, **kw)
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


# --- the optimizer: hf_eff_muon (optim/muon.py's class), built by create_optimizer ----------------------------------
#
# Tolerances of the class, per step of lr * scale as above: its Muon half is muon() (TORCH_TOL against
# torch.optim.Muon, F64_TOL against float64 with fp32 Newton-Schulz); its AdamW half is hf_eff_adamw's code, torch's
# fused kernel on fp32 weights: equal to torch.optim.AdamW(fused=True) bit for bit, and within a float64 AdamW by
# the fp32 weight's rounding (a spacing a step) and 1e-6 of a step (fp32 moments over 4 steps).

def _llama_grads(model, steps: int, seed: int = 8) -> list[dict]:
    """Gradients for every parameter of ``model``, by name: the same for every optimizer compared (a trajectory that
    differs by a rounding would otherwise feed back into the gradients)."""
    g = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()} for _ in range(steps)]


def _set_grads(model, grads: dict) -> None:
    for n, p in model.named_parameters():
        p.grad = grads[n].to(p.dtype).clone()


def _split_names(opt) -> tuple[set, set]:
    muon_names = {n for g in opt.param_groups if g["muon"] for n in g["param_names"]}
    adamw_names = {n for g in opt.param_groups if not g["muon"] for n in g["param_names"]}
    return muon_names, adamw_names


def test_the_package_splits_a_transformer():
    import hf_efficient as hfe
    from conftest import tiny_llama

    model = tiny_llama()
    opt = hfe.create_optimizer(model, "muon", lr=1e-3, weight_decay=0.1)
    muon_names, adamw_names = _split_names(opt)
    assert muon_names == {n for n, p in model.named_parameters() if ".layers." in n and p.ndim == 2}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= adamw_names
    decay = {n for g in opt.param_groups if g["weight_decay"] == 0.1 for n in g["param_names"]}
    assert muon_names <= decay and "model.norm.weight" not in decay and "model.embed_tokens.weight" in decay
    assert isinstance(opt, torch.optim.AdamW) and type(opt).__name__ == "Muon"


def test_class_equals_torch_muon_and_adamw_on_the_same_split():
    import hf_efficient as hfe
    from conftest import tiny_llama

    ours, theirs = tiny_llama(), tiny_llama()
    opt = hfe.create_optimizer(ours, "muon", lr=LR, weight_decay=WD)
    named = dict(theirs.named_parameters())
    ref_muon = torch.optim.Muon([{"params": [named[n] for n in g["param_names"]], "weight_decay": g["weight_decay"]}
                                 for g in opt.param_groups if g["muon"]], lr=LR, adjust_lr_fn="match_rms_adamw")
    ref_adamw = torch.optim.AdamW([{"params": [named[n] for n in g["param_names"]], "weight_decay": g["weight_decay"]}
                                   for g in opt.param_groups if not g["muon"]], lr=LR, fused=True)
    muon_names, adamw_names = _split_names(opt)
    mine = dict(ours.named_parameters())
    for grads in _llama_grads(ours, STEPS):
        _set_grads(ours, grads)
        _set_grads(theirs, grads)
        opt.step()
        ref_muon.step()
        ref_adamw.step()
        for n in muon_names:  # momentum: the same elementwise operations on the same gradients
            assert torch.equal(opt.state[mine[n]]["momentum_buffer"], ref_muon.state[named[n]]["momentum_buffer"])
    for n in adamw_names:
        assert torch.equal(mine[n], named[n]), n
    for n in muon_names:
        bound = STEPS * LR * update_scale(named[n].shape) * TORCH_TOL
        assert (mine[n] - named[n]).abs().max() <= bound, n


def test_class_equals_float64_reference():
    """ns_dtype=fp32: the Muon half against helpers.muon_f64, the AdamW half against torch's AdamW in float64."""
    import hf_efficient as hfe
    from conftest import tiny_llama

    model = tiny_llama()
    opt = hfe.create_optimizer(model, "muon", lr=LR, weight_decay=WD, ns_dtype="fp32")
    named = dict(model.named_parameters())
    ref = {n: p.detach().double() for n, p in named.items()}
    bufs = {n: torch.zeros_like(r) for n, r in ref.items()}
    adamw = torch.optim.AdamW([{"params": [ref[n] for n in g["param_names"]], "weight_decay": g["weight_decay"]}
                               for g in opt.param_groups if not g["muon"]], lr=LR, foreach=False)
    muon_names, adamw_names = _split_names(opt)
    decay = {n: g["weight_decay"] for g in opt.param_groups for n in g["param_names"]}
    for grads in _llama_grads(model, STEPS, seed=9):
        _set_grads(model, grads)
        opt.step()
        for n in muon_names:
            muon_f64([ref[n]], [grads[n]], [bufs[n]], lr=LR, weight_decay=decay[n])
        for n in adamw_names:
            ref[n].grad = grads[n].double()
        adamw.step()
    for n in muon_names:
        assert (named[n].double() - ref[n]).abs().max() <= STEPS * LR * update_scale(ref[n].shape) * F64_TOL, n
    for n in adamw_names:  # the fp32 weight's own rounding (a spacing a step), and the moments' (1e-6 of a step)
        tol = STEPS * (torch.finfo(torch.float32).eps * ref[n].abs().max() + LR * 1e-6)
        assert (named[n].double() - ref[n]).abs().max() <= tol, n


def test_conv1d_weights_are_stepped_as_stored_and_scaled_as_linear_layers():
    """GPT-2's Conv1D keeps (in, out): Muon orthogonalises it as stored (the same bits transposed) and adjust_lr=original
    scales it by its output features, as nn.Linear's (out, in)."""
    import hf_efficient as hfe
    from conftest import tiny_gpt2

    model = tiny_gpt2()
    opt = hfe.create_optimizer(model, "muon", lr=LR, weight_decay=0.0, adjust_lr="original")
    group = next(g for g in opt.param_groups if g["muon"])
    assert group["transposed"] and all(g["transposed"] == g["muon"] for g in opt.param_groups if g["muon"])
    c_attn = model.transformer.h[0].attn.c_attn.weight  # (64, 192): in 64, out 192
    start = c_attn.detach().clone()
    grad = torch.randn(c_attn.shape, generator=torch.Generator().manual_seed(10))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    c_attn.grad = grad.clone()
    opt.step()
    ref, buf = start.double().T.contiguous(), torch.zeros(192, 64, dtype=torch.float64)  # as nn.Linear would hold it
    muon_f64([ref], [grad.T], [buf], lr=LR, weight_decay=0.0, adjust_lr="original")
    assert (c_attn.double() - ref.T).abs().max() <= LR * update_scale((192, 64), "original") * BF16_F64_TOL
    assert update_scale((192, 64), "original") == 3**0.5  # not (64, 192)'s 1


def test_options_reach_the_groups_and_bad_ones_are_refused_before_anything_is_built():
    import hf_efficient as hfe
    from conftest import tiny_llama
    from hf_efficient.integrations.transformers import check_optim_args

    model = tiny_llama()
    opt = hfe.create_optimizer(model, "hf_eff_muon", lr=1e-3, momentum=0.9, nesterov=False, ns_steps=3,
                               ns_dtype="fp32", adjust_lr="original", muon_exclude="*.q_proj.weight")
    muon_group = next(g for g in opt.param_groups if g["muon"])
    assert (muon_group["momentum"], muon_group["nesterov"], muon_group["ns_steps"], muon_group["ns_dtype"],
            muon_group["adjust_lr"]) == (0.9, False, 3, "fp32", "original")
    assert not any(n.endswith("q_proj.weight") for n in _split_names(opt)[0])
    check_optim_args("hf_eff_muon", "ns_dtype=fp32,muon_include=model.embed_tokens.weight|lm_head.weight")
    for bad, match in [(dict(ns_dtype="fp16"), "ns_dtype.*'bf16', 'fp32'"), (dict(momentum=1.0), r"momentum.*\[0, 1\)"),
                       (dict(adjust_lr="rms"), "adjust_lr"), (dict(ns_steps=0), "ns_steps"),
                       (dict(muon_include="*.qproj.weight"), "pattern '\\*.qproj.weight' matches no 2-D")]:
        with pytest.raises(ValueError, match=match):
            hfe.create_optimizer(model, "muon", lr=1e-3, **bad)
    with pytest.raises(ValueError, match="each param group says whether Muon steps it.*build_muon_param_groups"):
        hfe.create_optimizer(model.parameters(), "muon", lr=1e-3)  # bare parameters: no way to tell a hidden matrix


def test_bf16_model_resumes_exactly_through_torch_save():
    """bf16 weights, stochastic rounding (the default): 2 steps, state_dict through torch.save / torch.load
    (weights_only), 2 more == 4 uninterrupted, bit for bit."""
    import io

    import hf_efficient as hfe
    from conftest import tiny_llama

    grads = _llama_grads(tiny_llama(), 4, seed=11)

    def run(model, opt, steps):
        for g in steps:
            _set_grads(model, g)
            opt.step()

    full = tiny_llama().bfloat16()
    full_opt = hfe.create_optimizer(full, "muon", lr=LR, weight_decay=WD)
    run(full, full_opt, grads)
    assert full_opt.hf_efficient.options["compensation"] == "stochastic"
    half = tiny_llama().bfloat16()
    opt = hfe.create_optimizer(half, "muon", lr=LR, weight_decay=WD)
    run(half, opt, grads[:2])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    resumed_model = tiny_llama().bfloat16()
    resumed_model.load_state_dict(half.state_dict())
    resumed = hfe.create_optimizer(resumed_model, "muon", lr=LR, weight_decay=WD)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    run(resumed_model, resumed, grads[2:])
    for (n, a), b in zip(full.named_parameters(), resumed_model.parameters()):
        assert torch.equal(a, b), n


def test_another_family_s_checkpoint_is_refused():
    """AdamW's moments are not Muon's state (the Muon half would start from nothing): refused with the package's
    message, before anything is loaded."""
    import hf_efficient as hfe
    from conftest import tiny_llama

    model = tiny_llama()
    adamw = hfe.create_optimizer(model, "adamw", lr=1e-3)
    _set_grads(model, _llama_grads(model, 1)[0])
    adamw.step()
    opt = hfe.create_optimizer(model, "muon", lr=1e-3)
    with pytest.raises(ValueError, match="written by hf_eff_adamw .*cannot be loaded into hf_eff_muon"):
        opt.load_state_dict(adamw.state_dict())
    assert not opt.state
