"""hf_eff_lion8bit: Lion (Chen et al. 2023) with a blockwise 8-bit momentum.

Reference: Lion in fp32 as the paper's pseudo-code and torch-optimi's ``Lion`` write it (decoupled weight decay
``p *= 1 - lr * wd``, update ``sign(beta1 * m + (1 - beta1) * g)``, then ``m = beta2 * m + (1 - beta2) * g``).
Tolerances: fp32 state follows the reference to float rounding (1e-6 relative); 8-bit state changes the sign of
an update only where ``beta1 * m + (1 - beta1) * g`` is within the 8-bit step of 0. With gradients spanning four
decades (the hard case: small gradients after large ones), after 20 steps ~7% of the weights differ from the
reference (measured), by 0.008 * lr * steps on average: bounds of 10% and 0.02, and ``2 * lr`` per step at most.
"""

from __future__ import annotations

import io

import pytest
import torch
from conftest import ClassificationSet, tiny_bert

import hf_efficient as hfe
from hf_efficient.optim import _dispatch, _native
from hf_efficient.optim.lion8bit import Lion8bit

HAS_C = _native.c_compiler() is not None
LR, WD, BETAS = 1e-3, 0.1, (0.9, 0.99)


def _reference_lion(params, grads_per_step, lr=LR, wd=WD, betas=BETAS):
    """fp32 Lion, straight from the paper (Algorithm 2 with decoupled weight decay)."""
    b1, b2 = betas
    params = [p.detach().clone().float() for p in params]
    ms = [torch.zeros_like(p) for p in params]
    for grads in grads_per_step:
        for p, g, m in zip(params, grads, ms):
            c = b1 * m + (1 - b1) * g
            p.mul_(1 - lr * wd).sub_(lr * torch.sign(c))
            m.mul_(b2).add_((1 - b2) * g)
    return params


def _problem(seed=0, shapes=((64, 80), (300, 23), (37,))):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) * 0.1 for s in shapes]
    grads = [[torch.randn(s, generator=g) * 10.0 ** -(i % 4) for s in shapes] for i in range(20)]
    return params, grads


def _run(params0, grads, steps=None, **kw):
    params = [torch.nn.Parameter(p.clone()) for p in params0]
    opt = Lion8bit(params, lr=LR, weight_decay=WD, betas=BETAS, **kw)
    for gs in grads[:steps]:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    return params, opt


def test_fp32_state_equals_the_reference():
    params0, grads = _problem()
    ours, _ = _run(params0, grads, min_8bit_size=10**9)
    for a, b in zip(ours, _reference_lion(params0, grads)):
        torch.testing.assert_close(a.detach(), b, rtol=1e-6, atol=1e-7)


def test_8bit_state_follows_the_reference():
    params0, grads = _problem()
    ours, opt = _run(params0, grads, min_8bit_size=0)
    assert all(opt.state[p]["exp_avg"].dtype == torch.uint8 for p in ours)
    for a, b in zip(ours, _reference_lion(params0, grads)):
        diff = (a.detach() - b).abs()
        assert (diff > 1e-6).float().mean() <= 0.10, (diff > 1e-6).float().mean()
        assert diff.mean() <= 0.02 * LR * len(grads) and diff.max() <= 2 * LR * len(grads)


def test_state_is_one_byte_per_element():
    p = torch.nn.Parameter(torch.zeros(1000, 256))
    p.grad = torch.ones_like(p)
    opt = Lion8bit([p])
    opt.step()
    st = opt.state[p]
    assert set(st) == {"step", "exp_avg", "exp_avg_absmax"}
    assert st["exp_avg"].numel() == p.numel() and st["exp_avg_absmax"].numel() == 1000
    assert hfe.optimizer_state_bytes(opt) == p.numel() + 4 * 1000 + 4


@pytest.mark.skipif(not HAS_C, reason="no C compiler: the C kernel is not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kernel_equals_compiled_and_eager(dtype, monkeypatch):
    """The C kernel (op hf_efficient::lion8bit_step), the compiled kernel and the eager one: the same codes,
    absmaxes and weights (Lion has no sqrt: bitwise)."""
    assert Lion8bit.native_fn() is not None, "the C kernel's probe failed"
    params0, grads = _problem(shapes=((64, 80), (300, 23), (2 * 65536 + 999,)))
    params0 = [p.to(dtype) for p in params0]
    grads = [[g.to(dtype) for g in gs] for gs in grads]
    calls = []
    real = Lion8bit.run_native
    monkeypatch.setattr(Lion8bit, "run_native", classmethod(
        lambda cls, fn, ps, *rest: (calls.append(len(ps)), real(fn, ps, *rest))))
    runs = [_run(params0, grads, steps=4, min_8bit_size=0, compile=c) for c in (None, True, False)]
    assert calls == [3] * 4
    (pn, on), *others = runs
    for po, oo in others:
        for a, b in zip(pn, po):
            assert torch.equal(a, b)
            assert all(torch.equal(v, oo.state[b][k]) for k, v in on.state[a].items())


def test_the_op_is_registered():
    assert hasattr(torch.ops.hf_efficient, "lion8bit_step")


def test_exact_resume_and_weights_only_loading():
    params0, grads = _problem()
    straight, _ = _run(params0, grads, steps=6, min_8bit_size=0)
    first, opt = _run(params0, grads, steps=3, min_8bit_size=0)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert sd["state"][0]["exp_avg"].shape == first[0].shape  # canonical layout
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = Lion8bit(resumed, lr=LR, weight_decay=WD, betas=BETAS, min_8bit_size=0)
    opt2.load_state_dict(sd)
    for gs in grads[3:6]:
        for p, g in zip(resumed, gs):
            p.grad = g.clone()
        opt2.step()
    for a, b in zip(resumed, straight):
        assert torch.equal(a, b)


def test_bad_state_is_refused_before_anything_changes():
    params0, grads = _problem()
    ps, opt = _run(params0, grads, steps=2, min_8bit_size=0)
    sd = opt.state_dict()
    sd["state"][0]["exp_avg_absmax"] = sd["state"][0]["exp_avg_absmax"][:-1]
    before = {k: v.clone() for k, v in opt.state[ps[0]].items()}
    with pytest.raises(ValueError, match="exp_avg_absmax .* one absmax per block"):
        opt.load_state_dict(sd)
    assert all(torch.equal(v, opt.state[ps[0]][k]) for k, v in before.items())


def test_zero_gradients_do_not_blow_up():
    """A zero gradient on a zero momentum: sign 0, the weight only decays; after real steps, zero gradients move
    each weight by at most lr per step (Lion's update is bounded), never by lr / eps as an AdamW could."""
    p = torch.nn.Parameter(torch.randn(4096) * 0.1)
    opt = Lion8bit([p], lr=LR, weight_decay=0.0, min_8bit_size=0)
    p.grad = torch.zeros_like(p)
    before = p.detach().clone()
    opt.step()
    assert torch.equal(p.detach(), before)
    p.grad = torch.randn(4096)
    opt.step()
    for _ in range(5):
        before = p.detach().clone()
        p.grad = torch.zeros_like(p)
        opt.step()
        assert p.isfinite().all() and (p.detach() - before).abs().max() <= LR + 1e-7  # + rounding


def test_cross_backend_checkpoint_with_bitsandbytes(tmp_path):
    """Our state loads into bitsandbytes' Lion8bit and back (same codes, maps and blocks): both continue alike."""
    pytest.importorskip("bitsandbytes")
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    x = torch.randn(16, 64)

    def train(opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

    ours = hfe.create_optimizer(model, "lion8bit", lr=1e-3, weight_decay=0.1, min_8bit_size=4096)
    train(ours, 2)
    sd = ours.state_dict()
    theirs = hfe.create_optimizer(model, "lion8bit", lr=1e-3, weight_decay=0.1, min_8bit_size=4096, backend="bnb")
    theirs.load_state_dict(sd)
    back = hfe.create_optimizer(model, "lion8bit", lr=1e-3, weight_decay=0.1, min_8bit_size=4096)
    back.load_state_dict(theirs.state_dict())
    a, b = ours.state_dict()["state"], back.state_dict()["state"]
    assert any("exp_avg_absmax" in st for st in a.values())  # the weights' state is 8-bit, the biases' 32-bit
    for i in a:
        assert a[i].keys() == b[i].keys(), i
        for k in a[i]:
            assert torch.equal(torch.as_tensor(a[i][k]), torch.as_tensor(b[i][k])), (i, k)
    train(theirs, 1)  # bitsandbytes continues from our state


def test_decay_groups_and_registry_facts():
    model = tiny_bert()
    opt = hfe.create_optimizer(model, "hf_eff_lion8bit", lr=1e-4, weight_decay=0.1)
    wd = {n: g["weight_decay"] for g in opt.param_groups for n in g["param_names"]}
    assert wd["bert.embeddings.word_embeddings.weight"] == 0.1
    assert wd["bert.embeddings.LayerNorm.weight"] == 0.0
    assert hfe.resolve("lion8bit", device="cpu").optimizer_cls is Lion8bit
    assert hfe.estimate_memory(10**6, "lion8bit").state_bytes < 0.55 * hfe.estimate_memory(10**6, "adam8bit").state_bytes


def test_trainer_trains_with_hf_eff_lion8bit(tmp_path):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(str(tmp_path), optim="hf_eff_lion8bit", learning_rate=1e-3, weight_decay=0.01,
                             max_steps=16, per_device_train_batch_size=8, logging_steps=1, report_to=[], use_cpu=True,
                             disable_tqdm=True, save_strategy="no", seed=0, data_seed=0)
    trainer = Trainer(model=tiny_bert(), args=args, train_dataset=ClassificationSet())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert sum(losses[-4:]) < 0.9 * sum(losses[:4]), losses
    assert hfe.optimizer_info(trainer.optimizer).resolution.optimizer_cls is Lion8bit


def test_failed_compile_falls_back_to_eager(monkeypatch):
    def broken(*args, **kwargs):
        def fail(*a, **k):
            raise torch._inductor.exc.InductorError(RuntimeError("no C++ compiler here"), None)
        return fail

    monkeypatch.setattr(_dispatch, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", broken)
    params0, grads = _problem()
    a, oa = _run(params0, grads, steps=2, min_8bit_size=0, compile=True)
    b, ob = _run(params0, grads, steps=2, min_8bit_size=0, compile=False)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
