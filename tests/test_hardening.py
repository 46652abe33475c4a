"""Issue 12: misuse and environments that gave silently wrong results: non-finite hyperparameters, gradients in
another layout, duplicate parameters, copies of an optimizer, group flags that were ignored, GradScaler.

Each case runs for every name/backend in tests/cases.py's CASES (from the registry) where it applies.
"""

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import hf_efficient as hfe
from hf_efficient.registry import SPECS

from cases import CASES
from test_reliability import Net, _assert_unchanged, _loss, _make, _snapshot, _train

INF, NAN = float("inf"), float("nan")


# --- 3: non-finite hyperparameters ------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=INF), "lr=inf"), (dict(lr=NAN), "lr=nan"), (dict(weight_decay=INF), "weight_decay=inf"),
    (dict(eps=0.0), "eps=0.0"), (dict(eps=INF), "eps=inf"), (dict(lr=torch.tensor(1e-3)), "lr=tensor"),
    (dict(betas=0.9), r"betas=0.9: expected a pair"), (dict(betas=(0.9, NAN)), "beta2=nan"),
])
@pytest.mark.parametrize("name", ["adamw", "adam8bit", "adamw_bf16"])
def test_non_finite_hyperparameters_are_refused(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        hfe.create_optimizer(Net(), name, **kwargs)


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
@pytest.mark.parametrize("bad", [dict(lr=INF), dict(weight_decay=INF), dict(lr=torch.tensor(0.1))])
def test_add_param_group_refuses_non_finite_hyperparameters(name, backend, dtype, compensation, bad):
    model, opt = _make(name, backend, dtype, compensation=compensation)
    extra = nn.Parameter(torch.zeros(8, 8, dtype=dtype))
    groups = len(opt.param_groups)
    with pytest.raises(ValueError, match="lr=|weight_decay="):
        opt.add_param_group({"params": [extra], **bad})
    assert len(opt.param_groups) == groups


def test_optim_args_and_trainer_learning_rate_refuse_inf(tmp_path):
    from transformers import Trainer, TrainingArguments

    from conftest import ClassificationSet, tiny_bert

    with pytest.raises(ValueError, match="'clip_threshold' must be a finite number"):
        hfe.create_optimizer(Net(), "adafactor", clip_threshold="inf")
    args = TrainingArguments(str(tmp_path), optim="hf_eff_adam8bit", learning_rate=INF, max_steps=1,
                             report_to=[], use_cpu=True)
    trainer = Trainer(model=tiny_bert(), args=args, train_dataset=ClassificationSet(8))
    with pytest.raises(ValueError, match="lr=inf"):
        trainer.create_optimizer()


# --- 4: gradients in another layout than their parameter ------------------------------------------------------

@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_gradients_with_other_strides_step_like_contiguous_ones(name, backend, dtype, compensation):
    """A transposed and an expanded ``p.grad`` (set by hand) step exactly as their contiguous copies; the user's
    gradient objects are left as they were."""
    runs = []
    for layout in ("contiguous", "strided"):
        model, opt = _make(name, backend, dtype, compensation=compensation)
        for step in range(3):
            _loss(model, step).backward()
            w, b = model.fc.weight, model.out.bias
            if layout == "strided":
                w.grad = w.grad.t().contiguous().t()  # same values, column-major
                b.grad = b.grad[:1].expand(b.shape)  # stride 0
                grads = (w.grad, b.grad)
            else:
                b.grad = b.grad[:1].expand(b.shape).contiguous()
            opt.step()
            if layout == "strided":
                assert w.grad is grads[0] and b.grad is grads[1] and w.grad.stride() == (1, 128)
            opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# --- 5: the same parameter twice -----------------------------------------------------------------------------

@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_duplicate_parameters_are_refused(name, backend, dtype, compensation):
    if backend == "torchao":
        pytest.importorskip("torchao")
    p = nn.Parameter(torch.zeros(64, 64, dtype=dtype))
    with pytest.raises(ValueError, match="same tensor"):
        hfe.create_optimizer([p, p], name, backend=backend)
    with pytest.raises(ValueError, match="same tensor"):
        hfe.create_optimizer([{"params": [p]}, {"params": [p]}], name, backend=backend)
    model, opt = _make(name, backend, dtype, compensation=compensation)
    groups = len(opt.param_groups)
    with pytest.raises(ValueError, match="same tensor"):
        opt.add_param_group({"params": [model.fc.weight]})
    q = nn.Parameter(torch.zeros(8, dtype=dtype))
    with pytest.raises(ValueError, match="same tensor"):
        opt.add_param_group({"params": [q, q]})
    assert len(opt.param_groups) == groups


# --- 6: copies behave like the original ------------------------------------------------------------------------

def _copies(opt):
    yield "deepcopy", copy.deepcopy(opt)
    yield "pickle", pickle.loads(pickle.dumps(opt))
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    yield "torch.save", torch.load(buf, weights_only=False)


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_copies_of_an_optimizer_are_guarded_tagged_and_continue_exactly(name, backend, dtype, compensation):
    """deepcopy, pickle and torch.save of (model, optimizer) give an optimizer that refuses an inf like the original,
    keeps its step count, and continues exactly as the original does."""
    model, opt = _make(name, backend, dtype, compensation=compensation)
    _train(model, opt, 2)
    reference = copy.deepcopy({"model": model, "opt": opt})
    _train(reference["model"], reference["opt"], 2, start=2)
    for how, twin in _copies({"model": model, "opt": opt}):
        twin_model, twin_opt = twin["model"], twin["opt"]
        assert type(twin_opt).__name__ == type(opt).__name__, how
        assert twin_opt.state_dict()["hf_efficient"]["steps"] == 2, how
        _loss(twin_model, 5).backward()
        twin_model.fc.weight.grad[0, 0] = INF
        with pytest.raises(FloatingPointError):
            twin_opt.step()
        twin_opt.zero_grad()
        _train(twin_model, twin_opt, 2, start=2)
        for a, b in zip(twin_model.parameters(), reference["model"].parameters()):
            assert torch.equal(a, b), how
        assert twin_opt.state_dict()["hf_efficient"]["steps"] == 4, how


# --- 10: group flags a backend does not implement ----------------------------------------------------------------

@pytest.mark.parametrize("name, backend, dtype, compensation",
                         [c for c in CASES if "maximize" not in SPECS[c.values[0]].facts.flags])
def test_maximize_is_refused_where_it_would_be_ignored(name, backend, dtype, compensation):
    model, opt = _make(name, backend, dtype, compensation=compensation)
    with pytest.raises(ValueError, match="maximize=True"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(8, dtype=dtype))], "maximize": True})
    with pytest.raises(ValueError, match="maximize=True"):
        hfe.create_optimizer([{"params": [nn.Parameter(torch.zeros(8, dtype=dtype))], "maximize": True}], name,
                             backend=backend)


def test_maximize_is_honoured_by_adamw():
    model, opt = _make("adamw", None, torch.float32)
    opt.param_groups[0]["maximize"] = True
    before = _loss(model).item()
    _train(model, opt, 3)
    assert _loss(model).item() > before


# --- 12: GradScaler ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_grad_scaler_skips_overflow_steps_for_every_name(name, backend, dtype, compensation):
    """fp16-style loss scaling: an overflow step is skipped by the scaler (scale halved, nothing updated, no
    FloatingPointError), and the next finite step trains; torch's fused AdamW no longer takes the scaled
    gradients past the guard."""
    model, opt = _make(name, backend, dtype, compensation=compensation)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    snap = _snapshot(model, opt)
    scaler.scale(_loss(model)).backward()
    model.fc.weight.grad[0, 0] = INF  # what an fp16 overflow leaves behind
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**15
    _assert_unchanged(model, opt, snap)
    assert opt.state_dict()["hf_efficient"]["steps"] == 0
    opt.zero_grad()
    scaler.scale(_loss(model)).backward()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(model.fc.weight, snap[0][1])
    assert opt.state_dict()["hf_efficient"]["steps"] == 1


# --- messages that named the wrong thing ---------------------------------------------------------------------------

@pytest.mark.parametrize("params, exc, match", [
    ([{"params": []}], ValueError, "param group 0 has no parameters"),
    ([1.0], TypeError, "is a float, not a tensor"),
    ([{"lr": 0.1}], TypeError, "must be a dict with a 'params' list"),
])
def test_messages_name_the_mistake(params, exc, match):
    with pytest.raises(exc, match=match):
        hfe.create_optimizer(params, "adamw")


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


def test_a_c_scan_that_misses_values_is_not_used(monkeypatch, caplog):
    """The C gradient scan is admitted by a probe over 3 threads on a range that splits unevenly: a scan that does
    only part of the range (the old split under OMP_THREAD_LIMIT=1) is refused, and the torch check is used."""
    from hf_efficient import nonfinite
    from hf_efficient.optim import _native

    if _native.load("grad_check_cpu.c") is None:
        pytest.skip("no C compiler: the C scan is not built here")
    real_bind = _native.bind

    def half_scan(lib, symbol, argtypes, restype=None):
        fn = real_bind(lib, symbol, argtypes, restype)

        def first_half(*args):  # scans only the first half of its range, as a team of 1 did with 2 asked for
            *rest, start, end, threads = args
            return fn(*rest, start, start + (end - start) // 2, threads)
        first_half.openmp = fn.openmp
        return first_half

    from hf_efficient.optim import _dispatch

    monkeypatch.setattr(_native, "bind", half_scan)
    monkeypatch.setattr(_dispatch, "_COMPILED", {})  # the scan is cached, probed and logged by the dispatcher
    monkeypatch.setattr(_dispatch, "_LOGGED", set())
    with caplog.at_level("WARNING", logger="hf_efficient.optim._dispatch"):
        assert nonfinite._scan_kernel() is None
    assert "grad_check_cpu.c disagrees with the eager kernel on its probe" in caplog.text
    grads = [torch.zeros(300_000)]
    grads[0][-1] = NAN
    assert nonfinite._first_bad_native(grads) is None and nonfinite._first_bad_torch(grads) == 0


def test_a_thread_limit_below_torchs_thread_count_is_warned(monkeypatch, caplog):
    """OMP_THREAD_LIMIT below torch's thread count makes some of torch's own kernels wrong (oneDNN's bf16 linear
    backward gives NaN there): creating an optimizer says so once, with the cure."""
    from hf_efficient.optim import _native

    monkeypatch.setattr(_native, "_THREAD_LIMIT_WARNED", set())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setenv("OMP_THREAD_LIMIT", "1")
        with caplog.at_level("WARNING", logger="hf_efficient.optim._native"):
            hfe.create_optimizer(Net(), "adamw")
            hfe.create_optimizer(Net(), "adamw")
        assert caplog.text.count("OMP_THREAD_LIMIT=1 is below torch's thread count (2)") == 1
        assert "torch.set_num_threads(1)" in caplog.text
        monkeypatch.setenv("OMP_THREAD_LIMIT", "2")
        assert _native.check_thread_limit() is None
    finally:
        torch.set_num_threads(threads)
