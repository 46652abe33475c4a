"""Gradient release in hand-written loops (hf_efficient/release.py): what release refuses before it steps anything
(reentrant checkpointing, a second backward before step(), a GradScaler, DistributedDataParallel), what it keeps equal
to the ordinary step (zero_grad(set_to_none=False)), and parameter groups added after attach."""

from __future__ import annotations

import gc
import types

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import hf_efficient as hfe
from cases import fp32_model, names
from hf_efficient import release
from hf_efficient.factory import optimizer_info


def _snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def _unchanged(model, before):
    return all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


# ---------------------------------------------------------------------------------- 1. reentrant checkpointing


class _Checkpointed(nn.Module):
    """An embedding, two checkpointed layers (``shared``: the same layer twice, i.e. a weight in two segments), a
    head; layers as in transformers' gradient checkpointing."""

    def __init__(self, shared=False, reentrant=True):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(16, 8), nn.Linear(8, 1)
        first = nn.Linear(8, 8)
        self.layers = nn.ModuleList([first, first if shared else nn.Linear(8, 8)])
        self.reentrant = reentrant

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=self.reentrant)
        return self.out(h).sum()


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("bucket_bytes", [release.BUCKET_BYTES, 0])
def test_reentrant_checkpointing_is_refused_inside_the_first_segment(shared, bucket_bytes):
    """The first hook of a nested backward refuses, with the reason and the fix: no tensor of a checkpointed segment
    (the layers) nor the embedding is stepped, only the head's when its bucket was full (bucket_bytes=0). The refused
    backward leaves no gradient for step() to apply."""
    model = _Checkpointed(shared)
    opt = hfe.create_optimizer(model, "adamw", lr=1e-1)
    release.attach(opt, bucket_bytes=bucket_bytes)
    before = dict(zip([n for n, _ in model.named_parameters()], _snapshot(model)))
    with pytest.raises(RuntimeError, match=r"(?s)reentrant backward.*use_reentrant=False") as e:
        model(torch.tensor([1, 2, 3])).backward()
    head = bucket_bytes == 0
    assert f"{2 if head else 0} tensor(s) completed outside the segments were stepped" in str(e.value)
    for name, p in model.named_parameters():
        assert torch.equal(before[name], p) != (head and name.startswith("out.")), name
        assert p.grad is None, name


def test_non_reentrant_checkpointing_equals_the_ordinary_step():
    """use_reentrant=False keeps one backward: release steps it as the ordinary step does, shared layer included."""
    weights = []
    for released in (False, True):
        model = _Checkpointed(shared=True, reentrant=False)
        opt = hfe.create_optimizer(model, "adamw", lr=1e-1, weight_decay=0.1, gradient_release=released)
        for ids in ([1, 2, 3], [4, 5, 6]):
            model(torch.tensor(ids)).backward()
            opt.step()
            opt.zero_grad()
        weights.append(_snapshot(model))
    assert all(torch.equal(p, q) for p, q in zip(*weights))


@pytest.mark.parametrize("major,kwargs,refused", [
    (4, None, True),  # transformers 4.x: the model's default is {"use_reentrant": True}
    (5, None, False),  # 5.x: {"use_reentrant": False}
    (5, {"every_n_layers": 2}, False),  # transformers' own keys are not torch's
    (5, {"preserve_rng_state": False}, True),  # passed to torch's checkpoint, whose default is reentrant
    (4, {"use_reentrant": False}, False),
    (5, {"use_reentrant": True}, True),
])
def test_trainer_check_follows_each_transformers_default(monkeypatch, major, kwargs, refused):
    monkeypatch.setattr(release, "_transformers_major", lambda: major)
    for prefix in ("gradient", "activation"):  # transformers 5.x names it activation_checkpointing
        args = types.SimpleNamespace(gradient_accumulation_steps=1, max_grad_norm=0.0,
                                     **{f"{prefix}_checkpointing": True, f"{prefix}_checkpointing_kwargs": kwargs})
        if refused:
            with pytest.raises(ValueError, match=r"use_reentrant=True.*use_reentrant': False"):
                release.check_trainer_args(args)
        else:
            release.check_trainer_args(args)


def test_training_arguments_refuse_reentrant_checkpointing(tmp_path):
    """The real TrainingArguments of the installed transformers, through the option (before any model loads)."""
    from transformers import TrainingArguments

    field = "activation" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ else "gradient"
    common = dict(optim="hf_eff_adamw", optim_args="gradient_release=true", use_cpu=True, max_grad_norm=0.0,
                  report_to=[], **{f"{field}_checkpointing": True})
    with pytest.raises(ValueError, match="use_reentrant"):
        TrainingArguments(str(tmp_path), **common, **{f"{field}_checkpointing_kwargs": {"use_reentrant": True}})
    TrainingArguments(str(tmp_path), **common, **{f"{field}_checkpointing_kwargs": {"use_reentrant": False}})


# ---------------------------------------------------------------------------- 2. zero_grad(set_to_none=False)


class _EvenOdd(nn.Module):
    """A layer used only on even steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.always, self.even = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x, step):
        h = self.always(x)
        return (self.even(h) if step % 2 == 0 else h).pow(2).mean()


# every name made for fp32 models (this model's), and one of them with each tensor stepped alone
CASES = [pytest.param(*p.values, {}, marks=p.marks, id=p.id) for p in names(fp32_model)] + [
    pytest.param("adamw", {"bucket_bytes": 0}, id="adamw-bucket_bytes=0")]


@pytest.mark.parametrize("name,opts", CASES)
@pytest.mark.parametrize("set_to_none", [False, True])
def test_zero_grad_keeping_zeros_equals_the_ordinary_step(name, opts, set_to_none):
    """The ordinary loop steps a kept zero gradient (momentum, decay, step count move); release steps it at step():
    bitwise the same weights and state, with either zero_grad."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 6, generator=g) for _ in range(5)]
    runs = []
    for released in (False, True):
        model = _EvenOdd()
        opt = hfe.create_optimizer(model, name, lr=1e-2, weight_decay=0.1)
        if released:
            release.attach(opt, **opts)
        for i, x in enumerate(xs):
            model(x, i).backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        runs.append((_snapshot(model), opt.state_dict()["state"], optimizer_info(opt).steps))
    (ref, ref_state, ref_steps), (rel, rel_state, rel_steps) = runs
    assert all(torch.equal(p, q) for p, q in zip(ref, rel))
    assert ref_steps == rel_steps == len(xs)
    for i, st in ref_state.items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(rel_state[i][k])), (i, k)
    assert all(p.grad is None for p in model.parameters())  # the zeros were freed after their step


def test_zero_grad_between_backward_and_step_warns(caplog):
    model = nn.Linear(3, 1)
    opt = hfe.create_optimizer(model, "adamw", gradient_release=True)
    model(torch.randn(2, 3)).sum().backward()
    with caplog.at_level("WARNING", logger="hf_efficient.release"):
        opt.zero_grad()
        opt.zero_grad()
    assert caplog.text.count("cannot discard that backward's gradients") == 1


# ----------------------------------------------------------------------------- 3. two backward() per step()


def test_second_backward_before_step_is_refused_and_steps_agree():
    """retain_graph=True, two backward passes: the second is refused before it steps anything; the step counts
    of the optimizer and of its state stay one per step()."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = hfe.create_optimizer(model, "adamw", lr=1e-2, gradient_release=True)
    for _ in range(2):
        loss = model(torch.randn(2, 4)).sum()
        loss.backward(retain_graph=True)
        before = _snapshot(model)
        with pytest.raises(RuntimeError, match=r"second backward\(\) before optimizer.step\(\)"):
            loss.backward()
        assert _unchanged(model, before)
        assert all(p.grad is None for p in model.parameters())  # the refused backward left nothing
        opt.step()
    assert optimizer_info(opt).steps == 2
    assert {int(st["step"]) for st in opt.state.values()} == {2}


# ---------------------------------------------------------------------------------------------- 4. GradScaler


def test_grad_scaler_is_refused_before_anything_is_stepped():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = hfe.create_optimizer(model, "adamw", lr=1e-2, gradient_release=True)
    scaler = torch.amp.GradScaler("cpu")
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match=r"GradScaler.*nothing was stepped"):
        scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    assert _unchanged(model, before) and all(p.grad is None for p in model.parameters())


def test_a_disabled_scaler_and_a_product_loss_are_fine():
    """GradScaler(enabled=False) returns the loss unscaled; a loss that is a product is not a scaled one."""
    gc.collect()  # an enabled scaler of an earlier test, kept alive by its traceback's cycle, would count as live
    model = nn.Linear(4, 1)
    opt = hfe.create_optimizer(model, "adamw", lr=1e-2, gradient_release=True)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for loss in (scaler.scale(model(torch.randn(2, 4)).sum()), model(torch.randn(2, 4)).sum() * torch.tensor(0.5)):
        before = _snapshot(model)
        loss.backward()
        assert not _unchanged(model, before)
        scaler.step(opt) if loss.grad_fn.name() != "MulBackward0" else opt.step()
        scaler.update()
        opt.zero_grad()


# ---------------------------------------------------------------------------------------- 5. add_param_group


def test_add_param_group_after_attach_hooks_the_new_parameters():
    """The new group's parameters are stepped inside backward like the others: the same weights as the ordinary
    step with the same groups."""
    weights = []
    for released in (False, True):
        torch.manual_seed(0)
        body, head = nn.Linear(4, 4), nn.Linear(4, 1)
        opt = hfe.create_optimizer(body, "adamw", lr=1e-2, gradient_release=released)
        opt.add_param_group({"params": list(head.parameters()), "lr": 1e-1})
        if released:
            assert release.release_info(opt).params == 4
        for _ in range(2):
            head(body(torch.randn(2, 4))).sum().backward()
            if released:
                assert all(p.grad is None for p in head.parameters())
            opt.step()
            opt.zero_grad()
        weights.append(_snapshot(body) + _snapshot(head))
    assert all(torch.equal(p, q) for p, q in zip(*weights))


def test_detach_and_copies_leave_the_attached_class():
    import copy

    opt = hfe.create_optimizer(nn.Linear(3, 1), "adamw", gradient_release=True)
    cls = type(opt)
    clone = copy.deepcopy(opt)
    assert not release.is_attached(clone) and type(clone) is not cls and type(clone).__name__ == cls.__name__
    release.detach(opt)
    assert type(opt) is type(clone)
    assert not opt._optimizer_step_pre_hooks


# ---------------------------------------------------------------------------------- 6. DistributedDataParallel


def _ddp_ranks() -> dict:
    """One rank of a gloo group (fsdp_helpers.run_ranks), one run per case of DDP with gradient release: ``first``,
    DDP from the start; ``late``, one step without DDP, then a step under DDP (the first backward's check saw none);
    ``plain``, as ``late`` without release: the ordinary DDP loop. Each: (error or None, weights after its DDP
    backward and step(), which gradients are left)."""
    from torch.nn.parallel import DistributedDataParallel

    out = {}
    for case in ("first", "late", "plain"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        try:
            opt = hfe.create_optimizer(model, "adamw", lr=1e-2, gradient_release=case != "plain")
        except RuntimeError as e:  # a group of several processes: refused here
            out[case] = (str(e), None, None)
            continue
        if case != "first":
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        ddp, error = DistributedDataParallel(model), None
        try:
            ddp(torch.randn(3, 4)).sum().backward()
            opt.step()
        except RuntimeError as e:
            error = str(e)
        out[case] = (error, [p.detach().clone() for p in model.parameters()],
                     [p.grad is not None for p in model.parameters()])
    return out


def test_release_under_ddp_of_one_process_equals_the_ordinary_loop_or_is_refused():
    """torchrun with one process: DDP writes the reduced gradients back after release stepped them (issue 30: step()
    stepped every tensor again). Refused at the first backward, nothing stepped or kept; a DDP made after that first
    backward is refused at step(), which drops the written-back gradients: the weights are the ordinary DDP loop's,
    each backward one step."""
    from fsdp_helpers import run_ranks

    [runs] = run_ranks(_ddp_ranks, 1)
    error, weights, grads = runs["first"]
    assert "cannot run under DistributedDataParallel (here over a process group of 1)" in error
    torch.manual_seed(0)
    fresh = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    assert all(torch.equal(p, q) for p, q in zip(weights, fresh.parameters())) and not any(grads)
    (error, weights, grads), (plain_error, plain, _) = runs["late"], runs["plain"]
    assert "hold a gradient again after release stepped them" in error and "DistributedDataParallel" in error
    assert plain_error is None and not any(grads)
    assert all(torch.equal(p, q) for p, q in zip(weights, plain))


def test_release_in_a_group_of_two_processes_is_refused_at_attach():
    from fsdp_helpers import run_ranks

    for runs in run_ranks(_ddp_ranks, 2):
        error, weights, _ = runs["first"]
        assert "gradient release runs in one process: this one is in a group of 2" in error and weights is None


def test_a_gradient_written_after_release_stepped_it_is_refused_at_step():
    """Whatever writes it (DDP's reducer at backward's end, a hand-written loop): step() would step it again."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = hfe.create_optimizer(model, "adamw", lr=1e-2, gradient_release=True)
    model(torch.randn(2, 4)).sum().backward()
    after_backward = _snapshot(model)
    model[1].bias.grad = torch.ones_like(model[1].bias)
    with pytest.raises(RuntimeError, match=r"\['1.bias'\] hold a gradient again after release stepped them"):
        opt.step()
    assert _unchanged(model, after_backward) and all(p.grad is None for p in model.parameters())
