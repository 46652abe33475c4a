"""Names, backend resolution, the options parser and create_optimizer's checks (no Trainer here)."""

import importlib.util
import logging

import pytest
import torch
from torch import nn

import hf_efficient as hfe
from hf_efficient import registry
from hf_efficient.options import parse_optim_args, parse_options
from cases import names, quantized


def test_names_are_listed():
    names = hfe.available_optimizers()
    for n in ["hf_eff_adamw", "hf_eff_adam8bit", "hf_eff_paged_adam8bit", "hf_eff_adafactor", "hf_eff_adamw_bf16"]:
        assert n in names


@pytest.mark.parametrize("name", ["adam8bit", "hf_eff_adam8bit"])
def test_short_and_long_names_resolve_alike(name):
    res = hfe.resolve(name, device="cpu")
    assert (res.name, res.backend) == ("adam8bit", "torch")  # our compiled kernel: fastest 8-bit on CPU
    assert "torch > bnb usable" in res.reason and "cpu" in res.reason
    assert hfe.resolve(name, device="cuda").backend == "torch"  # our Triton kernel, Triton being installed


@pytest.mark.parametrize("name", names(quantized, lambda spec: "bnb" in spec.backends))
def test_8bit_on_cuda_takes_bnb_where_triton_is_missing(monkeypatch, name):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod == "triton" else real(mod, *a))
    res = hfe.resolve(name, device="cuda", log=False)
    assert res.backend == "bnb" and "torch > bnb" in res.reason and "needs Triton" in res.reason
    assert hfe.resolve(name, device="cuda", backend="bnb", log=False).backend == "bnb"  # forced, as before


def test_unknown_name_lists_names_and_suggests():
    with pytest.raises(ValueError, match=r"Did you mean 'hf_eff_adafactor'.*hf_eff_adam8bit"):
        hfe.resolve("hf_eff_adafactr")


def test_forced_backend():
    if importlib.util.find_spec("torchao") is not None:  # its own extra (without it: test_missing_backend_names_the_pip_extra)
        assert hfe.resolve("adam8bit", "cpu", backend="torchao").backend == "torchao"
    with pytest.raises(ValueError, match="not a backend of hf_eff_adamw; it has: torch"):
        hfe.resolve("adamw", "cpu", backend="bnb")


def test_missing_backend_names_the_pip_extra(monkeypatch):
    real = registry.version_of
    monkeypatch.setattr(registry, "version_of", lambda pkg: None if pkg == "torchao" else real(pkg))
    with pytest.raises(ImportError, match=r'pip install "torchao>=[0-9.]+" \(the \[torchao\] extra'):
        hfe.resolve("adam8bit", "cpu", backend="torchao")


def test_no_backend_for_device_says_what_would_work(monkeypatch):
    spec = registry.get_spec("adam8bit")
    saved = dict(spec.backends)  # restored in its order: the docs' tables list backends in it
    try:
        del spec.backends["torch"]  # leave only the packaged backends
        monkeypatch.setitem(spec.prefer, "default", ("bnb", "torchao"))
        monkeypatch.setattr(registry, "version_of", lambda pkg: None)  # neither bnb nor torchao installed
        with pytest.raises(RuntimeError, match=r"No backend of hf_eff_adam8bit.*pip install \"bitsandbytes>=.*"
                           "What would work"):
            hfe.resolve("adam8bit", "cpu")
        with pytest.raises(RuntimeError, match="runs on: cpu, cuda"):
            hfe.resolve("adam8bit", "mps")
    finally:
        spec.backends.clear()
        spec.backends.update(saved)


def test_8bit_kernel_needs_a_compiler_else_bnb_is_chosen(monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    res = hfe.resolve("adam8bit", "cpu")
    assert res.backend == "bnb" and "needs a C or C++ compiler" in res.reason


def test_old_bitsandbytes_serves_nothing(monkeypatch):
    """bitsandbytes >= 0.50 everywhere (setup.cfg, the bnb extra, the registry): older is refused, naming both."""
    from packaging.version import Version

    real = registry.version_of
    monkeypatch.setattr(registry, "version_of", lambda pkg: Version("0.45.0") if pkg == "bitsandbytes" else real(pkg))
    for device in ("cpu", "cuda"):
        with pytest.raises(ValueError, match=rf"bnb serves {device} from bitsandbytes 0.50, installed is 0.45.0"):
            hfe.resolve("adam8bit", device, backend="bnb")
    monkeypatch.setattr(registry, "version_of", lambda pkg: Version("0.50.0") if pkg == "bitsandbytes" else real(pkg))
    assert hfe.resolve("adam8bit", "cuda", backend="bnb").backend == "bnb"


def test_paged_falls_back_off_cuda_with_one_warning(caplog):
    """Logged once at WARNING (not a raw warnings.warn with its source line); an estimate (log=False) is a question
    whose result already says "runs as", so it logs nothing."""
    import warnings

    registry._logged.discard(("paged_adam8bit", "cpu"))
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="hf_efficient.registry"):
        warnings.simplefilter("error")
        assert "runs as hf_eff_adam8bit" in hfe.resolve("paged_adam8bit", "cpu", log=False).reason
        assert hfe.estimate_memory(1000, "paged_adam8bit", device="cpu").name == "hf_eff_adam8bit"
        assert not caplog.records
        res = hfe.resolve("paged_adam8bit", "cpu")
        hfe.resolve("paged_adam8bit", "cpu")  # second time: silent
    assert res.name == "adam8bit"
    assert [r.levelno for r in caplog.records if "runs as hf_eff_adam8bit" in r.getMessage()] == [logging.WARNING]


def test_choice_is_logged_once(caplog):
    registry._logged.clear()
    with caplog.at_level(logging.INFO, logger="hf_efficient.registry"):
        hfe.resolve("adamw", "cpu")
        hfe.resolve("adamw", "cpu")
    assert caplog.text.count("hf_eff_adamw on cpu -> backend torch") == 1


def test_estimates_do_not_log_a_choice(caplog):
    """An estimate asks about a name; only building an optimizer is a choice worth a log line."""
    registry._logged.clear()
    with caplog.at_level(logging.INFO, logger="hf_efficient.registry"):
        hfe.estimate_memory(10_000, "adafactor")
    assert "-> backend" not in caplog.text
    with caplog.at_level(logging.INFO, logger="hf_efficient.registry"):
        hfe.create_optimizer([torch.nn.Parameter(torch.zeros(4))], "adafactor")
    assert caplog.text.count("hf_eff_adafactor on cpu -> backend torch") == 1


# --- options: one parser for optim_args text and keyword values ---------------------------------------


def test_text_values_are_typed():
    spec = registry.get_spec("adam8bit")
    opts = parse_options(spec.name, spec.accepted, parse_optim_args("decay_embeddings=false, min_8bit_size=1024"))
    assert opts["decay_embeddings"] is False and opts["min_8bit_size"] == 1024 and opts["embedding_state"] == "32bit"


@pytest.mark.parametrize("text, match", [
    ("embeding_state=8bit", r"unknown option 'embeding_state'.*Did you mean 'embedding_state'"),
    ("embedding_state=4bit", r"must be one of \['32bit', '8bit'\], got '4bit'"),
    ("decay_embeddings=maybe", "must be true or false"),
    ("min_8bit_size=big", "must be an integer"),
    ("min_8bit_size=0", "must be > 0"),
    ("compensation=kahn", r"must be one of \['auto', 'kahan', 'stochastic', 'none'\], got 'kahn'"),
    ("backend", "not of the form key=value"),
])
def test_bad_optim_args(text, match):
    spec = registry.get_spec("adam8bit")
    with pytest.raises(ValueError, match=match):
        parse_options(spec.name, spec.accepted, parse_optim_args(text), source="optim_args")


def test_none_is_a_choice_where_it_is_one():
    for name in ("adamw_bf16", "adam8bit", "lion8bit", "adafactor", "adamw"):  # every name takes it
        spec = registry.get_spec(name)
        assert parse_options(spec.name, spec.accepted, parse_optim_args("compensation=none"))["compensation"] == "none"
    spec = registry.get_spec("adafactor")
    assert parse_options(spec.name, spec.accepted, parse_optim_args("beta1=none"))["beta1"] is None
    with pytest.raises(ValueError, match="'compensation' cannot be None"):
        parse_options("adamw_bf16", ("compensation",), {"compensation": None})


def test_keywords_and_text_share_validation():
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="create_optimizer: option 'embedding_state' must be one of"):
        hfe.create_optimizer(model, "adam8bit", embedding_state="4bit")
    with pytest.raises(ValueError, match="unknown option 'embeding_state'"):
        hfe.create_optimizer(model, "adam8bit", embeding_state="8bit")
    opt = hfe.create_optimizer(model, "adamw", decay_embeddings="false")  # text works as a keyword too
    assert opt.hf_efficient.options["decay_embeddings"] is False


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=-1e-3), r"lr=-0.001"),
    (dict(betas=(0.9, 1.0)), r"beta2=1.0"),
    (dict(betas=(-0.1, 0.99)), r"beta1=-0.1"),
    (dict(eps=-1.0), r"eps=-1.0"),
    (dict(weight_decay=-0.1), r"weight_decay=-0.1"),
])
@pytest.mark.parametrize("name", ["adamw", "adam8bit", "adafactor"])
def test_bad_hyperparameters_are_refused_with_the_value(name, kwargs, match):
    if name == "adafactor" and ("betas" in kwargs or "eps" in kwargs):
        pytest.skip("Adafactor takes neither betas nor eps")
    with pytest.raises(ValueError, match=match):
        hfe.create_optimizer(nn.Linear(4, 4), name, **kwargs)


# --- create_optimizer in plain PyTorch -------------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(128, 64)  # 8192 elements: large enough to be 8-bit by size
        self.big = nn.Linear(64, 128)  # 8192
        self.small = nn.Linear(128, 8)  # 1024 < 4096
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.small(torch.relu(self.big(self.emb(x))))).sum()


@pytest.mark.parametrize("backend", ["torch", "bnb", "torchao"])
def test_8bit_state_policy(backend):
    if backend == "torchao":
        pytest.importorskip("torchao")
    model = Tiny()
    for embedding_state, emb_dtype in (("32bit", torch.float32), ("8bit", torch.uint8)):
        opt = hfe.create_optimizer(model, "adam8bit", lr=1e-3, backend=backend, embedding_state=embedding_state)
        model(torch.randint(0, 128, (4, 5))).backward()
        opt.step()
        opt.zero_grad()

        def dtype_of(p):
            st = opt.state[p]
            t = st["state1"] if "state1" in st else st["exp_avg"]
            return getattr(t, "codes", t).dtype

        assert dtype_of(model.big.weight) == torch.uint8
        assert dtype_of(model.small.weight) == torch.float32
        assert dtype_of(model.emb.weight) == emb_dtype


@pytest.mark.parametrize("name", names(quantized))
def test_torch_backend_s_8bit_rule_is_the_optimizer_s(monkeypatch, name):
    """What checkpoint conversion and memory read (the backend's keeps_8bit) is the rule the step allocates by: one
    rule, so a family that changes it (here: everything fp32) is followed everywhere."""
    model = Tiny()
    opt = hfe.create_optimizer(model, name, lr=1e-3, backend="torch")
    keeps = registry.get_spec(name).backends["torch"].keeps_8bit
    assert keeps(opt)(0, 0, model.big.weight) is opt._has_8bit_state(model.big.weight, opt.param_groups[0])
    monkeypatch.setattr(type(opt), "_has_8bit_state", lambda self, p, group: False)
    assert not any(keeps(opt)(gi, pi, p) for gi, g in enumerate(opt.param_groups) for pi, p in enumerate(g["params"]))


def test_plain_pytorch_loop_with_param_list():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    opt = hfe.create_optimizer(model.parameters(), "adafactor", lr=1e-2)
    first = None
    for _ in range(30):
        loss = nn.functional.mse_loss(model(x), y)
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 0.7 * first


def test_empty_param_list_is_refused():
    with pytest.raises(ValueError, match="empty parameter list"):
        hfe.create_optimizer([], "adamw")


def test_torchao_is_never_chosen_automatically_and_warned_when_forced(caplog):
    """torchao's AdamW8bit stores small second moments as 0 (see registry.TORCHAO_FLAW): no device's automatic
    order holds it, and forcing it logs why it is a bad idea."""
    from hf_efficient import registry

    for spec in registry.SPECS.values():
        for order in spec.prefer.values():
            assert "torchao" not in order, spec.name
    pytest.importorskip("torchao")
    registry._logged.clear()
    with caplog.at_level(logging.WARNING, logger="hf_efficient.registry"):
        hfe.resolve("adam8bit", "cpu", backend="torchao")
    assert "stores small second moments as exactly 0" in caplog.text


def _count_resolves(monkeypatch) -> list:
    """Record every registry.resolve call, wherever the module that makes it imported it from: (name, log), log
    False for a question (an estimate) rather than a decision."""
    import hf_efficient.factory
    import hf_efficient.integrations.distributed
    import hf_efficient.memory

    calls, real = [], registry.resolve

    def counting(*args, **kwargs):
        calls.append((args[0], kwargs.get("log", True)))
        return real(*args, **kwargs)

    for module in (registry, hf_efficient.factory, hf_efficient.memory, hf_efficient.integrations.distributed):
        monkeypatch.setattr(module, "resolve", counting)
    return calls


@pytest.mark.filterwarnings("ignore:hf_eff_paged_adam8bit")
@pytest.mark.parametrize("optim", ["hf_eff_adam8bit", "hf_eff_paged_adam8bit"])
def test_a_trainer_optimizer_build_resolves_its_name_once(tmp_path, monkeypatch, optim):
    """TrainingArguments(optim=...) -> Trainer.create_optimizer -> factory.build_optimizer -> the backend's class:
    the registry decides once (a fallback name's inner resolve is part of that one decision; the embedding_state
    hint's estimates ask questions, log=False)."""
    from conftest import tiny_bert
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(str(tmp_path), optim=optim, report_to=[], use_cpu=True, save_strategy="no")
    trainer = Trainer(model=tiny_bert(), args=args)
    calls = _count_resolves(monkeypatch)
    opt = trainer.create_optimizer()
    outer = [c for c in calls if c == (optim.removeprefix(registry.PREFIX), True)]
    assert len(outer) == 1, calls
    assert type(opt).__name__ == "AdamW8bit" and opt.hf_efficient.resolution.backend == "torch"


def test_distributed_checks_resolve_at_most_once_and_take_a_resolution(monkeypatch):
    from hf_efficient.integrations.distributed import check_deepspeed, check_fsdp

    calls = _count_resolves(monkeypatch)
    check_deepspeed("adamw", None, {}, {"zero_optimization": {"stage": 2}})
    check_fsdp("adamw", None, version=2)
    assert len(calls) == 2, calls
    res = registry.resolve("adam8bit", "cpu", log=False)
    calls.clear()
    check_deepspeed(res, None, {"embedding_state": "8bit"}, {})
    check_fsdp(res, None, version=2)  # our 8-bit kernels step FSDP2 shards
    bnb = registry.resolve("adam8bit", "cpu", backend="bnb", log=False)
    calls.clear()
    with pytest.raises(ValueError, match=r"hf_eff_adam8bit \(backend=bnb\) is not supported with FSDP2: bitsandbytes"):
        check_fsdp(bnb, None, version=2)
    assert calls == []


def test_distributed_support_is_the_registry_s():
    """The tables the distributed checks print are derived from the specs, entry for entry."""
    from hf_efficient.integrations import distributed

    assert distributed.FSDP2_UNSUPPORTED == {(s.name, b): impl.fsdp2 for s in registry.SPECS.values()
                                             for b, impl in s.backends.items() if impl.fsdp2}
    assert ("adam8bit", "torchao") not in distributed.FSDP2_UNSUPPORTED
    assert set(distributed.DEEPSPEED_UNSUPPORTED) == {"adafactor", "adamw_bf16", "muon", "muon8bit"}


def test_every_family_describes_its_state_completely():
    """What checkpoint.py and memory.py read from a spec is there for every name: formats known, required keys among
    the state keys, each 8-bit code key with its absmax, a layout wherever a backend stores state its own way."""
    from hf_efficient.optim.facts import Codec

    formats = {"step", "param", "codes", "absmax", "row", "col"}
    p, group = torch.zeros(4, 300, dtype=torch.bfloat16), {"amsgrad": True, "beta1": 0.9}
    for spec in registry.SPECS.values():
        if not spec.backends:
            continue
        fam = spec.facts
        assert {k.format for k in fam.state.values()} <= formats, fam.name
        assert fam.required(p, group) <= set(fam.state), fam.name
        assert all(f"{k}_absmax" in fam.state for k, f in fam.state.items() if f.format == "codes"), fam.name
        assert all(isinstance(f.codec, Codec) for f in fam.state.values() if f.format in ("codes", "absmax")), fam.name
        assert fam.marks <= set(fam.state), fam.name
        for b, impl in spec.backends.items():
            assert callable(impl.memory) and (impl.keeps_8bit is not None) == fam.quantized, (spec.name, b)
            assert (impl.layout is not None) == (b != "torch"), (spec.name, b)


def _our_classes():
    """family -> the optimizer classes of this package that step it (each torch backend's, and the compensated AdamW
    that torch's AdamW builder returns for bf16/fp16 weights). Only the torch backends: the others' classes come from
    optional packages."""
    from hf_efficient.optim.adamw import AdamW

    found = {"adamw": {AdamW}}
    for spec in registry.SPECS.values():
        impl = spec.backends.get("torch")
        cls = impl.build.optimizer_cls() if impl else None
        if cls is not None and cls.__module__.startswith("hf_efficient.optim."):
            found.setdefault(spec.family, set()).add(cls)
    return found


def test_classes_read_their_family_s_facts():
    """Each class declares its Family (``FACTS``, in its module) and reads its moments and default compensation from it:
    a class built directly trains as create_optimizer's compensation=auto does."""
    import inspect

    classes = _our_classes()
    assert set(classes) == set(registry.families()), "a family without a class of ours, or a class without a family"
    for family, found in classes.items():
        fam = registry.families()[family]
        for cls in found:
            assert cls.FACTS is fam, (family, cls)
            assert inspect.signature(cls).parameters["compensation"].default == fam.compensation, (family, cls)
            # its kernels' moments: its family's, or some of them where another family's kernels step some of its
            # groups (Muon8bit's AdamW groups: AdamW8bit's; its Muon matrices keep the other)
            kernels = getattr(cls, "MOMENTS", fam.moments)
            assert kernels == fam.moments or (cls.NAME != fam.name and set(kernels) < set(fam.moments)), (family, cls)
            assert bool(fam.moments) == hasattr(cls, "MOMENTS"), (family, cls)  # 8-bit families, and only those
            for option in fam.options:  # the family's options are its class's keywords, with their defaults, but
                if fam.param_groups and option.name not in inspect.signature(cls).parameters:
                    continue  # those of a family's own grouping (Muon's muon_include / muon_exclude make its groups)
                assert inspect.signature(cls).parameters[option.name].default == option.default, (cls, option.name)


def test_readme_names_table_is_the_registry():
    """README's "Optimizer names" table lists exactly the registered names, each with its spec's bytes_label at the
    start of the state-bytes column (README is the lead's: this test says what it must show)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = text.split("## Optimizer names", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if re.match(r"\| `hf_eff_", line)]
    table = {}
    for cells in rows:
        names = re.findall(r"`([a-z0-9_]+)`", cells[0])
        assert names[0] == registry.PREFIX + names[1], cells[0]  # `hf_eff_x` (`x`)
        table[names[1]] = cells[2].strip()
    assert sorted(table) == sorted(registry.SPECS), "README's names table and the registry differ"
    for name, shown in table.items():
        assert shown.startswith(registry.SPECS[name].bytes_label), (name, shown, registry.SPECS[name].bytes_label)
