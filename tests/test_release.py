"""Gradient release (hf_efficient/release.py): the per-tensor step inside backward equals the ordinary step, frees
each gradient at once, keeps step()/zero_grad()/schedulers/checkpoints working, and refuses what it cannot hold."""

from __future__ import annotations

import logging
import types
import weakref

import pytest
import torch
from torch import nn

import hf_efficient as hfe
from hf_efficient import nonfinite, release
from hf_efficient.factory import optimizer_info

from cases import cases
from conftest import ClassificationSet, tiny_bert, tiny_gpt2

# every name and backend on fp32 and bf16 weights (tests/cases.py, from the registry), the release must step exactly as
# the ordinary step; and AdamWBF16's stochastic rounding, whose noise is keyed by the parameter's position
RELEASE_CASES = cases(dtypes=(torch.float32, torch.bfloat16)) + cases(names={"adamw_bf16"},
                                                                     compensations=("stochastic",))


def _batches(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 16), generator=g) for _ in range(n)]


def _train(name, dtype, options, released, steps=3, model=None, opt_state=None):
    """A tiny GPT-2 (lm_head tied to the input embedding) trained ``steps`` steps with a decaying LR schedule (eval
    mode: no dropout, so runs started apart see the same forward)."""
    model = (model or tiny_gpt2().to(dtype)).eval()
    opt = hfe.create_optimizer(model, name, lr=1e-2, weight_decay=0.1, **options)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    if released:
        release.attach(opt)
    for ids in _batches(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        if released:
            assert all(p.grad is None for p in model.parameters())
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("name, backend, dtype, compensation", RELEASE_CASES)
def test_release_equals_the_ordinary_step(name, backend, dtype, compensation):
    """Bitwise: the hook runs the same elementwise kernel on the same tensors with the same lr, decay group, state,
    8-bit codec and rounding stream (AdamWBF16 keys it by the parameter's position, which the release keeps)."""
    options = {"backend": backend, "compensation": compensation}
    ref, ref_opt = _train(name, dtype, options, released=False)
    rel, rel_opt = _train(name, dtype, options, released=True)
    assert ref.lm_head.weight is ref.transformer.wte.weight  # the tied weight was stepped once per step
    for (n, p), q in zip(ref.named_parameters(), rel.parameters()):
        assert torch.equal(p, q), n
    ref_sd, rel_sd = ref_opt.state_dict(), rel_opt.state_dict()
    for i, st in ref_sd["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(rel_sd["state"][i][k])), (i, k)
    assert rel_opt.hf_efficient.steps == ref_opt.hf_efficient.steps == 3  # one per step() call, not per tensor
    assert release.release_info(rel_opt).stepped_tensors == 3 * len(list(rel.parameters()))


def test_release_without_scheduler_or_step_call_still_steps():
    """A loop that never calls step() is stepped by backward alone: the release does not depend on step()."""
    model = tiny_gpt2()
    opt = hfe.create_optimizer(model, "adamw", lr=1e-2)
    release.attach(opt)
    before = [p.detach().clone() for p in model.parameters()]
    ids = _batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert opt.hf_efficient.steps == 0


def test_at_most_one_gradient_alive_during_backward():
    """Hooks registered before attach run before the release's: each sees exactly its own gradient alive, and
    every gradient seen earlier is already freed (weak references dead)."""
    model = tiny_bert()
    params = list(model.parameters())
    refs, alive_counts = [], []

    def watch(p):
        alive_counts.append(sum(q.grad is not None for q in params))
        refs.append(weakref.ref(p.grad))
        assert sum(r() is not None for r in refs) == 1  # this one; all earlier ones freed

    for p in params:
        p.register_post_accumulate_grad_hook(watch)
    opt = hfe.create_optimizer(model, "adam8bit", lr=1e-3)
    release.attach(opt, bucket_bytes=0)
    batch = ClassificationSet(n=4)[0]
    model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
    assert alive_counts and set(alive_counts) == {1}
    assert len(refs) == sum(p.requires_grad for p in params)
    assert all(r() is None for r in refs)


def test_buckets_bound_the_gradients_alive():
    """With buckets, completed gradients wait until bucket_bytes are pending: never more than that plus the one in
    flight are alive; the last bucket is stepped when the backward ends."""
    model = tiny_bert()
    params = list(model.parameters())
    alive = []
    for p in params:
        p.register_post_accumulate_grad_hook(
            lambda p: alive.append(sum(q.grad.numel() * 4 for q in params if q.grad is not None) - p.grad.numel() * 4))
    opt = hfe.create_optimizer(model, "adamw", lr=1e-3)
    release.attach(opt, bucket_bytes=64 << 10)
    batch = ClassificationSet(n=4)[0]
    model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
    assert max(alive) < 64 << 10 and max(alive) > 0  # some waited, never a full bucket
    assert all(p.grad is None for p in params)
    with pytest.raises(ValueError, match="bucket_bytes=-1"):
        release.attach(opt, bucket_bytes=-1)


def test_the_default_bucket_is_4_mib_on_cpu_and_a_32nd_of_the_gradients_on_cuda(monkeypatch):
    """default_bucket_bytes: 4 MiB on CPU; on CUDA 1/32 of the gradients' bytes where that is more (a 1B bf16 model:
    ~78 MiB, ~32 step calls per backward instead of one per 8 MiB matrix), frozen parameters not counted. Decided at
    each backward's start, from where the parameters are then (Accelerate moves them after the optimizer is made)."""
    def params(device, *numels, frozen=()):
        return [types.SimpleNamespace(device=torch.device(device), requires_grad=i not in frozen, numel=lambda n=n: n,
                                      element_size=lambda: 2) for i, n in enumerate(numels)]

    assert release.default_bucket_bytes(params("cpu", 10**9)) == release.BUCKET_BYTES
    assert release.default_bucket_bytes(params("cuda", 1000)) == release.BUCKET_BYTES
    assert release.default_bucket_bytes(params("cuda", 10**9, 10**9, frozen={1})) == 2 * 10**9 // 32
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    opt = hfe.create_optimizer(model, "adamw", lr=1e-3)
    release.attach(opt)  # the default: decided per backward
    calls = []
    monkeypatch.setattr(release, "default_bucket_bytes", lambda ps: calls.append(len(list(ps))) or 0)
    steps = []
    real = release._Release._flush
    monkeypatch.setattr(release._Release, "_flush", lambda self, opt: (
        self.pending and steps.append((len(self.pending), self.limit))) or real(self, opt))
    for _ in range(2):
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
    assert calls == [4, 4] and steps == [(1, 0)] * 8  # a bucket of 0 bytes: each tensor stepped alone


def test_detach_restores_the_ordinary_step():
    model = tiny_gpt2()
    opt = hfe.create_optimizer(model, "adamw", lr=1e-2)
    release.attach(opt)
    assert release.is_attached(opt)
    release.detach(opt)
    assert not release.is_attached(opt) and release.release_info(opt) is None
    ids = _batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_resume_is_exact():
    """Save after 2 released steps (model, optimizer, scheduler), load into fresh released objects, 2 more steps:
    the same weights as 4 uninterrupted steps."""
    whole, _ = _train("adam8bit", torch.float32, {}, released=True, steps=4)

    def build():
        model = tiny_gpt2().eval()
        opt = hfe.create_optimizer(model, "adam8bit", lr=1e-2, weight_decay=0.1)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    def run(model, opt, sched, batches):
        for ids in batches:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            sched.step()

    model, opt, sched = build()
    release.attach(opt)
    run(model, opt, sched, _batches(4)[:2])
    saved = [{k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict(), sched.state_dict()]
    model2, opt2, sched2 = build()
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[2])
    release.attach(opt2)
    run(model2, opt2, sched2, _batches(4)[2:])
    for (n, p), q in zip(whole.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), n
    assert opt2.hf_efficient.steps == 4


# ------------------------------------------------------------------------------------------------ inf / NaN policy


@pytest.fixture(params=["c", "torch"])
def scan(request, monkeypatch):
    """Each inf/NaN test runs with the guard's C scan and with torch's check (no C kernel): the same behaviour.
    Returns the sizes of the gradients the check read, in order."""
    calls = []
    if request.param == "torch":
        monkeypatch.setattr(nonfinite, "_scan_kernel", lambda: None)
        real = nonfinite._first_bad_torch
        monkeypatch.setattr(nonfinite, "_first_bad_torch", lambda grads: calls.append(grads[0].numel()) or real(grads))
    elif nonfinite._scan_kernel() is None:
        pytest.skip("no C compiler: no C scan")
    else:
        real_scan = nonfinite._scan
        monkeypatch.setattr(nonfinite, "_scan", lambda fn, grads, threads=None: calls.append(grads[0].numel())
                            or real_scan(fn, grads, threads))
    return calls


def _mlp_with_bad_grad(policy):
    """Three linear layers; the middle weight's gradient is made NaN. Backward completes layer 3, then 2, then 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    model[1].weight.register_hook(lambda g: g * float("nan"))
    opt = hfe.create_optimizer(model, "adamw", lr=1e-1, nonfinite=policy)
    release.attach(opt)  # the default bucket holds all of them: the earlier ones are stepped before the raise
    return model, opt, [p.detach().clone() for p in model.parameters()]


def _changed(model, before):
    return [not torch.equal(b, p) for b, p in zip(before, model.parameters())]


def test_nonfinite_raise_steps_earlier_tensors_only(scan):
    model, opt, before = _mlp_with_bad_grad("raise")
    with pytest.raises(FloatingPointError, match=r"'0.weight'|'1.weight'") as e:
        model(torch.randn(2, 4)).sum().backward()
    assert "1.weight" in str(e.value) and "were stepped" in str(e.value)
    # order of completion: 2.bias, 2.weight, then 1.bias (its gradient does not go through the NaN), 1.weight (bad)
    changed = dict(zip([n for n, _ in model.named_parameters()], _changed(model, before)))
    assert changed == {"2.weight": True, "2.bias": True, "1.bias": True, "1.weight": False, "0.weight": False,
                       "0.bias": False}
    assert model[1].weight.grad is not None  # left for inspection
    assert scan == [1, 4, 4, 16]  # each tensor checked once, up to the bad one: 2.bias, 2.weight, 1.bias, 1.weight
    with pytest.raises(RuntimeError, match="holds a gradient from before this backward"):
        model(torch.randn(2, 4)).sum().backward()
    opt.zero_grad()
    model[1].weight.register_hook(lambda g: torch.nan_to_num(g))
    model(torch.randn(2, 4)).sum().backward()  # clean again


def test_nonfinite_skip_skips_that_tensor_and_counts(caplog, scan):
    model, opt, before = _mlp_with_bad_grad("skip")
    with caplog.at_level(logging.WARNING, logger="hf_efficient.release"):
        model(torch.randn(2, 4)).sum().backward()
    changed = dict(zip([n for n, _ in model.named_parameters()], _changed(model, before)))
    assert changed == {"2.weight": True, "2.bias": True, "1.bias": True, "1.weight": False, "0.weight": True,
                       "0.bias": True}
    assert model[1].weight.grad is None and "exp_avg" not in opt.state[model[1].weight]
    assert release.release_info(opt).skipped_tensors == 1 and opt.hf_efficient.skipped_steps == 1
    assert "1 tensor(s) with a non-finite gradient skipped ('1.weight')" in caplog.text
    opt.step()  # each backward is one step: the next needs step() first (see test_release_loops.py)
    model(torch.randn(2, 4)).sum().backward()
    assert release.release_info(opt).skipped_tensors == 2 and opt.hf_efficient.skipped_steps == 2
    assert sorted(scan) == sorted([1, 4, 4, 16, 4, 16] * 2)  # every tensor of both backward passes, once


@pytest.mark.skipif(nonfinite._scan_kernel() is None, reason="no C compiler: no C scan")
def test_a_stalled_scan_in_release_moves_the_guards_scan_to_one_thread(monkeypatch):
    """Release's check is the guard's scan in backward, with its state: a stall (see nonfinite._STALLED) moves that
    optimizer's scans to one thread, and they still find a bad gradient."""
    monkeypatch.setattr(nonfinite, "_STALLED", float("inf"))  # every scan counts as stalled
    model, opt, _ = _mlp_with_bad_grad("skip")
    assert nonfinite._HOOKS[opt].threads is None
    model(torch.randn(2, 4)).sum().backward()
    assert nonfinite._HOOKS[opt].threads == 1 and release.release_info(opt).skipped_tensors == 1


@pytest.mark.skipif(nonfinite._scan_kernel() is None, reason="no C compiler: no scan in backward")
def test_the_backward_scans_stand_aside_while_release_checks(monkeypatch):
    """Attached, each gradient is read once, by the release's check: the guard's backward scans (here hooked for
    every size) leave it alone (nonfinite.defer_scans); detached, they scan again."""
    monkeypatch.setattr(nonfinite, "_HOOK_MIN", 1)
    calls, real = [], nonfinite._scan
    monkeypatch.setattr(nonfinite, "_scan", lambda fn, grads, threads=None: calls.append(grads[0].numel())
                        or real(fn, grads, threads))
    model, opt, _ = _mlp_with_bad_grad("skip")
    model(torch.randn(2, 4)).sum().backward()
    assert sorted(calls) == sorted([1, 4, 4, 16, 4, 16])  # once each (twice if the guard's hooks scanned too)
    opt.step()
    opt.zero_grad()
    release.detach(opt)
    calls.clear()
    model(torch.randn(2, 4)).sum().backward()
    assert sorted(calls) == sorted([1, 4, 4, 16, 4, 16]) and model[1].weight.grad is not None  # the guard's hooks


# ---------------------------------------------------------------------------------------------------- refusals


def test_attach_refuses_other_optimizers_and_existing_gradients():
    model = nn.Linear(3, 3)
    with pytest.raises(TypeError, match="made by hf_efficient.create_optimizer"):
        release.attach(torch.optim.AdamW(model.parameters()))
    opt = hfe.create_optimizer(model, "adamw")
    model(torch.randn(1, 3)).sum().backward()
    with pytest.raises(RuntimeError, match=r"already hold gradients.*zero_grad"):
        release.attach(opt)
    assert not release.is_attached(opt)


def test_attach_refuses_a_process_group(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    opt = hfe.create_optimizer(nn.Linear(3, 3), "adamw")
    with pytest.raises(RuntimeError, match="one process: this one is in a group of 2"):
        release.attach(opt)


def test_unfrozen_parameter_without_hook_is_refused_and_attach_again_works():
    """The refused backward keeps none of its gradients (issue 30: the first hooked tensor kept its own, which the
    next step() applied, and attach() refused it), so the message's advice works as written."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model[0].weight.requires_grad_(False)
    opt = hfe.create_optimizer(list(model.named_parameters()), "adamw")
    release.attach(opt)
    assert release.release_info(opt).frozen == ["0.weight"]
    model[0].weight.requires_grad_(True)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"'0.weight' requires a gradient but has no release hook.*attach"):
        model(torch.randn(2, 3)).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    release.attach(opt)  # as the message says, nothing else
    model(torch.randn(2, 3)).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_a_stale_gradient_refuses_the_backward_which_keeps_none_of_its_own():
    """A gradient set by hand before backward: that backward is refused at its first hook and drops what it made;
    the stale gradient stays for zero_grad() (the ordinary step() would have applied it too), nothing else moves."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = hfe.create_optimizer(list(model.named_parameters()), "adamw", lr=1e-2)
    release.attach(opt)
    model[0].bias.grad = torch.ones(3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"'0.bias' holds a gradient from before this backward.*zero_grad"):
        model(torch.randn(2, 3)).sum().backward()
    assert [n for n, p in model.named_parameters() if p.grad is not None] == ["0.bias"]
    opt.step()
    assert [n for (n, p), b in zip(model.named_parameters(), before) if not torch.equal(b, p)] == ["0.bias"]
    opt.zero_grad()
    model(torch.randn(2, 3)).sum().backward()
    assert all(p.grad is None for p in model.parameters())


def _args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, **kw)


def test_check_trainer_args_names_each_setting(tmp_path):
    from transformers.training_args import ParallelMode

    with pytest.raises(ValueError) as e:
        release.check_trainer_args(_args(tmp_path, gradient_accumulation_steps=4))  # and max_grad_norm=1.0
    msg = str(e.value)
    assert "gradient_accumulation_steps=4" in msg and "gradient_release" in msg and "per_device_train_batch_size" in msg
    assert "max_grad_norm=1.0" in msg and "Set max_grad_norm=0" in msg
    release.check_trainer_args(_args(tmp_path, max_grad_norm=0.0))  # what works
    for kw, words in [({"fp16": True}, "GradScaler"), ({"deepspeed": "ds.json"}, "deepspeed set"),
                      ({"fsdp": "full_shard"}, "fsdp set"), ({"world_size": 2}, "world_size=2"),
                      ({"parallel_mode": ParallelMode.DISTRIBUTED}, r"parallel_mode=distributed, here of 1.*twice"),
                      ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
                       "use_reentrant")]:
        args = types.SimpleNamespace(gradient_accumulation_steps=1, max_grad_norm=0.0, **kw)
        with pytest.raises(ValueError, match=words):
            release.check_trainer_args(args)
    release.check_trainer_args(types.SimpleNamespace(gradient_checkpointing=True, max_grad_norm=0.0))


def test_check_accelerate_names_each_setting():
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2 \(Accelerator / EfficientOptimPlugin"):
        release.check_accelerate(Accelerator(gradient_accumulation_steps=2, cpu=True))
    release.check_accelerate(Accelerator(cpu=True))
    fake = types.SimpleNamespace(gradient_accumulation_steps=1, mixed_precision="fp16", scaler=None,
                                 distributed_type=DistributedType.MULTI_GPU, num_processes=2)
    with pytest.raises(ValueError, match=r"(?s)mixed_precision='fp16'.*distributed_type=MULTI_GPU with 2"):
        release.check_accelerate(fake)


# --------------------------------------------------------------------------------------------------- Trainer


def _trainer(tmp_path, optim, released, model=None, **kw):
    from transformers import Trainer

    class ReleasedTrainer(Trainer):  # the lead replaces this by optim_args="gradient_release=true"
        def create_optimizer(self, *a, **k):
            opt = super().create_optimizer(*a, **k)
            if released:
                release.check_trainer_args(self.args)
                release.attach(opt)
            return opt

    args = _args(tmp_path, **{**dict(optim=optim, max_steps=6, per_device_train_batch_size=8, learning_rate=1e-3,
                                     logging_steps=1, max_grad_norm=0.0, save_strategy="no", seed=0), **kw})
    return ReleasedTrainer(model=model or tiny_bert(), args=args, train_dataset=ClassificationSet())


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_same_losses_with_and_without_release(tmp_path):
    plain = _trainer(tmp_path / "a", "hf_eff_adamw", False)
    plain.train()
    rel = _trainer(tmp_path / "b", "hf_eff_adamw", True)
    rel.train()
    assert _losses(rel) == _losses(plain) and len(_losses(rel)) == 6
    assert optimizer_info(rel.optimizer).steps == 6
    for p, q in zip(plain.model.parameters(), rel.model.parameters()):
        assert torch.equal(p, q)


def test_trainer_trains_the_8bit_name_on_a_bf16_model(tmp_path):
    trainer = _trainer(tmp_path, "hf_eff_adam8bit", True, model=tiny_bert().to(torch.bfloat16), learning_rate=1e-2)
    trainer.train()
    losses = _losses(trainer)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert release.release_info(trainer.optimizer).stepped_tensors > 0


def test_accelerate_loop_same_weights_with_and_without_release():
    """attach takes Accelerate's wrapper of the optimizer; the loop (backward, step, zero_grad) runs unchanged."""
    from accelerate import Accelerator

    weights = []
    for released in (False, True):
        accelerator = Accelerator(cpu=True)
        release.check_accelerate(accelerator)
        model = tiny_gpt2().eval()
        model, opt = accelerator.prepare(model, hfe.create_optimizer(model, "adam8bit", lr=1e-2))
        if released:
            release.attach(opt)
        for ids in _batches(3):
            accelerator.backward(model(input_ids=ids, labels=ids).loss)
            opt.step()
            opt.zero_grad()
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*weights))


# --- the option, plumbed: create_optimizer, TrainingArguments, the accelerate plugin ---------------------------


def test_the_gradient_release_option_everywhere(tmp_path, monkeypatch):
    """``gradient_release=true`` attaches through create_optimizer and optim_args; TrainingArguments refuses the
    Trainer's defaults that release cannot honour (max_grad_norm=1.0) before any model loads; the plugin field and
    HF_EFF_GRADIENT_RELEASE attach in an Accelerate loop and refuse accumulation."""
    import hf_efficient as hfe
    from hf_efficient import release
    from hf_efficient.integrations.accelerate import EfficientOptimPlugin
    from transformers import TrainingArguments

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    assert release.is_attached(hfe.create_optimizer(model, "adamw", gradient_release=True))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    assert not release.is_attached(hfe.create_optimizer(model, "adamw", gradient_release="false"))
    with pytest.raises(ValueError, match="max_grad_norm=1.0"):
        TrainingArguments(str(tmp_path), optim="hf_eff_adamw", optim_args="gradient_release=true", use_cpu=True)
    args = TrainingArguments(str(tmp_path), optim="hf_eff_adamw", optim_args="gradient_release=true", use_cpu=True,
                             max_grad_norm=0.0, report_to=[])
    assert args.max_grad_norm == 0.0
    monkeypatch.setenv("HF_EFF_GRADIENT_RELEASE", "true")
    plugin = EfficientOptimPlugin(optim="adamw", gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        plugin.create_accelerator()
    plugin = EfficientOptimPlugin(optim="adamw", lr=1e-2)
    accelerator = plugin.create_accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model, optimizer, scheduler = plugin.prepare(accelerator, model, num_training_steps=4)
    assert release.is_attached(optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    accelerator.backward(model(torch.randn(4, 8)).pow(2).sum())
    assert all(p.grad is None for p in model.parameters())  # stepped inside backward, gradients freed
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def test_trainer_with_the_option_trains_like_without(tmp_path):
    """``optim_args="gradient_release=true"`` in an unmodified Trainer: the same losses as the ordinary step
    (fp32 AdamW, no clipping), the optimizer attached."""
    from transformers import Trainer, TrainingArguments

    from conftest import ClassificationSet, tiny_bert
    from hf_efficient import release

    runs = []
    for optim_args in (None, "gradient_release=true"):
        args = TrainingArguments(str(tmp_path / str(optim_args)), optim="hf_eff_adamw", optim_args=optim_args,
                                 max_grad_norm=0.0, max_steps=4, per_device_train_batch_size=8, logging_steps=1,
                                 report_to=[], use_cpu=True, save_strategy="no", seed=0)
        trainer = Trainer(model=tiny_bert(), args=args, train_dataset=ClassificationSet(64))
        trainer.train()
        assert release.is_attached(trainer.optimizer) == (optim_args is not None)
        runs.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    assert runs[0] == runs[1]
