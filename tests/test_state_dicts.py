"""State dicts and copies: a save / load round trip continues exactly like an uninterrupted run; state of another
optimizer or model is refused, nothing half-applied; 8-bit state moves between backends exactly; a bare
bitsandbytes state loads; deepcopy, pickle and torch.save give a guarded optimizer that continues exactly.
Conversions between families and checkpoint validation are in tests/test_checkpoint.py.

Cases over every name/backend come from tests/cases.py (the registry).
"""

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import hf_efficient as hfe

from cases import CASES
from helpers import INF, Net, assert_unchanged, loss_of, make, net_options, snapshot, train


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_state_dict_round_trip_equals_uninterrupted(name, backend, dtype, compensation):
    model, opt = make(name, backend, dtype, compensation=compensation)
    train(model, opt, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    train(model, opt, 3, start=3)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2, opt2 = make(name, backend, dtype, compensation=compensation)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optim"])
    train(model2, opt2, 3, start=3)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_load_state_of_another_optimizer_or_model_is_refused(name, backend, dtype, compensation):
    model, opt = make(name, backend, dtype, compensation=compensation)
    train(model, opt, 2)
    snap = snapshot(model, opt)
    other_name = "adafactor" if name != "adafactor" else "adamw"
    other_model, other = make(other_name, None, dtype)
    train(other_model, other, 1)
    with pytest.raises(ValueError, match=f"written by hf_eff_{other_name}"):
        opt.load_state_dict(other.state_dict())
    # a plain torch AdamW state (no tag) is refused by Adafactor, whose second moments are factored; the AdamW-math
    # names convert it (tests/test_checkpoint.py)
    if name == "adafactor":
        plain = torch.optim.AdamW(hfe.build_param_groups(model))  # same grouping, another kind of state
        loss_of(model).backward()
        plain.step()
        plain.zero_grad()
        snap = snapshot(model, opt)
        with pytest.raises(ValueError, match="another optimizer"):
            opt.load_state_dict(plain.state_dict())
    # same optimizer, another model: shapes do not fit
    wide = Net(dtype)
    wide.fc = nn.Linear(64, 128 * 2).to(dtype)
    wide.out, wide.norm = nn.Linear(256, 4).to(dtype), nn.LayerNorm(256).to(dtype)
    other_opt = hfe.create_optimizer(wide, name, lr=1e-2, backend=backend, **net_options(name))
    train(wide, other_opt, 1)
    with pytest.raises(ValueError, match=r"'fc.weight' has \w+ of shape \(256.*another model"):
        opt.load_state_dict(other_opt.state_dict())
    assert_unchanged(model, opt, snap)


@pytest.mark.parametrize("src, dst", [("bnb", "torchao"), ("torchao", "bnb"), ("bnb", "torch"), ("torch", "torchao")])
def test_8bit_state_moves_between_backends_exactly(src, dst):
    pytest.importorskip("torchao")
    model, opt = make("adam8bit", src, torch.float32)
    train(model, opt, 3)
    sd = opt.state_dict()
    assert sd["hf_efficient"]["backend"] == src
    assert sd["state"][1]["exp_avg"].dtype == torch.uint8  # fc.weight is quantized in the canonical layout
    model2, opt2 = make("adam8bit", dst, torch.float32)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(copy.deepcopy(sd))
    back = opt2.state_dict()
    for pid, st in sd["state"].items():
        for key, value in st.items():
            assert torch.equal(back["state"][pid][key].float(), value.float()), (pid, key)
    # and training continues on the other backend close to the original one (different kernels)
    train(model, opt, 3, start=3)
    train(model2, opt2, 3, start=3)
    for a, b in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=0)


def test_untagged_bnb_state_loads_into_our_bnb_optimizer():
    """A checkpoint from a bare bitsandbytes AdamW8bit (no tag, bnb's own layout) is read in that layout."""
    bnb = pytest.importorskip("bitsandbytes")
    model = Net()
    bare = bnb.optim.AdamW8bit(model.parameters(), lr=1e-2)
    train(model, bare, 2)
    opt = hfe.create_optimizer(model.parameters(), "adam8bit", lr=1e-2, backend="bnb")
    opt.load_state_dict(bare.state_dict())
    assert opt.state_dict()["state"][1]["exp_avg"].dtype == torch.uint8


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
    model, opt = make(name, backend, dtype, compensation=compensation)
    train(model, opt, 2)
    reference = copy.deepcopy({"model": model, "opt": opt})
    train(reference["model"], reference["opt"], 2, start=2)
    for how, twin in _copies({"model": model, "opt": opt}):
        twin_model, twin_opt = twin["model"], twin["opt"]
        assert type(twin_opt).__name__ == type(opt).__name__, how
        assert twin_opt.state_dict()["hf_efficient"]["steps"] == 2, how
        loss_of(twin_model, 5).backward()
        twin_model.fc.weight.grad[0, 0] = INF
        with pytest.raises(FloatingPointError):
            twin_opt.step()
        twin_opt.zero_grad()
        train(twin_model, twin_opt, 2, start=2)
        for a, b in zip(twin_model.parameters(), reference["model"].parameters()):
            assert torch.equal(a, b), how
        assert twin_opt.state_dict()["hf_efficient"]["steps"] == 4, how
