"""Issue 12, items 7-9: foreign optimizer state is converted (or refused, saying how to resume), a checkpoint is
validated completely before anything is loaded, and parameters are matched by name.

"Nothing half-applied" uses tests/helpers.py's snapshot: parameters and the serialized optimizer state before
the refused load equal those after it.
"""

import copy
import logging

import pytest
import torch
from torch import nn

import hf_efficient as hfe
from hf_efficient import checkpoint
from hf_efficient.registry import SPECS, families, get_spec
from cases import CASES
from helpers import Net, assert_unchanged, make, snapshot, train

BACKENDS_8BIT = ["torch", "bnb", "torchao"]


def _by_name(sd: dict) -> dict:
    """Per-parameter state of a state dict, keyed by parameter name."""
    return {n: sd["state"].get(pid) for g in sd["param_groups"] for n, pid in zip(g["param_names"], g["params"])}


def _moments(st: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 moments of a canonical state (8-bit codes decoded with the maps every backend shares)."""
    from hf_efficient.optim.quant8 import dequantize_blockwise

    if st["exp_avg"].dtype != torch.uint8:
        return st["exp_avg"].float(), st["exp_avg_sq"].float()
    return tuple(dequantize_blockwise(st[k], st[f"{k}_absmax"], k == "exp_avg").view(st[k].shape)
                 for k in ("exp_avg", "exp_avg_sq"))


def _torch_adamw(model, steps=2):
    """A transformers ``adamw_torch`` run: torch.optim.AdamW over the same groups, no hf_efficient tag."""
    opt = torch.optim.AdamW(hfe.build_param_groups(model, weight_decay=0.01), lr=1e-2)
    train(model, opt, steps)
    return opt


# --- item 7: foreign state is converted to the loading optimizer's format, with a log line ------------------


def _foreign_adamw(source: str):
    """Trained fp32 AdamW state: untagged (torch.optim.AdamW, as transformers' adamw_torch) or hf_eff_adamw's."""
    if source == "torch.optim.AdamW":
        return _torch_adamw(Net())
    model, opt = make("adamw", None, torch.float32)
    train(model, opt, 2)
    return opt


@pytest.mark.parametrize("source", ["torch.optim.AdamW", "hf_eff_adamw"])
@pytest.mark.parametrize("backend", BACKENDS_8BIT)
def test_adamw_state_is_quantized_where_adam8bit_keeps_8bit_state(backend, source, caplog):
    model, opt = make("adam8bit", backend, torch.float32)
    sd = _foreign_adamw(source).state_dict()
    with caplog.at_level(logging.WARNING, logger="hf_efficient.checkpoint"):
        opt.load_state_dict(copy.deepcopy(sd))
    assert "fc.weight" in caplog.text and "quantized to 8-bit" in caplog.text
    assert ("untagged fp32 AdamW" if source == "torch.optim.AdamW" else "hf_eff_adamw") in caplog.text
    loaded, saved = _by_name(opt.state_dict()), _by_name(sd)
    assert loaded["fc.weight"]["exp_avg"].dtype == torch.uint8  # 8-bit by the optimizer's own rule
    assert loaded["emb.weight"]["exp_avg"].dtype == torch.float32  # embeddings keep 32-bit state
    for name, st in loaded.items():
        m, v = _moments(st)
        m0, v0 = saved[name]["exp_avg"], saved[name]["exp_avg_sq"]
        torch.testing.assert_close(m, m0, atol=m0.abs().max().item() / 20, rtol=0)  # 8-bit resolution
        torch.testing.assert_close(v, v0, atol=v0.max().item() / 20, rtol=0)
        assert not bool(((v == 0) & (v0 > 0)).any())  # no second moment rounded to 0
    # the same bytes as state this optimizer made itself (fp32 state would be 736 KB, not 320 KB)
    fresh_model, fresh = make("adam8bit", backend, torch.float32)
    train(fresh_model, fresh, 1)
    assert hfe.optimizer_state_bytes(opt) == hfe.optimizer_state_bytes(fresh)
    train(model, opt, 1, start=2)
    assert _by_name(opt.state_dict())["fc.weight"]["exp_avg"].dtype == torch.uint8


@pytest.mark.parametrize("backend", BACKENDS_8BIT + ["bare bnb", "bare torchao"])
def test_8bit_state_into_adamw_is_dequantized(backend, caplog):
    if backend.startswith("bare"):  # untagged, in the library's own layout
        lib = pytest.importorskip("bitsandbytes" if backend == "bare bnb" else "torchao")
        src_model = Net()
        src = (lib.optim.AdamW8bit)(hfe.build_param_groups(src_model, weight_decay=0.01), lr=1e-2)
        train(src_model, src, 2)
        sd = src.state_dict()
        canonical = {n: checkpoint._any_to_canonical(st, families()["adamw"])[0] for n, st in _by_name(sd).items()}
    else:
        src_model, src = make("adam8bit", backend, torch.float32)
        train(src_model, src, 2)
        sd = src.state_dict()
        canonical = _by_name(sd)
    model, opt = make("adamw", None, torch.float32)
    with caplog.at_level(logging.WARNING, logger="hf_efficient.checkpoint"):
        opt.load_state_dict(sd if backend == "bare torchao" else copy.deepcopy(sd))  # its subclass cannot deepcopy
    assert "8-bit moments dequantized" in caplog.text and "fc.weight" in caplog.text
    for name, st in _by_name(opt.state_dict()).items():  # exactly the values the codes stand for
        assert st["exp_avg"].dtype == torch.float32 and set(st) == {"step", "exp_avg", "exp_avg_sq"}
        for a, b in zip((st["exp_avg"], st["exp_avg_sq"]), _moments(canonical[name])):
            assert torch.equal(a, b), name
        assert st["step"].item() == 2
    train(model, opt, 1, start=2)


def test_bare_bitsandbytes_state_into_adam8bit_says_what_it_converted(caplog):
    """Untagged bitsandbytes AdamW8bit state into the family it belongs to: relabelled to the canonical layout
    (the same codes and scales), with the warning every conversion of an untagged state gives."""
    bnb = pytest.importorskip("bitsandbytes")
    src_model = Net()
    src = bnb.optim.AdamW8bit(hfe.build_param_groups(src_model, weight_decay=0.01), lr=1e-2)
    train(src_model, src, 2)
    sd = src.state_dict()
    model, opt = make("adam8bit", "torch", torch.float32)
    with caplog.at_level(logging.WARNING, logger="hf_efficient.checkpoint"):
        opt.load_state_dict(copy.deepcopy(sd))
    assert "written by an untagged bitsandbytes adamw8bit state" in caplog.text, caplog.text
    assert "layout relabelled" in caplog.text and "fc.weight" in caplog.text, caplog.text
    saved = checkpoint._any_to_canonical(_by_name(sd)["fc.weight"], families()["adamw8bit"])[0]
    loaded = _by_name(opt.state_dict())["fc.weight"]
    assert loaded["exp_avg"].dtype == torch.uint8
    assert all(torch.equal(loaded[k].reshape(-1), saved[k].reshape(-1)) for k in saved if k != "step")
    train(model, opt, 1, start=2)


@pytest.mark.parametrize("source", ["torch.optim.AdamW", "hf_eff_adamw"])
def test_fp32_adamw_state_into_adamw_bf16_is_cast_with_fresh_compensation(source, caplog):
    sd = _foreign_adamw(source).state_dict()
    model, opt = make("adamw_bf16", None, torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="hf_efficient.checkpoint"):
        opt.load_state_dict(copy.deepcopy(sd))
    assert "cast from float32 to bfloat16" in caplog.text and "Kahan compensation started at zero" in caplog.text
    saved = _by_name(sd)
    for name, st in _by_name(opt.state_dict()).items():
        assert torch.equal(st["exp_avg"], saved[name]["exp_avg"].bfloat16())
        assert torch.equal(st["exp_avg_sq"], saved[name]["exp_avg_sq"].bfloat16())
        assert st["kahan_comp"].dtype == torch.bfloat16 and not st["kahan_comp"].any()
    train(model, opt, 1, start=2)


def test_adamw_bf16_state_into_adamw_carries_the_compensation(caplog):
    """Both keep a Kahan buffer on bf16 weights: hf_eff_adamw takes it over, its bf16 moments widened to fp32; under
    compensation=none the buffer has no use and is dropped, saying so."""
    src_model, src = make("adamw_bf16", None, torch.bfloat16)
    train(src_model, src, 2)
    sd = src.state_dict()
    saved = _by_name(sd)
    model, opt = make("adamw", None, torch.bfloat16, compensation="kahan")
    opt.load_state_dict(copy.deepcopy(sd))
    for name, st in _by_name(opt.state_dict()).items():
        assert torch.equal(st["kahan_comp"], saved[name]["kahan_comp"])
        assert st["exp_avg"].dtype == torch.float32 and torch.equal(st["exp_avg"], saved[name]["exp_avg"].float())
    train(model, opt, 1, start=2)
    model, opt = make("adamw", None, torch.bfloat16, compensation="none")
    with caplog.at_level(logging.WARNING, logger="hf_efficient.checkpoint"):
        opt.load_state_dict(copy.deepcopy(sd))
    assert "Kahan compensation dropped" in caplog.text
    assert all("kahan_comp" not in st for st in _by_name(opt.state_dict()).values())
    train(model, opt, 1, start=2)


@pytest.mark.parametrize("name, backend", [("adamw", None), ("adam8bit", "bnb"), ("adamw_bf16", None)])
def test_adafactor_and_adamw_state_do_not_mix(name, backend):
    """Adafactor's factored statistics are not AdamW's moments: refused both ways, saying how to resume."""
    dtype = torch.bfloat16 if name == "adamw_bf16" else torch.float32
    af_model, af = make("adafactor", None, dtype)
    train(af_model, af, 1)
    model, opt = make(name, backend, dtype)
    train(model, opt, 1)
    for target, target_model, sd in ((opt, model, af.state_dict()), (af, af_model, opt.state_dict())):
        snap = snapshot(target_model, target)
        with pytest.raises(ValueError, match="resume with optim=hf_eff_.*or start the optimizer afresh"):
            target.load_state_dict(sd)
        assert_unchanged(target_model, target, snap)
    # an untagged torch AdamW state: its full second moment of a matrix is named, with the factored shapes expected
    snap = snapshot(af_model, af)
    plain = _torch_adamw(Net(dtype)).state_dict()
    with pytest.raises(ValueError, match=r"'emb.weight' has a full exp_avg_sq \(shape \(64, 64\)\); Adafactor keeps "
                                         r".*exp_avg_sq_row of shape \(64,\) and exp_avg_sq_col of shape \(64,\).*"
                                         r"another optimizer"):
        af.load_state_dict(plain)
    assert_unchanged(af_model, af, snap)


@pytest.mark.parametrize("name, backend", [("adam8bit", b) for b in BACKENDS_8BIT] + [("adamw_bf16", None)])
def test_amsgrad_adamw_state_is_refused_where_it_cannot_continue(name, backend):
    dtype = torch.bfloat16 if name == "adamw_bf16" else torch.float32
    src_model = Net(dtype)
    src = torch.optim.AdamW(hfe.build_param_groups(src_model), lr=1e-2, amsgrad=True)
    train(src_model, src, 1)
    model, opt = make(name, backend, dtype)
    train(model, opt, 1)
    snap = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"amsgrad=True, which hf_eff_\w+ does not continue: resume with "
                                         r"optim=hf_eff_adamw"):
        opt.load_state_dict(src.state_dict())
    assert_unchanged(model, opt, snap)


# --- item 8: everything is validated before anything is loaded ------------------------------------------


def _fc(sd: dict) -> dict:
    """fc.weight's state in a state dict (an 8-bit tensor under adam8bit, a matrix under Adafactor)."""
    return _by_name(sd)["fc.weight"]


def _fc_group(opt) -> tuple:
    """fc.weight and its param group in ``opt``."""
    return next((p, g) for g in opt.param_groups for n, p in zip(g["param_names"], g["params"]) if n == "fc.weight")


def _corrupt_state(name: str, backend, opt):
    """(what to do to a state dict, message expected) for every way a parameter's state can be broken."""
    fam = get_spec(name).facts
    eight_bit = fam.quantized
    required = fam.required(*_fc_group(opt))  # a matrix's state, with the default options (Muon's: a Muon matrix)
    tensors = [k for k, f in fam.state.items() if k in required and f.format in ("param", "codes", "row", "col")]
    # a moment: unsigned where the family has one (AdamW's second, Adafactor's row statistics), else its only one
    moment = next((k for k in tensors if not fam.state[k].signed), tensors[-1])
    first = next((k for k in tensors if fam.state[k].signed), None)  # the first moment (Adafactor: none by default)
    cases = [
        (lambda sd: _fc(sd).pop(moment), rf"'fc.weight' lacks \['{moment}'\].*incomplete"),
        (lambda sd: _fc(sd).pop("step"), r"'fc.weight' lacks \['step'\]"),
        (lambda sd: _fc(sd).__setitem__(moment, _fc(sd)[moment].tolist()), rf"{moment} of type list, not a tensor"),
        (lambda sd: _fc(sd).__setitem__("step", "x"), r"'fc.weight' has step 'x'"),
        (lambda sd: _fc(sd).__setitem__("step", torch.ones(3)), r"step a tensor of shape \(3,\)"),
        (lambda sd: _fc(sd).__setitem__(moment, _fc(sd)[moment][:3]), rf"{moment} of shape \(3,"),
        (lambda sd: _fc(sd).__setitem__(tensors[-1], torch.zeros_like(_fc(sd)[tensors[-1]], dtype=torch.int64)),
         r"of dtype torch.int64, but"),
    ]
    absmaxes = [f"{k}_absmax" for k, _ in fam.moments if k in required]
    nonfinite = absmaxes[-1] if eight_bit else moment
    cases += [
        (lambda sd: _fc(sd)[nonfinite].view(-1).__setitem__(0, float("nan")), rf"{nonfinite} holding non-finite"),
        (lambda sd: _fc(sd).__setitem__("step", torch.tensor(2.5)), r"has step 2\.5: .*whole number"),
    ]
    if eight_bit or not fam.state[moment].signed:  # a scale or a second moment (a Muon matrix's fp32 state has none)
        cases.append((lambda sd: _fc(sd)[nonfinite].view(-1).__setitem__(0, -1.0),
                      rf"{nonfinite} holding negative values"))
    first = f"{first}_absmax" if eight_bit else first
    blocks = fam.codec.blocks(Net().fc.weight.numel()) if eight_bit else None
    if first:  # finite, but beyond any first moment: the first step would move weights ~1e27
        cases.append((lambda sd: _fc(sd)[first].mul_(1e30), rf"{first} holding values of magnitude .* beyond what "
                                                             "any first moment reaches"))
    if eight_bit:  # the 8-bit layout: codes need their absmaxes (torchao read bare codes as fp32 moments)
        cases += [
            (lambda sd: _fc(sd).pop(first), rf"'fc.weight' lacks \['{first}'\]"),
            (lambda sd: [_fc(sd).pop(k) for k in absmaxes], r"lacks \[" + ", ".join(f"'{k}'" for k in absmaxes)),
            (lambda sd: _fc(sd).__setitem__(moment, _fc(sd)[moment].float()),
             # its family's other moments still codes: named as such; its only moment: the absmax is left over
             rf"{moment} of dtype torch.float32, but {fam.name} state keeps it in uint8 codes" if len(absmaxes) > 1
             else rf"\['{moment}_absmax'\] beside torch.float32 moments: absmaxes belong to uint8 codes"),
            (lambda sd: _fc(sd).__setitem__(first, _fc(sd)[first].half()),
             rf"{first} of dtype torch.float16.*float32"),
            (lambda sd: _fc(sd).__setitem__(first, _fc(sd)[first][:-1]),  # one scale short (fc.weight: 128 x 64)
             rf"{first} of shape \({blocks - 1},\).*\({blocks},\)"),
        ]
    return cases


def _corrupt_groups(name: str, group: dict):
    group_cases = [
        ("lr", "fast", r"param group 0 .*lr='fast'"),
        ("lr", float("nan"), r"param group 0 .*lr=nan"),
        ("weight_decay", -1.0, r"param group 0 .*weight_decay=-1.0"),
    ]
    spec = get_spec(name)
    # each of its family's options its groups carry refused as text, which a group never holds (Adafactor: beta1,
    # decay_rate, ...; not Muon's muon_include / muon_exclude, which make the groups)
    group_cases += [(o.name, "x", f"{o.name}='x'") for o in spec.facts.options if o.name in group]
    if spec.facts.option("beta1"):  # Adafactor's, checked by its option's rule
        group_cases.append(("beta1", 1.5, r"beta1.*must be in \[0, 1\)"))
    if not spec.uses_betas:
        return group_cases
    return group_cases + [("betas", (0.9, 1.5), r"beta2=1.5")] + ([("eps", -1.0, r"eps=-1.0")] if spec.facts.uses_eps
                                                                  else [])


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_incomplete_or_corrupt_state_is_refused_before_anything_loads(name, backend, dtype, compensation):
    model, opt = make(name, backend, dtype, compensation=compensation)
    train(model, opt, 2)
    good = opt.state_dict()
    train(model, opt, 1, start=2)  # what the refused loads must leave alone differs from the checkpoint
    snap = snapshot(model, opt)
    cases = _corrupt_state(name, backend, opt) + [(lambda sd, k=k, v=v: sd["param_groups"][0].__setitem__(k, v), match)
                                                  for k, v, match in _corrupt_groups(name, opt.param_groups[0])]
    for corrupt, match in cases:
        sd = copy.deepcopy(good)
        corrupt(sd)
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(sd)
        assert_unchanged(model, opt, snap)
    kept = copy.deepcopy(good)
    opt.load_state_dict(good)  # the intact checkpoint loads, and is not changed by loading
    assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(kept["state"][pid][k]))
               and type(v) is type(kept["state"][pid][k]) for pid, st in good["state"].items() for k, v in st.items())


# --- item 9: parameters are matched by name ---------------------------------------------------------------


class Pair(nn.Module):
    """Two same-shape layers; ``swapped`` registers them in the other order (same names, same function)."""

    def __init__(self, swapped=False, dtype=torch.float32, first="a"):
        super().__init__()
        torch.manual_seed(0)
        a, b = nn.Linear(64, 64), nn.Linear(64, 64)  # 4096 weights: 8-bit state under adam8bit
        for n, layer in ((("b", b), (first, a)) if swapped else ((first, a), ("b", b))):
            self.add_module(n, layer)
        self.first = first
        self.to(dtype)

    def forward(self, x):
        return getattr(self, self.first)(torch.relu(self.b(x)))


def _pair_train(model, opt, steps, start=0):
    for i in range(start, start + steps):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(i)).to(next(model.parameters()).dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("name, backend, dtype, compensation", CASES)
def test_same_shape_parameters_in_another_order_are_matched_by_name(name, backend, dtype, compensation):
    if backend == "torchao":
        pytest.importorskip("torchao")
    model = Pair(dtype=dtype)
    opt = hfe.create_optimizer(model, name, lr=1e-2, weight_decay=0.01, backend=backend)
    _pair_train(model, opt, 2)
    sd = opt.state_dict()
    swapped = Pair(swapped=True, dtype=dtype)
    swapped.load_state_dict(model.state_dict())
    opt2 = hfe.create_optimizer(swapped, name, lr=1e-2, weight_decay=0.01, backend=backend)
    assert opt2.param_groups[0]["param_names"][0] == "b.weight"  # the other order
    opt2.load_state_dict(copy.deepcopy(sd))
    saved, loaded = _by_name(sd), _by_name(opt2.state_dict())
    for pname, st in saved.items():
        for key, value in st.items():
            assert torch.equal(torch.as_tensor(loaded[pname][key]), torch.as_tensor(value)), (pname, key)
    _pair_train(model, opt, 2, start=2)
    _pair_train(swapped, opt2, 2, start=2)
    params = dict(model.named_parameters())
    for pname, p in swapped.named_parameters():
        if name == "adamw_bf16":  # its rounding noise is drawn per position: other order, other noise
            torch.testing.assert_close(p, params[pname], atol=1e-3, rtol=1e-2)
        else:
            assert torch.equal(p, params[pname]), pname
    # other names: refused, naming them, nothing loaded
    renamed = Pair(dtype=dtype, first="c")
    opt3 = hfe.create_optimizer(renamed, name, lr=1e-2, weight_decay=0.01, backend=backend)
    _pair_train(renamed, opt3, 1)
    snap = snapshot(renamed, opt3)
    with pytest.raises(ValueError, match=r"missing \['c.weight'\], not in this optimizer \['a.weight'\].*another "
                                         r"model"):
        opt3.load_state_dict(copy.deepcopy(sd))
    assert_unchanged(renamed, opt3, snap)


def test_stale_live_param_names_fall_back_to_position():
    """A wrapper that swaps a group's parameters (DeepSpeed's ZeRO: one flat partition) leaves param_names that
    no longer describe them: such names say nothing, and the state loads by position, as torch's does."""
    import hf_efficient as hfe

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = hfe.create_optimizer(model, "adamw", lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    for g in opt.param_groups:
        g["param_names"] = g["param_names"][:1] + ["stale"] * 3  # names of tensors the group no longer holds
    sd = {**sd, "param_groups": [dict(g, param_names=g["param_names"][:1]) for g in sd["param_groups"]]}
    opt.load_state_dict(sd)
    assert all(torch.is_tensor(st["exp_avg"]) for st in opt.state.values())
