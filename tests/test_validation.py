"""Validation: bad arguments, parameters and hyperparameters (non-finite ones included) are refused where the
mistake is made, with a message that names it, and nothing is half-applied; a group flag a backend does not
implement is refused rather than ignored.

Cases over every name/backend come from tests/cases.py (the registry).
"""

import pytest
import torch
from torch import nn

import hf_efficient as hfe
from hf_efficient.registry import SPECS

from cases import CASES, cases, names
from helpers import INF, NAN, Net, loss_of, make, train


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


@pytest.mark.parametrize("params, exc, match", [
    ([{"params": []}], ValueError, "param group 0 has no parameters"),
    ([1.0], TypeError, "is a float, not a tensor"),
    ([{"lr": 0.1}], TypeError, "must be a dict with a 'params' list"),
])
def test_messages_name_the_mistake(params, exc, match):
    with pytest.raises(exc, match=match):
        hfe.create_optimizer(params, "adamw")


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
def test_duplicate_parameters_are_refused(name, backend, dtype, compensation):
    if backend == "torchao":
        pytest.importorskip("torchao")
    p = nn.Parameter(torch.zeros(64, 64, dtype=dtype))
    with pytest.raises(ValueError, match="same tensor"):
        hfe.create_optimizer([p, p], name, backend=backend)
    with pytest.raises(ValueError, match="same tensor"):
        hfe.create_optimizer([{"params": [p]}, {"params": [p]}], name, backend=backend)
    model, opt = make(name, backend, dtype, compensation=compensation)
    groups = len(opt.param_groups)
    with pytest.raises(ValueError, match="same tensor"):
        opt.add_param_group({"params": [model.fc.weight]})
    q = nn.Parameter(torch.zeros(8, dtype=dtype))
    with pytest.raises(ValueError, match="same tensor"):
        opt.add_param_group({"params": [q, q]})
    assert len(opt.param_groups) == groups


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=INF), "lr=inf"), (dict(lr=NAN), "lr=nan"), (dict(weight_decay=INF), "weight_decay=inf"),
    (dict(eps=0.0), "eps=0.0"), (dict(eps=INF), "eps=inf"), (dict(lr=torch.tensor(1e-3)), "lr=tensor"),
    (dict(betas=0.9), r"betas=0.9: expected a pair"), (dict(betas=(0.9, NAN)), "beta2=nan"),
])
@pytest.mark.parametrize("name", names(lambda spec: spec.uses_betas and spec.facts.uses_eps))  # betas and eps too
def test_non_finite_hyperparameters_are_refused(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        hfe.create_optimizer(Net(), name, **kwargs)


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


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_add_param_group_is_validated(name, backend, dtype, compensation):
    model, opt = make(name, backend, dtype, compensation=compensation)
    n_groups = len(opt.param_groups)
    extra = nn.Parameter(torch.zeros(8, 8, dtype=dtype))
    with pytest.raises(ValueError, match="lr=-0.5"):
        opt.add_param_group({"params": [extra], "lr": -0.5})
    with pytest.raises(TypeError, match="dtype int32"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(8, dtype=torch.int32), requires_grad=False)]})
    with pytest.raises(ValueError, match="on the meta device"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(8, device="meta", dtype=dtype))]})
    assert len(opt.param_groups) == n_groups
    if "muon" in opt.param_groups[0]:  # Muon's groups say who steps them: refused without, taken with it
        with pytest.raises(ValueError, match="each param group says whether Muon steps it"):
            opt.add_param_group({"params": [extra], "lr": 1e-3})
        with pytest.raises(ValueError, match=r"shape \(8,\): Muon orthogonalises matrices"):
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(8, dtype=dtype))], "muon": True})
    good = {"params": [extra], "lr": 1e-3, **({"muon": True} if "muon" in opt.param_groups[0] else {})}
    opt.add_param_group(good)  # a good one is taken and trained
    assert len(opt.param_groups) == n_groups + 1
    (loss_of(model) + extra.float().sum()).backward()
    opt.step()
    assert opt.state[extra]


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
@pytest.mark.parametrize("bad", [dict(lr=INF), dict(weight_decay=INF), dict(lr=torch.tensor(0.1))])
def test_add_param_group_refuses_non_finite_hyperparameters(name, backend, dtype, compensation, bad):
    model, opt = make(name, backend, dtype, compensation=compensation)
    extra = nn.Parameter(torch.zeros(8, 8, dtype=dtype))
    groups = len(opt.param_groups)
    with pytest.raises(ValueError, match="lr=|weight_decay="):
        opt.add_param_group({"params": [extra], **bad})
    assert len(opt.param_groups) == groups


@pytest.mark.parametrize("name, backend, dtype, compensation",
                         cases(where=lambda spec: "maximize" not in spec.facts.flags))
def test_maximize_is_refused_where_it_would_be_ignored(name, backend, dtype, compensation):
    model, opt = make(name, backend, dtype, compensation=compensation)
    with pytest.raises(ValueError, match="maximize=True"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(8, dtype=dtype))], "maximize": True})
    with pytest.raises(ValueError, match="maximize=True"):
        hfe.create_optimizer([{"params": [nn.Parameter(torch.zeros(8, dtype=dtype))], "maximize": True}], name,
                             backend=backend)


def test_maximize_is_honoured_by_adamw():
    model, opt = make("adamw", None, torch.float32)
    opt.param_groups[0]["maximize"] = True
    before = loss_of(model).item()
    train(model, opt, 3)
    assert loss_of(model).item() > before
