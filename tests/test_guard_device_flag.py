"""The guard's inf/NaN check on the device (hf_efficient.guard, "On CUDA, without a host synchronisation"): the flag
is computed on the device and handed to the backend as ``optimizer.found_inf``; ``skip`` reads nothing, ``raise``
raises at the next host read. CI has no GPU: hf_efficient.nonfinite's private switch sends CPU tensors down the same
path, and torch's fused CPU AdamW honours ``found_inf`` as its CUDA kernel does, so the whole logic runs here. Every
test runs twice: the flag from torch's check, and from the Triton scan (``optim/nonfinite_triton.py``, what CUDA
runs) executing under Triton's interpreter."""

import os

import pytest
import torch
from torch import nn

from helpers import no_host_read
import hf_efficient as hfe
from hf_efficient import guard, nonfinite
from hf_efficient.optim import _triton

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True, params=["torch", "triton"])
def device_flag(request, monkeypatch):
    """The device path on CPU; with ``triton``, its scan is the Triton kernel's (asserted to run at every check)."""
    monkeypatch.setattr(nonfinite, "_DEVICE_FLAG_ON_CPU", True)
    if request.param == "torch":
        yield
        return
    if os.environ.get("TRITON_INTERPRET") != "1" or not _triton.available():
        pytest.skip("the Triton scan runs on CPU under TRITON_INTERPRET=1")
    _triton.interpret_on_cpu(True)
    try:
        assert nonfinite._triton_scan([torch.zeros(1)]) is not None  # probed on CPU, and it passed
        real = nonfinite._triton_scan
        monkeypatch.setattr(nonfinite, "_triton_scan", lambda grads: real(grads) or pytest.fail(
            "a device check fell back to torch's"))
        yield
    finally:
        _triton.interpret_on_cpu(False)


def _setup(nonfinite, name="adamw", **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    opt = hfe.create_optimizer(model, name, lr=0.1, weight_decay=0.01, nonfinite=nonfinite, **options)
    return model, opt


def _grads(model, bad=None):
    """Gradients set by hand; ``bad``: the value put into the second layer's weight gradient."""
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    if bad is not None:
        model[1].weight.grad[1, 2] = bad


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()])


def _same(a, b):
    (wa, sa), (wb, sb) = a, b
    return all(torch.equal(x, y) for x, y in zip(wa, wb)) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(sa, sb))


def test_fused_torch_adamw_with_found_inf_changes_nothing():
    p = nn.Parameter(torch.randn(7))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    p.grad = torch.randn(7)
    opt.step()
    before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
    opt.found_inf = torch.ones((), dtype=torch.float32)
    opt.step()
    assert torch.equal(before[0], p) and all(torch.equal(v, opt.state[p][k]) for k, v in before[1].items())
    assert float(opt.state[p]["step"]) == 1  # the step count taken back too


def _on_device(opt, scaled: bool) -> bool:
    return nonfinite.checks_on_device(opt, guard.backend_class(opt), scaled)


def test_the_table_says_who_takes_the_flag():
    assert _on_device(_setup("skip")[1], scaled=False)  # torch's fused AdamW (CPU has it too)
    assert not _on_device(_setup("skip")[1], scaled=True)  # a GradScaler checked on the host
    # this package's 8-bit AdamW on its C / compiled path: no flag read, so the host check stays
    assert not _on_device(_setup("skip", "adam8bit", backend="torch")[1], scaled=False)
    nonfinite._DEVICE_FLAG_ON_CPU = False
    assert not _on_device(_setup("skip")[1], scaled=False)  # CPU, outside tests


@pytest.mark.parametrize("value", [NAN, INF, -2.0**64])
def test_skip_voids_the_step_with_no_host_read_and_counts_it_when_asked(value, monkeypatch, caplog):
    model, opt = _setup("skip")
    _grads(model)
    opt.step()
    before = _snapshot(model, opt)
    _grads(model, bad=value)
    with no_host_read(monkeypatch):
        opt.step()
    assert _same(before, _snapshot(model, opt))  # weights, moments and step counts
    info = hfe.optimizer_info(opt)
    assert info.skipped_steps == 1 and info.steps == 1
    assert "1 step(s) skipped" in caplog.text
    assert opt.state_dict()["hf_efficient"]["skipped_steps"] == 1
    _grads(model)
    with no_host_read(monkeypatch):
        opt.step()
    assert not _same(before, _snapshot(model, opt)) and info.steps == 2 and info.skipped_steps == 1


def test_a_good_step_reads_nothing_under_raise(monkeypatch):
    model, opt = _setup("raise")
    for _ in range(3):
        _grads(model)
        with no_host_read(monkeypatch):  # the last step's flag is read from its pinned copy, not a tensor
            opt.step()
    assert hfe.optimizer_info(opt).steps == 3


def test_raise_at_the_next_step_names_the_parameter_and_applies_neither(monkeypatch):
    model, opt = _setup("raise")
    _grads(model)
    opt.step()
    before = _snapshot(model, opt)
    _grads(model, bad=NAN)
    with no_host_read(monkeypatch):
        opt.step()  # voided on the device; nothing read yet
    assert _same(before, _snapshot(model, opt))
    _grads(model)  # a clean next step: still not applied, the error comes first
    with pytest.raises(FloatingPointError, match=r"parameter '1\.weight' at step 2.*step 2 was not applied.*nor is "
                                                 r"this step\(\)"):
        opt.step()
    assert _same(before, _snapshot(model, opt)) and hfe.optimizer_info(opt).steps == 1
    opt.step()  # raised once: training can go on
    assert not _same(before, _snapshot(model, opt)) and hfe.optimizer_info(opt).steps == 2


@pytest.mark.parametrize("read", ["state_dict", "raise_if_voided"])
def test_raise_at_state_dict_or_when_a_loop_logs(read):
    model, opt = _setup("raise")
    _grads(model, bad=INF)
    opt.step()
    with pytest.raises(FloatingPointError, match=r"'1\.weight' at step 1.*read at " + read):
        opt.state_dict() if read == "state_dict" else guard.raise_if_voided(opt)
    sd = opt.state_dict()  # said once
    assert sd["hf_efficient"]["steps"] == 0 and sd["hf_efficient"]["skipped_steps"] == 0


def test_the_trainer_raises_when_it_logs_after_a_voided_step():
    """The Trainer's callback reads the flag where a value is logged (the step that follows need not come)."""
    from types import SimpleNamespace

    from hf_efficient.integrations.transformers import _MemoryCallback

    model, opt = _setup("raise")
    _grads(model, bad=NAN)
    opt.step()
    state = SimpleNamespace(log_history=[], global_step=1)
    with pytest.raises(FloatingPointError, match=r"'1\.weight' at step 1.*raise_if_voided"):
        _MemoryCallback().on_log(None, state, None, logs={}, optimizer=opt)


def test_a_loaded_state_drops_the_void_before_it():
    model, opt = _setup("raise")
    _grads(model)
    opt.step()
    sd = opt.state_dict()
    _grads(model, bad=NAN)
    opt.step()
    opt.load_state_dict(sd)
    assert hfe.optimizer_info(opt).steps == 1
    _grads(model)
    opt.step()  # the void belonged to the run before the load: no error
    assert hfe.optimizer_info(opt).steps == 2


def test_a_grad_scaler_still_skips_overflow_and_steps_otherwise():
    model, opt = _setup("raise")
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # the scaler's scale exists from here
    _grads(model, bad=INF)
    before = _snapshot(model, opt)
    scaler.step(opt)  # the scaler found the inf and did not call our step
    scaler.update()
    assert _same(before, _snapshot(model, opt)) and scaler.get_scale() == 2.0
    _grads(model)
    scaler.step(opt)  # our step, under the scaler: checked on the host, applied
    assert not _same(before, _snapshot(model, opt)) and hfe.optimizer_info(opt).steps == 1
    opt.state_dict()  # nothing was voided on the device: nothing to raise
