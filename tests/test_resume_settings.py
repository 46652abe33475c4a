"""Resuming under other settings than the checkpoint's, and state that only some loaders meet (issue 22).

Every name that compensates (the registry's torch backends with ``compensates``) crossed with every ordered pair of
compensation modes: the setting asked for now wins, buffers follow it, and the log says what changed.
"""

from __future__ import annotations

import copy
import itertools
import logging

import pytest
import torch

import hf_efficient as hfe
from hf_efficient.optim.compensation import COMPENSATIONS
from cases import bare, cls_of, names, plain, quantized, spec_of
from hf_efficient.optim._blockwise import Blockwise8bit

COMPENSATING = names(lambda spec: spec.backends["torch"].compensates)
PAIRS = [(a, b) for a, b in itertools.permutations(COMPENSATIONS, 2)]


def _grad(p, seed):
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 0.1 * torch.randn(p.shape, generator=g)).to(p.dtype)


def _built(name, p, mode):
    return hfe.create_optimizer(bare(name, [p]), name, lr=1e-3, weight_decay=0.0, compensation=mode)


def _as_if_saved_under(sd, mode, p):
    """``sd`` as a run under ``mode`` would have saved it: its groups' compensation and its Kahan buffers."""
    sd = copy.deepcopy(sd)
    for g in sd["param_groups"]:
        g["compensation"] = mode
    for st in sd["state"].values():
        st.pop("kahan_comp", None)
        if mode == "kahan":
            st["kahan_comp"] = torch.zeros(p.shape, dtype=torch.bfloat16)
    return sd


def test_every_compensating_name_is_covered():
    assert {"adamw", "adam8bit", "lion8bit", "adafactor", "adamw_bf16", "sgdm8bit"} <= set(plain(COMPENSATING))


@pytest.mark.parametrize("name", COMPENSATING)
@pytest.mark.parametrize("saved, built", PAIRS)
def test_resume_under_another_compensation_follows_the_new_setting(name, saved, built, caplog):
    start = torch.rand(64, 128).add(1.0).to(torch.bfloat16)  # 8192 elements: 8-bit state where the name has one
    p = torch.nn.Parameter(start.clone())
    opt = _built(name, p, saved)
    for seed in (1, 2):
        p.grad = _grad(p, seed)
        opt.step()
    sd = opt.state_dict()

    q = torch.nn.Parameter(p.detach().clone())
    resumed = _built(name, q, built)
    with caplog.at_level(logging.INFO, logger="hf_efficient"):
        resumed.load_state_dict(sd)
    assert resumed.param_groups[0]["compensation"] == built == hfe.optimizer_info(resumed).options["compensation"]
    comp = resumed.state[q].get("kahan_comp")
    assert (comp is not None) == (built == "kahan")
    if comp is not None:
        assert comp.dtype == torch.bfloat16 and not comp.any()  # nothing owed yet
    assert ("dropped the saved kahan_comp" in caplog.text) == (saved == "kahan")
    assert ("starts at zero" in caplog.text) == (built == "kahan")

    # it steps as a run saved under the new setting would (the same moments, its buffer)
    r = torch.nn.Parameter(p.detach().clone())
    reference = _built(name, r, built)
    reference.load_state_dict(_as_if_saved_under(sd, built, p))
    for seed in (3, 4):
        q.grad, r.grad = _grad(q, seed), _grad(r, seed)
        resumed.step()
        reference.step()
    assert torch.equal(q, r)
    assert resumed.state_dict()["param_groups"][0]["compensation"] == built


def _flag_hook(optimizer):
    """torch's own test of load_state_dict post-hooks (test_optim.py) stores a bool in ``optimizer.state``."""
    optimizer.state["ran_load_state_dict_post_hook"] = True


@pytest.mark.parametrize("name", names())
@pytest.mark.parametrize("how", ["create_optimizer", "class"])
def test_a_load_hook_may_store_a_non_dict_in_the_state(name, how, recwarn):
    p = torch.nn.Parameter(torch.ones(16, 32, dtype=torch.bfloat16))
    if how == "class":
        opt = hfe.resolve(name, device="cpu").optimizer_cls(bare(name, [p]), lr=1e-3)
    else:
        opt = hfe.create_optimizer(bare(name, [p]), name, lr=1e-3)
    opt.register_load_state_dict_post_hook(_flag_hook)
    p.grad = torch.ones_like(p)
    opt.step()
    opt.load_state_dict(opt.state_dict())
    assert opt.state["ran_load_state_dict_post_hook"] is True
    p.grad = torch.ones_like(p)
    opt.step()


@pytest.mark.parametrize("name", names(lambda spec: not issubclass(cls_of(spec), Blockwise8bit)))  # torch's loader
def test_a_parameters_state_that_is_not_a_dict_is_refused(name):
    p = torch.nn.Parameter(torch.ones(16, 32, dtype=torch.bfloat16))
    opt = hfe.create_optimizer(bare(name, [p]), name, lr=1e-3)
    opt = opt._hf_eff_base(bare(name, [p]), lr=1e-3)  # the family's class, without create_optimizer's protection
    p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    before = copy.deepcopy(opt.state[p])
    sd["state"][0] = True
    with pytest.raises(ValueError, match="state of parameter 0 is a bool"):
        opt.load_state_dict(sd)
    assert all(torch.equal(v, before[k]) for k, v in opt.state[p].items())  # nothing loaded


EIGHT_BIT = names(quantized)


@pytest.mark.parametrize("name", EIGHT_BIT)
@pytest.mark.parametrize("how", ["create_optimizer", "class"])
def test_absurd_finite_state_is_refused(name, how):
    """An edited checkpoint: a fractional step, or a first moment's absmax beyond any gradient's (x 1e30)."""
    p = torch.nn.Parameter(torch.rand(64, 128))
    opt = hfe.create_optimizer(bare(name, [p]), name, lr=1e-3, backend="torch")
    if how == "class":
        opt = opt._hf_eff_base(bare(name, [p]), lr=1e-3)
    p.grad = torch.ones_like(p)
    opt.step()
    good = opt.state_dict()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    first = f"{spec_of(name).facts.moments[0][0]}_absmax"  # a first moment's
    for key, edit, match in [("step", lambda t: t.add_(0.5), r"has step 1\.5: .*whole number"),
                             (first, lambda t: t.mul_(1e30), f"{first} holding values of magnitude")]:
        sd = copy.deepcopy(good)
        edit(sd["state"][0][key])
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(sd)
        assert all(torch.equal(v, before[k]) for k, v in opt.state[p].items())  # nothing loaded
    opt.load_state_dict(good)


def test_torchao_full_precision_tensors_are_counted_logged_and_said_on_load(caplog):
    """torchao keeps fp32 state for tensors not made of whole 256-element blocks: the estimate counts it, the build
    names them, and a torch 8-bit checkpoint loaded into torchao says which tensors came back as fp32 moments."""
    pytest.importorskip("torchao")

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(300, 32), torch.nn.Linear(32, 256))  # 9600: not whole blocks

    src = model()
    opt = hfe.create_optimizer(src, "adam8bit", backend="torch", embedding_state="8bit")
    src(torch.arange(10)).sum().backward()
    opt.step()
    dst = model()
    with caplog.at_level(logging.INFO, logger="hf_efficient"):
        ao = hfe.create_optimizer(dst, "adam8bit", backend="torchao", embedding_state="8bit")
        assert "1 tensor(s) keep full-precision state" in caplog.text and "0.weight" in caplog.text
        caplog.clear()
        ao.load_state_dict(opt.state_dict())
    assert "8-bit state for 1 tensor(s) that this backend keeps in full precision" in caplog.text
    assert "0.weight" in caplog.text and "1.weight" not in caplog.text
    dst(torch.arange(10)).sum().backward()
    ao.step()
    fresh_model = model()
    fresh = hfe.create_optimizer(fresh_model, "adam8bit", backend="torchao", embedding_state="8bit")
    fresh_model(torch.arange(10)).sum().backward()
    fresh.step()
    estimate = hfe.estimate_memory(fresh_model, "adam8bit", backend="torchao", embedding_state="8bit").state_bytes
    assert estimate == hfe.optimizer_state_bytes(fresh)
