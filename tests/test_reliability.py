"""Issue 7: non-finite gradients, bad input, state that loads only where it fits, cross-backend 8-bit state.

Every case runs for every name/backend in tests/cases.py's CASES (generated from the registry). "Nothing half-applied" is checked by snapshotting the
parameters and the optimizer state before the failing call and comparing after it.
"""

import copy
import io
import logging

import pytest
import torch
from torch import nn

import hf_efficient as hfe
from hf_efficient import checkpoint

from cases import CASES  # (name, backend, dtype, compensation): every registered name and backend


class Net(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 64)  # 4096 elements
        self.fc = nn.Linear(64, 128)  # 8192: 8-bit state by size
        self.out = nn.Linear(128, 4)
        self.norm = nn.LayerNorm(128)
        self.to(dtype)

    def forward(self, x):
        return self.out(self.norm(torch.relu(self.fc(self.emb(x))))).float()


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (8, 5), generator=g), torch.randint(0, 4, (8,), generator=g)


def _loss(model, seed=0):
    x, y = _batch(seed)
    return nn.functional.cross_entropy(model(x).mean(1), y)


def _make(name, backend, dtype, compensation="auto", **options):
    if backend == "torchao":
        pytest.importorskip("torchao")
    model = Net(dtype)
    opt = hfe.create_optimizer(model, name, lr=1e-2, weight_decay=0.01, backend=backend, compensation=compensation,
                               **options)
    return model, opt


def _train(model, opt, steps, start=0):
    for i in range(start, start + steps):
        _loss(model, i).backward()
        opt.step()
        opt.zero_grad()


def _snapshot(model, opt):
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    return [p.detach().clone() for p in model.parameters()], buf.getvalue()


def _assert_unchanged(model, opt, snap):
    params, state = snap
    for a, b in zip(model.parameters(), params):
        assert torch.equal(a, b)
    assert _snapshot(model, opt)[1] == state


# --- non-finite gradients ------------------------------------------------------------------------------


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_nonfinite_raise_refuses_before_touching_state(name, backend, dtype, compensation):
    model, opt = _make(name, backend, dtype, compensation=compensation)
    _train(model, opt, 2)
    snap = _snapshot(model, opt)
    _loss(model).backward()
    model.out.weight.grad[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match=r"'out.weight' at step 3; nothing was updated.*nonfinite=skip"):
        opt.step()
    _assert_unchanged(model, opt, snap)


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_nonfinite_skip_counts_and_training_goes_on(name, backend, dtype, compensation, caplog):
    model, opt = _make(name, backend, dtype, compensation=compensation, nonfinite="skip")
    _train(model, opt, 2)
    snap = _snapshot(model, opt)
    _loss(model).backward()
    model.fc.weight.grad[3, 3] = float("nan")
    with caplog.at_level(logging.WARNING, logger="hf_efficient.guard"):
        opt.step()
    assert "step 3 skipped" in caplog.text and "'fc.weight'" in caplog.text
    opt.zero_grad()
    params_before = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(params_before, snap[0]))
    assert hfe.optimizer_info(opt).skipped_steps == 1
    _train(model, opt, 1, start=5)  # a finite step proceeds and changes weights, state stays finite
    assert not torch.equal(model.fc.weight, params_before[1])
    for st in opt.state_dict()["state"].values():
        for v in st.values():
            if torch.is_tensor(v) and v.is_floating_point():
                assert torch.isfinite(v).all()
    assert opt.state_dict()["hf_efficient"]["skipped_steps"] == 1


@pytest.mark.parametrize("name,dtype,big", [("adamw", torch.float32, 1.8e19), ("adamw_bf16", torch.bfloat16, 1.8e19),
                                             ("adamw_bf16", torch.float16, 6e4)])
def test_large_finite_gradients_are_not_mistaken_for_overflow(name, dtype, big):
    """The largest gradients whose square is finite (below 2**64; fp16's largest) train; from 2**64 on (the square
    overflows fp32, the second moment would be inf) a finite gradient is refused like an inf."""
    model, opt = _make(name, None, dtype)
    _loss(model).backward()
    model.fc.weight.grad.fill_(big)
    opt.step()  # nonfinite=raise must not raise
    assert torch.isfinite(model.fc.weight).all()
    for st in opt.state_dict()["state"].values():
        assert all(torch.isfinite(v).all() for v in st.values() if torch.is_tensor(v) and v.is_floating_point())
    for huge in ([2e19, 3e38] if dtype != torch.float16 else []) + [float("inf")]:
        _loss(model).backward()
        model.fc.weight.grad.fill_(big)
        model.fc.weight.grad[3, 5] = huge
        snap = _snapshot(model, opt)
        with pytest.raises(FloatingPointError, match="fc.weight"):
            opt.step()
        _assert_unchanged(model, opt, snap)
        opt.zero_grad()


@pytest.mark.parametrize("threads", [1, 2])
def test_the_c_scan_and_the_torch_check_agree(threads):
    """On CPU the check scans the gradients' bits in C (one call for all); elsewhere it sums them in torch. Both
    name the same first bad gradient, wherever its inf, NaN or overflowing value (|g| >= 2**64) sits (both halves
    of a split over 2 threads), and neither flags the largest values whose square is finite."""
    from hf_efficient import nonfinite

    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        grads = [torch.randn(300_001, generator=g).to(dt) for dt in (torch.float32, torch.bfloat16, torch.float16)]
        grads += [torch.randn(7, 5, generator=g), torch.zeros(0), torch.full((999,), 65504.0, dtype=torch.float16),
                  torch.full((999,), 1.8e19, dtype=torch.bfloat16)]  # just below 2**64: finite square
        native = nonfinite._first_bad_native(grads)
        if native is None:
            pytest.skip("no C compiler: the C scan is not built here")
        assert native == nonfinite._first_bad_torch(grads) == -1
        for i, pos, value in [(0, 300_000, float("inf")), (1, 0, float("nan")), (2, 150_000, -float("inf")),
                              (3, 34, float("nan")), (6, 998, float("inf")), (0, 7, 2e19), (1, 299_999, -3e38)]:
            bad = [t.clone() for t in grads]
            bad[i].view(-1)[pos] = value
            bad[-1].view(-1)[0] = float("nan")  # a later bad gradient: the first one is named
            assert nonfinite._first_bad_native(bad) == nonfinite._first_bad_torch(bad) == i
        strided = [grads[3].t()]  # not contiguous: the torch check
        assert nonfinite._first_bad_native(strided) is None and nonfinite._first_bad_torch(strided) == -1
    finally:
        torch.set_num_threads(n)


def test_nonfinite_ignore_is_torchs_behaviour():
    model, opt = _make("adamw", None, torch.float32, nonfinite="ignore")
    _loss(model).backward()
    model.fc.weight.grad[0, 0] = float("nan")
    opt.step()
    assert torch.isnan(model.fc.weight[0, 0])


def test_grad_scaler_skip_still_works():
    """fp16-style loss scaling: on overflow the scaler skips the step itself; ours is not even called."""
    model, opt = _make("adam8bit", "bnb", torch.float32)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(_loss(model)).backward()
    model.fc.weight.grad[0, 0] = float("inf")  # what an fp16 overflow leaves behind
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    opt.zero_grad()
    scaler.scale(_loss(model)).backward()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(model.fc.weight, before[1])


# --- bad input: each raised at the point of the mistake, nothing half-applied ---------------------------

BAD_CREATE = [
    (dict(name="hf_eff_adamx"), ValueError, "Unknown hf_efficient optimizer"),
    (dict(name="adam8bit", nonfinite="sometimes"), ValueError, r"'nonfinite' must be one of \['raise', 'skip'"),
    (dict(name="adam8bit", nonfinte="skip"), ValueError, "Did you mean 'nonfinite'"),
    (dict(name="adamw", lr=-1.0), ValueError, "lr=-1.0"),
    (dict(name="adamw_bf16", betas=(0.9, 1.5)), ValueError, "beta2=1.5"),
    (dict(name="adam8bit", eps=-1e-8), ValueError, "eps=-1e-08"),
    (dict(name="adafactor", weight_decay=-0.1), ValueError, "weight_decay=-0.1"),
    (dict(name="adafactor", clip_threshold=0), ValueError, "'clip_threshold' must be > 0"),
    (dict(name="adamw", backend="bnb"), ValueError, "not a backend of hf_eff_adamw"),
]


@pytest.mark.parametrize("kwargs, exc, match", BAD_CREATE)
def test_bad_create_arguments(kwargs, exc, match):
    kwargs = dict(kwargs)
    with pytest.raises(exc, match=match):
        hfe.create_optimizer(Net(), kwargs.pop("name"), **kwargs)


def test_bad_parameters():
    with pytest.raises(TypeError, match=r"hf_eff_adam8bit cannot train parameter 'w' of dtype float64"):
        hfe.create_optimizer([("w", nn.Parameter(torch.zeros(4, dtype=torch.float64)))], "adam8bit")
    with pytest.raises(ValueError, match="meta device"):
        hfe.create_optimizer([nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, device="meta"))], "adamw")
    with pytest.raises(ValueError, match="empty parameter list"):
        hfe.create_optimizer([], "adafactor")
    with pytest.raises(ValueError, match="no trainable parameters"):
        hfe.create_optimizer(Net().requires_grad_(False), "adamw")


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_add_param_group_is_validated(name, backend, dtype, compensation):
    model, opt = _make(name, backend, dtype, compensation=compensation)
    n_groups = len(opt.param_groups)
    extra = nn.Parameter(torch.zeros(8, 8, dtype=dtype))
    with pytest.raises(ValueError, match="lr=-0.5"):
        opt.add_param_group({"params": [extra], "lr": -0.5})
    with pytest.raises(TypeError, match="dtype int32"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(8, dtype=torch.int32), requires_grad=False)]})
    with pytest.raises(ValueError, match="on the meta device"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(8, device="meta", dtype=dtype))]})
    assert len(opt.param_groups) == n_groups
    opt.add_param_group({"params": [extra], "lr": 1e-3})  # a good one is taken and trained
    assert len(opt.param_groups) == n_groups + 1
    (_loss(model) + extra.float().sum()).backward()
    opt.step()
    assert opt.state[extra]


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_load_state_of_another_optimizer_or_model_is_refused(name, backend, dtype, compensation):
    model, opt = _make(name, backend, dtype, compensation=compensation)
    _train(model, opt, 2)
    snap = _snapshot(model, opt)
    other_name = "adafactor" if name != "adafactor" else "adamw"
    other_model, other = _make(other_name, None, dtype)
    _train(other_model, other, 1)
    with pytest.raises(ValueError, match=f"written by hf_eff_{other_name}"):
        opt.load_state_dict(other.state_dict())
    # a plain torch AdamW state (no tag) is refused by Adafactor, whose second moments are factored; the AdamW-math
    # names convert it (tests/test_checkpoint.py)
    if name == "adafactor":
        plain = torch.optim.AdamW(hfe.build_param_groups(model))  # same grouping, another kind of state
        _loss(model).backward()
        plain.step()
        plain.zero_grad()
        snap = _snapshot(model, opt)
        with pytest.raises(ValueError, match="another optimizer"):
            opt.load_state_dict(plain.state_dict())
    # same optimizer, another model: shapes do not fit
    wide = Net(dtype)
    wide.fc = nn.Linear(64, 128 * 2).to(dtype)
    wide.out, wide.norm = nn.Linear(256, 4).to(dtype), nn.LayerNorm(256).to(dtype)
    other_opt = hfe.create_optimizer(wide, name, lr=1e-2, backend=backend)
    _train(wide, other_opt, 1)
    with pytest.raises(ValueError, match=r"'fc.weight' has \w+ of shape \(256.*another model"):
        opt.load_state_dict(other_opt.state_dict())
    _assert_unchanged(model, opt, snap)


# --- checkpoints: weights_only, round trips, cross-backend ----------------------------------------------


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_state_dict_round_trip_equals_uninterrupted(name, backend, dtype, compensation):
    model, opt = _make(name, backend, dtype, compensation=compensation)
    _train(model, opt, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    _train(model, opt, 3, start=3)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2, opt2 = _make(name, backend, dtype, compensation=compensation)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optim"])
    _train(model2, opt2, 3, start=3)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def _canonical_state(opt):
    return {k: {kk: vv for kk, vv in v.items()} for k, v in opt.state_dict()["state"].items()}


@pytest.mark.parametrize("src, dst", [("bnb", "torchao"), ("torchao", "bnb"), ("bnb", "torch"), ("torch", "torchao")])
def test_8bit_state_moves_between_backends_exactly(src, dst):
    pytest.importorskip("torchao")
    model, opt = _make("adam8bit", src, torch.float32)
    _train(model, opt, 3)
    sd = opt.state_dict()
    assert sd["hf_efficient"]["backend"] == src
    assert sd["state"][1]["exp_avg"].dtype == torch.uint8  # fc.weight is quantized in the canonical layout
    model2, opt2 = _make("adam8bit", dst, torch.float32)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(copy.deepcopy(sd))
    back = opt2.state_dict()
    for pid, st in sd["state"].items():
        for key, value in st.items():
            assert torch.equal(back["state"][pid][key].float(), value.float()), (pid, key)
    # and training continues on the other backend close to the original one (different kernels)
    _train(model, opt, 3, start=3)
    _train(model2, opt2, 3, start=3)
    for a, b in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=0)


def test_untagged_bnb_state_loads_into_our_bnb_optimizer():
    """A checkpoint from a bare bitsandbytes AdamW8bit (no tag, bnb's own layout) is read in that layout."""
    bnb = pytest.importorskip("bitsandbytes")
    model = Net()
    bare = bnb.optim.AdamW8bit(model.parameters(), lr=1e-2)
    _train(model, bare, 2)
    opt = hfe.create_optimizer(model.parameters(), "adam8bit", lr=1e-2, backend="bnb")
    opt.load_state_dict(bare.state_dict())
    assert opt.state_dict()["state"][1]["exp_avg"].dtype == torch.uint8


# --- generic torch.optim behaviour, one suite for every name ---------------------------------------------


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_generic_optimizer_behaviour(name, backend, dtype, compensation):
    model, opt = _make(name, backend, dtype, compensation=compensation)
    calls = []
    h1 = opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    h2 = opt.register_step_post_hook(lambda o, a, k: calls.append("post"))

    def closure():
        opt.zero_grad()
        loss = _loss(model)
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

    model, opt = _make(name, backend, dtype, compensation=compensation)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=6)
    lrs = []
    for i in range(4):
        _train(model, opt, 1, start=i)
        sched.step()
        lrs.append(float(opt.param_groups[0]["lr"]))  # torchao keeps lr as a tensor
    # warm-up 2 steps then linear decay to 0 at step 6: lr(t) = t/2 for t < 2, else (6 - t) / 4
    assert lrs == pytest.approx([0.5e-2, 1e-2, 0.75e-2, 0.5e-2], rel=1e-6)  # torchao: an fp32 tensor
    model2, opt2 = _make(name, backend, dtype, compensation=compensation)
    step_lr = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    _train(model2, opt2, 1)
    step_lr.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(5e-3)
