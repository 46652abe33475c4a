"""Non-finite gradients: ``nonfinite=raise`` refuses before touching anything, ``skip`` counts and training goes on,
``ignore`` is torch's behaviour; large finite gradients are not taken for overflow; a GradScaler's overflow step is
skipped by the scaler (by hand and in the Trainer); under FSDP2 every rank enters the agreement.

Cases over every name/backend come from tests/cases.py (the registry). "Nothing half-applied" compares
:func:`helpers.snapshot` before and after the refused step.
"""

import logging

import pytest
import torch
from torch import nn

import hf_efficient as hfe

from cases import CASES, names, spec_of
from helpers import INF, NAN, assert_unchanged, loss_of, make, snapshot, train


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_nonfinite_raise_refuses_before_touching_state(name, backend, dtype, compensation):
    model, opt = make(name, backend, dtype, compensation=compensation)
    train(model, opt, 2)
    snap = snapshot(model, opt)
    loss_of(model).backward()
    model.out.weight.grad[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match=r"'out.weight' at step 3; nothing was updated.*nonfinite=skip"):
        opt.step()
    assert_unchanged(model, opt, snap)


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_nonfinite_skip_counts_and_training_goes_on(name, backend, dtype, compensation, caplog):
    model, opt = make(name, backend, dtype, compensation=compensation, nonfinite="skip")
    train(model, opt, 2)
    snap = snapshot(model, opt)
    loss_of(model).backward()
    model.fc.weight.grad[3, 3] = float("nan")
    with caplog.at_level(logging.WARNING, logger="hf_efficient.guard"):
        opt.step()
    assert "step 3 skipped" in caplog.text and "'fc.weight'" in caplog.text
    opt.zero_grad()
    params_before = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(params_before, snap[0]))
    assert hfe.optimizer_info(opt).skipped_steps == 1
    train(model, opt, 1, start=5)  # a finite step proceeds and changes weights, state stays finite
    assert not torch.equal(model.fc.weight, params_before[1])
    for st in opt.state_dict()["state"].values():
        for v in st.values():
            if torch.is_tensor(v) and v.is_floating_point():
                assert torch.isfinite(v).all()
    assert opt.state_dict()["hf_efficient"]["skipped_steps"] == 1


def test_nonfinite_ignore_is_torchs_behaviour():
    model, opt = make("adamw", None, torch.float32, nonfinite="ignore")
    loss_of(model).backward()
    model.fc.weight.grad[0, 0] = float("nan")
    opt.step()
    assert torch.isnan(model.fc.weight[0, 0])


@pytest.mark.parametrize("name,dtype,big", [  # every name on the weights it is made for; fp16's largest too
    pytest.param(p.values[0], spec_of(p.values[0]).facts.param_dtype, 1.8e19, marks=p.marks, id=p.id)
    for p in names()] + [pytest.param("adamw_bf16", torch.float16, 6e4, id="adamw_bf16-fp16")])
def test_large_finite_gradients_are_not_mistaken_for_overflow(name, dtype, big):
    """The largest gradients whose square is finite (below 2**64; fp16's largest) train; from 2**64 on (the square
    overflows fp32, the second moment would be inf) a finite gradient is refused like an inf."""
    model, opt = make(name, None, dtype)
    loss_of(model).backward()
    model.fc.weight.grad.fill_(big)
    opt.step()  # nonfinite=raise must not raise
    assert torch.isfinite(model.fc.weight).all()
    for st in opt.state_dict()["state"].values():
        assert all(torch.isfinite(v).all() for v in st.values() if torch.is_tensor(v) and v.is_floating_point())
    for huge in ([2e19, 3e38] if dtype != torch.float16 else []) + [float("inf")]:
        loss_of(model).backward()
        model.fc.weight.grad.fill_(big)
        model.fc.weight.grad[3, 5] = huge
        snap = snapshot(model, opt)
        with pytest.raises(FloatingPointError, match="fc.weight"):
            opt.step()
        assert_unchanged(model, opt, snap)
        opt.zero_grad()


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_grad_scaler_skips_overflow_steps_for_every_name(name, backend, dtype, compensation):
    """fp16-style loss scaling: an overflow step is skipped by the scaler (scale halved, nothing updated, no
    FloatingPointError), and the next finite step trains; torch's fused AdamW no longer takes the scaled
    gradients past the guard."""
    model, opt = make(name, backend, dtype, compensation=compensation)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    snap = snapshot(model, opt)
    scaler.scale(loss_of(model)).backward()
    model.fc.weight.grad[0, 0] = INF  # what an fp16 overflow leaves behind
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**15
    assert_unchanged(model, opt, snap)
    assert opt.state_dict()["hf_efficient"]["steps"] == 0
    opt.zero_grad()
    scaler.scale(loss_of(model)).backward()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(model.fc.weight, snap[0][1])
    assert opt.state_dict()["hf_efficient"]["steps"] == 1


@pytest.mark.parametrize("name", ["hf_eff_adamw", "hf_eff_adam8bit"])
def test_trainer_with_a_grad_scaler_skips_an_overflow_step(name, tmp_path):
    """The Trainer's fp16 path (Accelerate's GradScaler; on CPU the Trainer runs without one, so one is installed
    by hand): an overflowing micro-step is skipped by the scaler, training goes on, nothing raises."""
    from transformers import Trainer, TrainingArguments

    from conftest import ClassificationSet, tiny_bert

    model = tiny_bert()
    args = TrainingArguments(str(tmp_path), optim=name, max_steps=4, report_to=[], use_cpu=True, logging_steps=1,
                             per_device_train_batch_size=4, save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=ClassificationSet(32))
    scaler = trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    calls = {"n": 0}

    def overflow_once(grad):
        calls["n"] += 1
        return torch.full_like(grad, INF) if calls["n"] == 2 else grad

    weight = model.bert.encoder.layer[0].attention.self.query.weight
    weight.register_hook(overflow_once)
    before = weight.detach().clone()
    trainer.train()
    assert scaler.get_scale() == 2.0**9  # halved once, for the one overflow
    info = hfe.optimizer_info(trainer.optimizer)
    assert info.steps == 3 and info.skipped_steps == 0  # the scaler skipped it: our step was not even called
    assert torch.isfinite(weight).all() and not torch.equal(weight, before)


def test_every_rank_enters_the_nonfinite_all_reduce_also_without_gradients(monkeypatch):
    """Under FSDP2 (DTensor parameters) the ranks agree on skip/raise by one all-reduce; a rank whose parameters got
    no gradient this step must still enter it, or the others wait for ever."""
    import torch.distributed as dist

    from hf_efficient import nonfinite

    class Shard(nn.Parameter):  # what the guard looks for in a DTensor: to_local()
        def to_local(self):
            return self.detach()

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None: calls.append(int(t)))
    opt = hfe.create_optimizer([Shard(torch.zeros(8))], "adamw", nonfinite="skip")
    assert nonfinite.first_nonfinite(opt) is None and calls == [0]  # no gradient here: entered all the same
    opt.param_groups[0]["params"][0].grad = torch.full((8,), NAN)
    assert nonfinite.first_nonfinite(opt) == "group0.param0" and calls == [0, 1]
