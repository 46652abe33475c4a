"""Accelerate plugin: config precedence and errors, exact gradient accumulation, schedules, exact resume,
and the distributed refusal rules (one process; tests/test_accelerate_distributed.py runs two)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hf_efficient import optimizer_info
from hf_efficient.integrations.accelerate import (
    EfficientOptimPlugin, accumulation_windows, check_distributed_support, choose_backend, summed_token_loss)
from hf_efficient.registry import SPECS

from helpers import (IGNORE, accumulated_grads, logits_of, max_rel_diff, merge, reference_grads, tiny_mlm,
                     variable_batches)


def reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No HF_EFF_* / accelerate variables from the outside; accelerate's singletons reset after each test."""
    import os

    for var in list(os.environ):
        if var.startswith("HF_EFF_") or var == "ACCELERATE_GRADIENT_ACCUMULATION_STEPS":
            monkeypatch.delenv(var)
    yield
    reset_accelerate()


# ------------------------------------------------------------------------------------ config sources

def write_yaml(tmp_path, text: str) -> str:
    path = tmp_path / "optim.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_match_training_arguments():
    p = EfficientOptimPlugin()
    assert (p.optim, p.lr, p.weight_decay, p.betas, p.eps) == ("adamw", 5e-5, 0.0, (0.9, 0.999), 1e-8)
    assert (p.gradient_accumulation_steps, p.lr_scheduler_type, p.warmup_steps, p.backend) == (1, "linear", 0, None)
    assert set(p.sources.values()) == {"default"}


def test_precedence_defaults_yaml_env_kwargs(tmp_path, monkeypatch):
    path = write_yaml(tmp_path, "optim: adafactor\nlr: 1e-3\nweight_decay: 0.1\nwarmup_steps: 5\n"
                                "optim_args: {clip_threshold: 2.0, decay_rate: -0.5}\n")
    monkeypatch.setenv("HF_EFF_CONFIG", path)
    monkeypatch.setenv("HF_EFF_LR", "2e-3")
    monkeypatch.setenv("HF_EFF_WARMUP_STEPS", "7")
    monkeypatch.setenv("HF_EFF_OPTIM_ARGS", "clip_threshold=3.0")
    p = EfficientOptimPlugin(warmup_steps=9)
    assert p.optim == "adafactor" and p.sources["optim"] == f"{path}: optim"            # YAML over default
    assert p.weight_decay == 0.1 and p.sources["weight_decay"] == f"{path}: weight_decay"
    assert p.lr == 2e-3 and p.sources["lr"] == "HF_EFF_LR"                              # env over YAML
    assert p.warmup_steps == 9 and p.sources["warmup_steps"] == "EfficientOptimPlugin(warmup_steps=...)"
    assert p.eps == 1e-8 and p.sources["eps"] == "default"
    assert p.optim_args == {"clip_threshold": "3.0", "decay_rate": -0.5}                  # merged key by key
    assert p.config_file == path


def test_config_file_argument_beats_env_path(tmp_path, monkeypatch):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("optim: adafactor\n")
    b.write_text("optim: hf_eff_adam8bit\n")
    monkeypatch.setenv("HF_EFF_CONFIG", str(a))
    assert EfficientOptimPlugin().optim == "adafactor"
    assert EfficientOptimPlugin(config_file=str(b)).optim == "adam8bit"


def test_accelerate_launch_gradient_accumulation_is_honoured(monkeypatch):
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "6")
    p = EfficientOptimPlugin()
    assert p.gradient_accumulation_steps == 6 and p.sources["gradient_accumulation_steps"] == \
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"
    assert EfficientOptimPlugin(gradient_accumulation_steps=2).gradient_accumulation_steps == 2
    monkeypatch.setenv("HF_EFF_GRADIENT_ACCUMULATION_STEPS", "6")
    assert EfficientOptimPlugin().gradient_accumulation_steps == 6  # agreeing twice is fine
    monkeypatch.setenv("HF_EFF_GRADIENT_ACCUMULATION_STEPS", "4")
    with pytest.raises(ValueError, match="HF_EFF_GRADIENT_ACCUMULATION_STEPS=4 and "
                                         "ACCELERATE_GRADIENT_ACCUMULATION_STEPS=6 disagree"):
        EfficientOptimPlugin()


def test_backend_and_decay_embeddings_inside_optim_args(monkeypatch):
    monkeypatch.setenv("HF_EFF_OPTIM_ARGS", "backend=torchao,decay_embeddings=false,embedding_state=8bit")
    p = EfficientOptimPlugin(optim="adam8bit")
    assert (p.backend, p.decay_embeddings, p.optim_args) == ("torchao", False, {"embedding_state": "8bit"})
    assert p.sources["backend"] == "HF_EFF_OPTIM_ARGS (backend)"
    assert EfficientOptimPlugin(optim="adam8bit", backend="auto").backend is None  # keyword wins, 'auto' = None
    monkeypatch.setenv("HF_EFF_BACKEND", "bnb")
    with pytest.raises(ValueError, match="HF_EFF_OPTIM_ARGS sets backend='torchao' but HF_EFF_BACKEND sets"):
        EfficientOptimPlugin(optim="adam8bit")


def _with_backend(entry: str, name: str, value: str, monkeypatch, tmp_path):
    """Optimizer ``name`` built for a small model with ``backend=value`` given through ``entry``."""
    import hf_efficient as hfe
    from hf_efficient.integrations.transformers import TrainerOptimizer

    model = torch.nn.Linear(8, 8)
    if entry == "create_optimizer":
        return hfe.create_optimizer(model, name, backend=value)
    if entry == "TrainingArguments":
        from transformers import TrainingArguments

        args = TrainingArguments(str(tmp_path), optim="hf_eff_" + name, optim_args=f"backend={value}", report_to=[],
                                 use_cpu=True)
        return TrainerOptimizer(model, hf_eff_name=args.optim, optim_args=args.optim_args, lr=1e-3,
                                betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    if entry == "HF_EFF_OPTIM_ARGS":
        monkeypatch.setenv("HF_EFF_OPTIM_ARGS", f"backend={value}")
        return EfficientOptimPlugin(optim=name).create_optimizer(model)
    return EfficientOptimPlugin(optim=name, backend=value).create_optimizer(model)


BACKEND_ENTRIES = ("create_optimizer", "TrainingArguments", "EfficientOptimPlugin", "HF_EFF_OPTIM_ARGS")


@pytest.mark.parametrize("name", [s.name for s in SPECS.values() if "backend" in s.options])
def test_every_entry_point_gives_backend_auto_one_verdict(name, monkeypatch, tmp_path):
    """backend=auto is the registry's choice wherever it is given (issue 30: the plugin and HF_EFF_OPTIM_ARGS took it,
    TrainingArguments and create_optimizer refused it); a backend that is none is refused by all four alike."""
    import hf_efficient as hfe

    for entry in BACKEND_ENTRIES:
        with monkeypatch.context() as m:
            assert optimizer_info(_with_backend(entry, name, "auto", m, tmp_path)).resolution.backend == \
                hfe.resolve(name, device="cpu").backend, entry
            with pytest.raises(ValueError, match=r"option 'backend' must be one of \['bnb', 'torchao', 'torch'\] "
                                                 r"\(or 'none' / 'auto': the registry's choice\), got 'fast'"):
                _with_backend(entry, name, "fast", m, tmp_path)


@pytest.mark.parametrize("var, value, message", [
    ("HF_EFF_LR", "fast", "HF_EFF_LR: expected a number, got 'fast'"),
    ("HF_EFF_LR", "-1", "HF_EFF_LR: Invalid learning rate lr=-1.0"),
    ("HF_EFF_BETAS", "0.9", "HF_EFF_BETAS: betas must be two numbers"),
    ("HF_EFF_BETAS", "0.9,1.5", r"HF_EFF_BETAS: Invalid beta2=1.5"),
    ("HF_EFF_WEIGHT_DECAY", "-0.1", "HF_EFF_WEIGHT_DECAY: Invalid weight_decay"),
    ("HF_EFF_GRADIENT_ACCUMULATION_STEPS", "0", "HF_EFF_GRADIENT_ACCUMULATION_STEPS: must be an integer >= 1"),
    ("HF_EFF_GRADIENT_ACCUMULATION_STEPS", "2.5", "HF_EFF_GRADIENT_ACCUMULATION_STEPS: expected an integer"),
    ("HF_EFF_OPTIM", "adam9bit", "HF_EFF_OPTIM: Unknown hf_efficient optimizer 'adam9bit'. Did you mean"),
    ("HF_EFF_OPTIM", " ", "^HF_EFF_OPTIM: expected a non-empty string, got ' '$"),  # the source named once
    ("HF_EFF_LR_SCHEDULER_TYPE", "cosin", "HF_EFF_LR_SCHEDULER_TYPE: unknown lr_scheduler_type 'cosin'. Did you mean"),
    ("HF_EFF_BACKEND", "cuda", "HF_EFF_BACKEND: option 'backend' must be one of"),
    ("HF_EFF_DECAY_EMBEDDINGS", "maybe", "HF_EFF_DECAY_EMBEDDINGS: option 'decay_embeddings' must be true or false"),
    ("HF_EFF_WARMUP_RATIO", "1.5", r"HF_EFF_WARMUP_RATIO: warmup_ratio must be in \[0, 1\)"),
    ("HF_EFF_OPTIM_ARGS", "embedding_state", "HF_EFF_OPTIM_ARGS: optim_args: 'embedding_state' is not of the form"),
    ("HF_EFF_OPTIM_ARGS", "embeding_state=8bit", "HF_EFF_OPTIM_ARGS \\(optim_args\\): unknown option 'embeding_state' "
                                                 "for 'adamw'.* Accepted: backend, compensation, decay_embeddings"),
    ("HF_EFF_CONFIG", "/nonexistent.yaml", "HF_EFF_CONFIG: config file '/nonexistent.yaml' does not exist"),
    ("HF_EFF_CONFIG", "/", "HF_EFF_CONFIG: config file '/' is a directory: give the path of a YAML file"),
    ("HF_EFF_LR", "inf", "HF_EFF_LR: Invalid learning rate lr=inf: it must be a finite number"),
    ("HF_EFF_WEIGHT_DECAY", "inf", "HF_EFF_WEIGHT_DECAY: Invalid weight_decay=inf"),
    ("HF_EFF_EPS", "0", "HF_EFF_EPS: Invalid eps=0.0"),
])
def test_bad_environment_value_names_the_variable(monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=message):
        EfficientOptimPlugin()


def test_option_value_checked_by_core_parser_for_the_chosen_name(monkeypatch):
    monkeypatch.setenv("HF_EFF_OPTIM", "adam8bit")
    monkeypatch.setenv("HF_EFF_OPTIM_ARGS", "min_8bit_size=0")
    with pytest.raises(ValueError, match=r"HF_EFF_OPTIM_ARGS \(optim_args\): option 'min_8bit_size' must be > 0"):
        EfficientOptimPlugin()


@pytest.mark.parametrize("text, message", [
    ("lr: fast\n", "{path}: lr: expected a number, got 'fast'"),
    ("optim: adam8bit\noptim_args: {embedding_state: 4bit}\n",
     r"{path}: optim_args \(optim_args\): option 'embedding_state' must be one of"),
    ("learning_rate: 1e-3\n", "{path}: unknown key 'learning_rate'. Did you mean 'lr'"),
    ("weight_decy: 0.1\n", "{path}: unknown key 'weight_decy'. Did you mean 'weight_decay'"),
    ("gradient_accumulation_steps: [2]\n", "{path}: gradient_accumulation_steps: expected an integer"),
    ("- optim\n", "{path}: expected a mapping"),
    ("optim: [\n", "{path}: not valid YAML"),
    ("lr: .inf\n", "{path}: lr: Invalid learning rate lr=inf: it must be a finite number"),
    ("weight_decay: .nan\n", "{path}: weight_decay: Invalid weight_decay=nan"),
])
def test_bad_yaml_value_names_file_and_key(tmp_path, text, message):
    path = write_yaml(tmp_path, text)
    with pytest.raises(ValueError, match=message.format(path=path)):
        EfficientOptimPlugin(config_file=path)


def test_config_file_that_is_not_utf8_says_so(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("lr: 1e-3  # café\n".encode("latin-1"))
    with pytest.raises(ValueError, match=f"{path}: not UTF-8 text \\(byte b'\\\\xe9' at offset 15\\): save the "
                                         "config file as UTF-8"):
        EfficientOptimPlugin(config_file=str(path))
    with pytest.raises(ValueError, match="is a directory"):
        EfficientOptimPlugin(config_file=str(tmp_path))


def test_bad_keyword_and_combinations():
    with pytest.raises(ValueError, match=r"EfficientOptimPlugin\(eps=...\): Invalid eps"):
        EfficientOptimPlugin(eps=-1.0)
    with pytest.raises(ValueError, match="are both set: keep one"):
        EfficientOptimPlugin(warmup_steps=3, warmup_ratio=0.1)
    with pytest.raises(ValueError, match="use 'constant_with_warmup'"):
        EfficientOptimPlugin(lr_scheduler_type="constant", warmup_steps=3)


def test_unknown_hf_eff_variable_is_reported(monkeypatch, caplog):
    monkeypatch.setenv("HF_EFF_OPTIN", "adam8bit")
    monkeypatch.setenv("HF_EFF_LEARNING_RATE", "1e-3")
    monkeypatch.setenv("HF_EFF_NB_STEPS", "3")  # another tool's variable: not ours, not a typo of ours
    EfficientOptimPlugin()
    assert "HF_EFF_OPTIN (did you mean HF_EFF_OPTIM?)" in caplog.text
    assert "HF_EFF_LEARNING_RATE (did you mean HF_EFF_LR?)" in caplog.text
    assert "HF_EFF_NB_STEPS" not in caplog.text


# ------------------------------------------------------------------------- exact gradient accumulation

def test_accumulation_equals_big_batch_and_naive_mean_does_not():
    batches = variable_batches(n_batches=4, per_batch=2)
    counts = [int((b["labels"] != IGNORE).sum()) for b in batches]
    assert len(set(counts)) > 1, counts  # the case where a mean of means is wrong
    ref = reference_grads(merge(batches))

    plugin = EfficientOptimPlugin(gradient_accumulation_steps=4)
    accelerator = plugin.create_accelerator(cpu=True)
    model = accelerator.prepare(tiny_mlm())
    exact = accumulated_grads(accelerator, model, batches)
    assert max_rel_diff(exact, ref) < 1e-5

    model.zero_grad(set_to_none=True)
    naive = accumulated_grads(accelerator, model, batches, naive=True)
    assert max_rel_diff(naive, ref) > 1e-2  # the mean of per-micro-batch means is visibly off


def test_short_last_window_steps_at_its_own_end():
    """5 micro-batches with 4 per step: two optimizer steps, the second over the last batch alone."""
    batches = variable_batches(n_batches=5, per_batch=2)
    plugin = EfficientOptimPlugin(gradient_accumulation_steps=4, lr=0.1, lr_scheduler_type="constant")
    accelerator = plugin.create_accelerator(cpu=True)
    model, optimizer, scheduler = plugin.prepare(accelerator, tiny_mlm())
    syncs, grads, weights = [], None, None
    for window in accumulation_windows(accelerator, batches):
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        for batch in window:
            with accelerator.accumulate(model):
                accelerator.backward(window.scale(summed_token_loss(logits_of(model, batch), batch["labels"])))
                syncs.append(accelerator.sync_gradients)
                if accelerator.sync_gradients:
                    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                optimizer.step()
                optimizer.zero_grad()
    assert syncs == [False, False, False, True, True]
    assert {int(s["step"]) for s in optimizer.optimizer.state.values()} == {2}
    # the last window's gradient is its own token mean, at the weights after the first step
    ref_model = tiny_mlm()
    ref_model.load_state_dict(weights)
    F.cross_entropy(logits_of(ref_model, batches[-1]).flatten(0, 1), batches[-1]["labels"].flatten(),
                    ignore_index=IGNORE).backward()
    ref = {n: p.grad for n, p in ref_model.named_parameters() if p.grad is not None}
    assert max_rel_diff(grads, ref) < 1e-5


def test_windows_refuse_an_accelerator_that_syncs_on_dataloader_end():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="sync_with_dataloader=False"):
        next(accumulation_windows(accelerator, variable_batches()))
    with pytest.raises(ValueError, match="sync_with_dataloader=True, .* use plugin.create_accelerator"):
        EfficientOptimPlugin(gradient_accumulation_steps=2).prepare(accelerator, tiny_mlm())


def test_processes_launched_but_not_joined_are_refused(monkeypatch):
    """torchrun without a GPU and without ACCELERATE_USE_CPU: each process would silently train alone."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2.*train independently.*ACCELERATE_USE_CPU=true"):
        EfficientOptimPlugin().create_accelerator(cpu=False)


def test_create_accelerator_refuses_its_own_accumulation_setting():
    with pytest.raises(ValueError, match="set gradient_accumulation_steps on the plugin"):
        EfficientOptimPlugin().create_accelerator(cpu=True, gradient_accumulation_steps=4)


# -------------------------------------------------------------------------------------- schedules

@pytest.mark.parametrize("kind", ["linear", "cosine", "constant_with_warmup"])
def test_schedule_after_k_optimizer_steps(kind):
    plugin = EfficientOptimPlugin(lr=1.0, lr_scheduler_type=kind, warmup_steps=2, gradient_accumulation_steps=2)
    accelerator = plugin.create_accelerator(cpu=True)
    model, optimizer, scheduler = plugin.prepare(accelerator, tiny_mlm(), num_training_steps=6)
    lrs = []
    for window in accumulation_windows(accelerator, variable_batches(n_batches=12)):
        for batch in window:
            with accelerator.accumulate(model):
                accelerator.backward(window.scale(summed_token_loss(logits_of(model, batch), batch["labels"])))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        lrs.append(scheduler.get_last_lr()[0])
    expected = {"linear": [0.5, 1.0, 0.75, 0.5, 0.25, 0.0],
                "cosine": [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(1, 5)],
                "constant_with_warmup": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]}[kind]
    assert lrs == pytest.approx(expected, abs=1e-12)


def test_schedule_needing_total_steps_says_so():
    plugin = EfficientOptimPlugin(lr_scheduler_type="cosine")
    accelerator = plugin.create_accelerator(cpu=True)
    with pytest.raises(ValueError, match="needs num_training_steps"):
        plugin.prepare(accelerator, tiny_mlm())


def test_fallback_schedules_match_transformers():
    from transformers import get_scheduler

    from hf_efficient.integrations.schedules import lambda_schedule

    for kind in ("linear", "cosine", "constant", "constant_with_warmup"):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        hf = get_scheduler(kind, opt, num_warmup_steps=3, num_training_steps=10).lr_lambdas[0]
        ours = lambda_schedule(kind, 3, 10)
        assert [ours(s) for s in range(12)] == pytest.approx([hf(s) for s in range(12)], abs=1e-12), kind


@pytest.mark.parametrize("warmup", [dict(warmup_steps=2), dict(warmup_ratio=0.25)])  # ratio: ceil(1.75) = 2
def test_scheduler_without_transformers_is_transformers_schedule(monkeypatch, warmup):
    """Without transformers the plugin's scheduler (warm-up, total and the per-process stretch) gives the same
    learning rates as with it."""
    from hf_efficient.integrations import schedules

    def lrs(have_transformers: bool):
        monkeypatch.setattr(schedules, "_have_transformers", lambda: have_transformers)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched, warm = schedules.build_scheduler(opt, "cosine", num_training_steps=7, steps_per_update=2, **warmup)
        out = []
        for _ in range(16):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return type(sched).__name__, warm, out

    kind, warm, ours = lrs(False)
    assert kind == "LambdaLR" and warm == 2 and ours[:5] == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])
    assert ours == pytest.approx(lrs(True)[2], abs=1e-12)


# ------------------------------------------------------------------------------------ exact resume

def _combos():
    out = []
    for spec in SPECS.values():
        for backend in spec.backends.values():
            if backend.why_not("cpu") is None:
                out.append((spec.name, backend.name))
    return out


def _train(plugin, windows, model_seed, load_from=None, save_to=None, save_after=None):
    """Train on `windows` (lists of micro-batches); optionally load state first or save it after `save_after`."""
    reset_accelerate()
    accelerator = plugin.create_accelerator(cpu=True)
    dtype = torch.bfloat16 if plugin.optim == "adamw_bf16" else torch.float32
    model, optimizer, scheduler = plugin.prepare(accelerator, tiny_mlm(model_seed, dropout=0.1, dtype=dtype),
                                                 num_training_steps=6)
    start = 0
    if load_from is not None:
        accelerator.load_state(load_from)
        start = save_after
    for i in range(start, len(windows)):
        for window in accumulation_windows(accelerator, windows[i]):
            for batch in window:
                with accelerator.accumulate(model):
                    accelerator.backward(window.scale(summed_token_loss(logits_of(model, batch), batch["labels"])))
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
        if save_to is not None and i + 1 == save_after:
            accelerator.save_state(save_to)
            return None
    return {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).state_dict().items()}, optimizer


@pytest.mark.parametrize("name, backend", _combos())
def test_save_state_load_state_resumes_exactly(tmp_path, name, backend):
    spec = SPECS[name]
    try:
        spec.backends[backend].build.optimizer_cls()
    except ImportError as e:
        pytest.skip(f"{name} is not importable here: {e}")
    batches = variable_batches(n_batches=12, per_batch=2)
    windows = [batches[i:i + 2] for i in range(0, 12, 2)]  # 6 optimizer steps of 2 micro-batches
    plugin = EfficientOptimPlugin(optim=name, backend=backend, lr=1e-2, weight_decay=0.01, warmup_steps=2,
                                  gradient_accumulation_steps=2)
    straight, opt_a = _train(plugin, windows, model_seed=0)
    _train(plugin, windows, model_seed=0, save_to=str(tmp_path / "ckpt"), save_after=3)
    resumed, opt_b = _train(plugin, windows, model_seed=123, load_from=str(tmp_path / "ckpt"), save_after=3)
    assert optimizer_info(opt_b).resolution.backend == backend
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), f"{name}/{backend}: {k} differs after resume"
    start = tiny_mlm(0).state_dict()
    assert any(not torch.equal(start[k].to(straight[k].dtype), straight[k]) for k in straight)  # it did train
    sa, sb = opt_a.optimizer.state_dict()["state"], opt_b.optimizer.state_dict()["state"]
    for i in sa:
        for key, value in sa[i].items():
            if torch.is_tensor(value):
                a, b = (v.dequantize() if type(v) is not torch.Tensor else v for v in (value, sb[i][key]))  # torchao
                assert torch.equal(a, b), f"{name}/{backend}: optimizer state {i}.{key} differs"


# ----------------------------------------------------------------------------------- distributed rules

def _fsdp(version=2):
    from accelerate.utils import FullyShardedDataParallelPlugin

    return SimpleNamespace(distributed_type="FSDP", fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=version))


def _deepspeed(**kwargs):
    from accelerate.utils import DeepSpeedPlugin

    return SimpleNamespace(distributed_type="DEEPSPEED", deepspeed_plugin=DeepSpeedPlugin(**kwargs))


@pytest.mark.parametrize("name, backend, ok", [  # the registry's fsdp2 field decides (each backend's own test shows it)
    (s.name, b, impl.fsdp2 is None) for s in SPECS.values() for b, impl in s.backends.items()
    if s.name != "paged_adam8bit" and impl.serves("cpu")])
def test_fsdp2_rules(name, backend, ok):
    if backend == "torchao":
        pytest.importorskip("torchao", reason="torchao is its own extra: pip install -e \".[torchao]\"")
    if ok:
        check_distributed_support(name, backend, {}, _fsdp())
    else:
        with pytest.raises(ValueError, match=f"hf_eff_{name} \\(backend={backend}\\) is not supported with FSDP2: "
                                             ".*Instead: use hf_eff_adamw, or this optimizer with DDP"):
            check_distributed_support(name, backend, {}, _fsdp())


def test_fsdp2_never_falls_back_to_torchao_and_says_why():
    """torchao's AdamW8bit stores small second moments as 0: under FSDP2 adam8bit runs this package's kernels on the
    shards (no backend forced, none swapped in); torchao runs only when forced, which logs a WARNING (next test)."""
    assert choose_backend("adam8bit", None, {}, _fsdp(), "cpu")[0] is None
    assert choose_backend("adam8bit", None, {}, SimpleNamespace(distributed_type="MULTI_CPU"), "cpu")[0] is None
    with pytest.raises(ValueError, match="FSDP version 1 is not supported.*fsdp_version: 2"):
        check_distributed_support("adamw", None, {}, _fsdp(version=1))


def test_fsdp2_forced_torchao_warns(caplog):
    import hf_efficient.registry as registry

    pytest.importorskip("torchao", reason="torchao is its own extra: pip install -e \".[torchao]\"")

    registry._logged.discard(("adam8bit", "cpu", "torchao"))  # the warning is logged once per process
    plugin = EfficientOptimPlugin(optim="adam8bit", backend="torchao")
    with caplog.at_level("WARNING", logger="hf_efficient"):
        assert choose_backend(plugin.optim, plugin.backend, {}, _fsdp(), "cpu")[0] == "torchao"
        plugin.create_optimizer(tiny_mlm())
    assert any(r.levelname == "WARNING" and "backend='torchao' (forced)" in r.getMessage()
               and "exactly 0" in r.getMessage() for r in caplog.records), caplog.text


def test_auto_is_checked_only_where_it_cannot_run():
    """hf_eff_auto picks a name from the model, later: with no distribution or DDP nothing is checked before
    (it used to fail resolving 'auto' itself); under FSDP2 it picks per rank among the names that step shards
    (tests/test_fsdp2_integrations.py); under DeepSpeed it is refused up front."""
    for dist in ("NO", "MULTI_CPU"):
        assert choose_backend("auto", None, {}, SimpleNamespace(distributed_type=dist), "cpu") == (None, "")
    assert choose_backend("auto", None, {}, _fsdp(), "cpu") == (None, "")
    with pytest.raises(ValueError, match="hf_eff_auto is not supported with DeepSpeed: .*embedding_state=8bit"):
        choose_backend("auto", None, {}, _deepspeed(zero_stage=2), "cpu")


def test_plugin_with_auto_creates_an_accelerator():
    plugin = EfficientOptimPlugin(optim="auto", optim_args="budget_gb=1")
    plugin.create_accelerator(cpu=True)
    model, optimizer, scheduler = plugin.prepare(plugin.create_accelerator(cpu=True), tiny_mlm(),
                                                 num_training_steps=2)
    assert optimizer_info(optimizer).resolution.name == "adamw"


def test_deepspeed_rules():
    check_distributed_support("adamw", None, {}, _deepspeed(zero_stage=2))
    check_distributed_support("adam8bit", "bnb", {"embedding_state": "8bit"}, _deepspeed(zero_stage=3))
    with pytest.raises(ValueError, match="hf_eff_adafactor .* not supported with DeepSpeed: ZeRO flattens"):
        check_distributed_support("adafactor", None, {}, _deepspeed(zero_stage=1))
    with pytest.raises(ValueError, match="hf_eff_adamw_bf16 .* not supported with DeepSpeed: ZeRO keeps fp32 master"):
        check_distributed_support("adamw_bf16", None, {}, _deepspeed(zero_stage=1))
    with pytest.raises(ValueError, match="optimizer offload \\(cpu\\) is not supported"):
        check_distributed_support("adamw", None, {}, _deepspeed(zero_stage=2, offload_optimizer_device="cpu"))
    with pytest.raises(ValueError, match="accumulates 4 micro-batches but gradient_accumulation_steps=2 "
                                         "\\(HF_EFF_GRADIENT_ACCUMULATION_STEPS\\)"):
        check_distributed_support("adamw", None, {}, _deepspeed(gradient_accumulation_steps=4),
                                  plugin_ga=(2, "HF_EFF_GRADIENT_ACCUMULATION_STEPS"))
    ds = _deepspeed()
    ds.deepspeed_plugin.deepspeed_config["optimizer"] = {"type": "AdamW"}
    with pytest.raises(ValueError, match="has an 'optimizer' section"):
        check_distributed_support("adamw", None, {}, ds)


@pytest.mark.parametrize("backend", sorted(SPECS["adam8bit"].backends))
def test_deepspeed_refuses_32bit_embedding_state_on_every_backend(backend):
    """ZeRO hands the optimizer one flat partition, so no backend can keep embeddings' state in 32 bits."""
    if backend == "torchao":
        pytest.importorskip("torchao", reason="torchao is its own extra: pip install -e \".[torchao]\"")
    with pytest.raises(ValueError, match="cannot keep 32-bit state.*embedding_state=8bit"):
        check_distributed_support("adam8bit", backend, {}, _deepspeed(zero_stage=2))


@pytest.mark.parametrize("backend", ["torch", "torchao"])
def test_fp32_state_ids_follow_a_parameter_swap(backend):
    """FSDP2 preparation replaces every parameter in place; the 32-bit-state choice must follow by position."""
    from hf_efficient.integrations.accelerator_checks import fp32_state_flags, restore_fp32_state_ids

    if backend == "torchao":
        pytest.importorskip("torchao", reason="torchao is its own extra: pip install -e \".[torchao]\"")
    plugin = EfficientOptimPlugin(optim="adam8bit", backend=backend)
    optimizer = plugin.create_optimizer(tiny_mlm())
    flags = fp32_state_flags(optimizer)
    assert sum(map(sum, flags)) == 3  # word, position and token-type embeddings
    for g in optimizer.param_groups:
        g["params"] = [torch.nn.Parameter(p.detach().clone()) for p in g["params"]]
    restore_fp32_state_ids(optimizer, flags)
    keep = {id(p) for g in optimizer.param_groups for p in g["params"]} & optimizer._fp32_ids
    assert len(keep) == 3 and fp32_state_flags(optimizer) == flags
