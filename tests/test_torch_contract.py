"""Every name behaves as a ``torch.optim.Optimizer``: closures and step hooks, parameters without gradients,
``zero_grad``, torch's and transformers' learning-rate schedulers, gradients in another memory layout than their
parameter.

Cases over every name/backend come from tests/cases.py (the registry).
"""

import pytest
import torch

from cases import CASES
from helpers import loss_of, make, train


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_generic_optimizer_behaviour(name, backend, dtype, compensation):
    model, opt = make(name, backend, dtype, compensation=compensation)
    calls = []
    h1 = opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    h2 = opt.register_step_post_hook(lambda o, a, k: calls.append("post"))

    def closure():
        opt.zero_grad()
        loss = loss_of(model)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and calls == ["pre", "post"]
    h1.remove(), h2.remove()
    # parameters with grad=None are skipped: out.weight gets no grad, so it and its state do not move
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    out_before = model.out.weight.detach().clone()
    state_before = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[model.out.weight].items()}
    model.fc.weight.sum().backward()
    opt.step()
    assert torch.equal(model.out.weight, out_before)
    for k, v in opt.state[model.out.weight].items():
        if torch.is_tensor(v) and not hasattr(v, "codes"):
            assert torch.equal(v, state_before[k]), k
    opt.zero_grad(set_to_none=False)
    assert model.fc.weight.grad is not None and not model.fc.weight.grad.any()


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_lr_schedulers_of_torch_and_transformers(name, backend, dtype, compensation):
    from transformers import get_linear_schedule_with_warmup

    model, opt = make(name, backend, dtype, compensation=compensation)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=6)
    lrs = []
    for i in range(4):
        train(model, opt, 1, start=i)
        sched.step()
        lrs.append(float(opt.param_groups[0]["lr"]))  # torchao keeps lr as a tensor
    # warm-up 2 steps then linear decay to 0 at step 6: lr(t) = t/2 for t < 2, else (6 - t) / 4
    assert lrs == pytest.approx([0.5e-2, 1e-2, 0.75e-2, 0.5e-2], rel=1e-6)  # torchao: an fp32 tensor
    model2, opt2 = make(name, backend, dtype, compensation=compensation)
    step_lr = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    train(model2, opt2, 1)
    step_lr.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(5e-3)


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_gradients_with_other_strides_step_like_contiguous_ones(name, backend, dtype, compensation):
    """A transposed and an expanded ``p.grad`` (set by hand) step exactly as their contiguous copies; the user's
    gradient objects are left as they were."""
    runs = []
    for layout in ("contiguous", "strided"):
        model, opt = make(name, backend, dtype, compensation=compensation)
        for step in range(3):
            loss_of(model, step).backward()
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
