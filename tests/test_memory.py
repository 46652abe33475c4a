"""Measured optimizer state against hand counts, predictions against measurements, the Trainer callback, auto."""

from __future__ import annotations

import importlib.util
import logging
import re

import pytest
import torch
from torch import nn
from transformers import TrainerCallback

import hf_efficient as hfe
from hf_efficient import memory
from hf_efficient.auto import AUTO_MARGIN, choose_auto, free_memory_bytes
from hf_efficient.estimate import estimate_memory
from hf_efficient.memory import MB, optimizer_state_bytes
from hf_efficient.registry import SPECS
from cases import specs
from conftest import ClassificationSet, tiny_bert, tiny_gpt2, tiny_llama

HAS_BF16 = importlib.util.find_spec("hf_efficient.optim.adamw_bf16") is not None
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


@pytest.fixture
def eager_torchao(monkeypatch):
    """torchao compiles its step (~30 s on 2 cores); the state it allocates before that call is what we count."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)


class Small(nn.Module):
    """emb 100x64 (6400, a multiple of 256), big 64->128 (8192), three 128-vectors: 5 tensors, 14,976 elements."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.big = nn.Linear(64, 128)
        self.norm = nn.LayerNorm(128)

    def forward(self, x):
        return self.norm(self.big(self.emb(x))).square().mean()


def one_step(model, name, **options):
    opt = hfe.create_optimizer(model, name, lr=1e-3, **options)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2  # every parameter gets state, whatever the forward uses
    opt.step()
    return opt


VECTORS = 3 * 128
EMB, BIG = 100 * 64, 64 * 128
STEPS = 5 * 4  # one float32 step tensor per parameter (torch, torchao, Adafactor)
QMAP = 256 * 4


def test_hand_count_torch_adamw():
    opt = one_step(Small(), "adamw")
    expected = 2 * 4 * (EMB + BIG + VECTORS) + STEPS
    assert optimizer_state_bytes(opt) == expected == estimate_memory(Small(), "adamw").state_bytes
    assert optimizer_state_bytes(opt, by="key") == {"step": STEPS, "exp_avg": expected // 2 - 10,
                                                    "exp_avg_sq": expected // 2 - 10}
    assert optimizer_state_bytes(opt, by="dtype") == {"float32": expected}


@pytest.mark.parametrize("embedding_state", ["32bit", "8bit"])
def test_hand_count_bitsandbytes(embedding_state):
    opt = one_step(Small(), "adam8bit", backend="bnb", embedding_state=embedding_state)
    big = 2 * BIG + 2 * 4 * (BIG // 256)  # uint8 state1/state2 + float32 absmax1/absmax2 per 256 elements
    emb = 2 * 4 * EMB if embedding_state == "32bit" else 2 * EMB + 2 * 4 * (EMB // 256)
    expected = big + emb + 2 * 4 * VECTORS + 2 * QMAP  # small tensors 32-bit; step is an int; qmaps shared
    assert optimizer_state_bytes(opt) == expected
    assert estimate_memory(Small(), "adam8bit", backend="bnb", embedding_state=embedding_state).state_bytes == expected
    by_key = optimizer_state_bytes(opt, by="key")
    assert by_key["qmap1"] == by_key["qmap2"] == QMAP  # one code book for every parameter: counted once
    assert optimizer_state_bytes(opt, by="dtype")["uint8"] == 2 * BIG + (2 * EMB if embedding_state == "8bit" else 0)


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao not installed")
def test_hand_count_torchao_counts_subclass_inner_tensors(eager_torchao):
    opt = one_step(Small(), "adam8bit", backend="torchao")
    assert type(opt.state[opt.param_groups[0]["params"][1]]["exp_avg"]).__name__ == "OptimState8bit"
    big = 2 * (BIG + 4 * (BIG // 256) + QMAP)  # codes + scale per 256 + a code book, for each of the two states
    expected = big + 2 * 4 * (EMB + VECTORS) + STEPS  # embedding kept 32-bit (default), vectors too small
    assert optimizer_state_bytes(opt) == expected
    assert estimate_memory(Small(), "adam8bit", backend="torchao").state_bytes == expected
    assert optimizer_state_bytes(opt, by="dtype")["uint8"] == 2 * BIG


@pytest.mark.parametrize("beta1", [None, 0.9])
def test_hand_count_adafactor(beta1):
    opt = one_step(Small(), "adafactor", beta1=beta1)
    expected = 4 * ((100 + 64) + (128 + 64) + VECTORS) + STEPS  # row + column statistics of each matrix
    if beta1 is not None:
        expected += 4 * (EMB + BIG + VECTORS)
    assert optimizer_state_bytes(opt) == expected == estimate_memory(Small(), "adafactor", beta1=beta1).state_bytes


def test_shared_storage_and_views_counted_once():
    p, q = nn.Parameter(torch.zeros(10)), nn.Parameter(torch.zeros(10))
    opt = torch.optim.SGD([p, q], lr=0.1)
    buf = torch.zeros(100)
    opt.state[p] = {"a": buf, "nested": [buf[:10], {"x": torch.zeros(3, dtype=torch.float16)}]}
    opt.state[q] = {"a": buf[50:], "n": 3}
    assert optimizer_state_bytes(opt) == 400 + 6
    assert optimizer_state_bytes(opt, by="key") == {"a": 400, "nested": 6}
    with pytest.raises(ValueError, match="by='size'"):
        optimizer_state_bytes(opt, by="size")


def _cases():
    """Every (name, backend, options) that can run on CPU here: each backend of each spec (docs/contributing.md's
    example family's too), plus the 8-bit policy variants; the paged name resolves to adam8bit off CUDA."""
    out = []
    for spec in specs():
        if not spec.backends:
            continue
        backends = [b for b, be in spec.backends.items() if be.why_not("cpu") is None] or [None]
        for b in backends:
            out.append((spec.name, b, {}))
            if "embedding_state" in spec.options and b != "torchao":
                out.append((spec.name, b, {"embedding_state": f"{spec.facts.codec.BITS}bit", "min_8bit_size": 1}))
    out.append(("adafactor", None, {"beta1": 0.9}))
    out.append(("adamw_bf16", None, {"compensation": "stochastic"}))
    return out


@pytest.mark.example_family
@pytest.mark.parametrize("make", [tiny_bert, tiny_gpt2, tiny_llama], ids=["bert", "gpt2", "llama"])
def test_prediction_matches_measurement_within_3_percent(make, eager_torchao):
    rows = []
    for name, backend, options in _cases():
        if name == "adamw_bf16" and not HAS_BF16:
            continue
        if backend == "torchao" and make is not tiny_bert:
            continue  # one model is enough for the slowest backend
        model = make()
        if name == "adamw_bf16":
            model = model.to(torch.bfloat16)
        predicted = estimate_memory(model, name, backend=backend, **options)
        measured = optimizer_state_bytes(one_step(model, name, backend=backend, **options))
        rows.append((name, backend, options, predicted.state_bytes, measured))
    assert {r[0] for r in rows} >= {"adamw", "adam8bit", "paged_adam8bit", "adafactor", "sgdm8bit"}
    for name, backend, options, predicted, measured in rows:
        assert abs(predicted - measured) <= 0.03 * measured, (name, backend, options, predicted, measured)


def test_estimate_for_a_count_states_its_assumption():
    n = 65_783_042
    adamw = estimate_memory(n, "adamw", device="cpu")
    tensors = -(-n // 2**20)
    assert adamw.state_bytes == 8 * n + 4 * tensors and adamw.saving == 0.0
    assert round(adamw.state_bytes / MB) == 502
    assert adamw.param_bytes == adamw.grad_bytes == 4 * n
    all8 = estimate_memory(n, "adam8bit", device="cpu", embedding_state="8bit", min_8bit_size=1)
    assert all8.backend == "torch" and abs(all8.state_bytes / MB - 127.4) < 0.05  # 2 B + 8/256 B absmax per elem
    assert "1024 columns" in all8.assumption and "no embeddings" in all8.assumption
    bf16 = estimate_memory(n, "adamw", param_dtype="bf16", device="cpu")  # fp32 moments, stochastic rounding
    assert bf16.param_bytes == 2 * n and bf16.state_bytes == 8 * n + 4 * tensors
    assert bf16.options["compensation"] == "stochastic"
    assert estimate_memory(n, "adamw", param_dtype="bf16", device="cpu", compensation="kahan").state_bytes == (
        10 * n + 4 * tensors)  # + the bf16 Kahan buffer
    with pytest.raises(ValueError, match="positive"):
        estimate_memory(0, "adamw")


def test_estimate_for_a_config_builds_on_meta():
    """A config becomes a meta model in the integration (the core never imports transformers); handed to
    estimate_memory itself, it is refused with that one line."""
    from transformers import DistilBertConfig

    from hf_efficient.integrations.transformers import model_from_config

    cfg = DistilBertConfig(vocab_size=28996, architectures=["DistilBertForSequenceClassification"])
    with pytest.raises(TypeError, match=r"transformers config.*estimate_memory\(model_from_config\(config\)"):
        estimate_memory(cfg, "adam8bit")
    model = model_from_config(cfg)
    est = estimate_memory(model, "adam8bit", device="cpu")
    assert est.num_params == 65_783_042 and est.assumption is None
    emb = 28996 * 768 + 512 * 768  # word + position embeddings keep 32-bit state by default
    assert est.state_bytes > 8 * emb
    allq = estimate_memory(model, "adam8bit", device="cpu", embedding_state="8bit", min_8bit_size=1)
    assert 125 < allq.state_bytes / MB < 128  # the reference measured 128 MB with bitsandbytes' defaults


def test_frozen_parameters_cost_memory_but_no_state():
    model = Small()
    model.emb.weight.requires_grad_(False)
    est = estimate_memory(model, "adamw")
    assert est.num_params == BIG + VECTORS and est.param_bytes == 4 * (EMB + BIG + VECTORS)
    assert est.state_bytes == optimizer_state_bytes(one_step(model, "adamw"))


# ------------------------------------------------------------------------------------------------- auto

def _budget_gb(total_bytes: int, slack: float) -> float:
    return total_bytes * slack / (1 - AUTO_MARGIN) / 2**30


def test_auto_picks_by_budget(caplog):
    model = tiny_bert()
    est = {n: estimate_memory(model, n).total_bytes for n in ("adamw", "adam8bit", "adam4bit", "adafactor")}
    assert est["adamw"] > est["adam8bit"] > est["adam4bit"] > est["adafactor"]
    picks = {}
    for expect, budget in [("adamw", _budget_gb(est["adamw"], 1.01)), ("adam8bit", _budget_gb(est["adamw"], 0.99)),
                           ("adam4bit", _budget_gb(est["adam8bit"], 0.99)),
                           ("adafactor", _budget_gb(est["adam4bit"], 0.99))]:
        opt = hfe.create_optimizer(model, "hf_eff_auto", lr=1e-3, budget_gb=budget, embedding_state="32bit")
        picks[expect] = opt.hf_efficient.resolution.name
        assert estimate_memory(model, "auto", budget_gb=budget).name == "hf_eff_" + expect
    assert picks == {n: n for n in ("adamw", "adam8bit", "adam4bit", "adafactor")}
    with caplog.at_level(logging.WARNING, logger="hf_efficient.auto"):
        choice = choose_auto(model, {"budget_gb": 1e-6})
    assert choice.name == "adafactor" and not choice.fits and "NONE FITS" in caplog.text
    assert "budget_gb=1e-06" in caplog.text and "hf_eff_adamw needs" in caplog.text


def test_auto_reads_free_memory_and_refuses_foreign_options():
    assert free_memory_bytes("cpu") > 0
    with pytest.raises(RuntimeError, match="budget_gb"):
        free_memory_bytes("meta")
    choice = choose_auto(tiny_bert())  # a 100k-parameter model fits any machine running this test
    assert choice.name == "adamw" and choice.fits and "free on cpu" in choice.source
    with pytest.raises(ValueError, match="unknown option 'backend' for 'auto'"):
        hfe.create_optimizer(tiny_bert(), "auto", backend="bnb")
    with pytest.raises(ValueError, match="no backend of its own"):
        hfe.resolve("hf_eff_auto")


@pytest.mark.skipif(not HAS_BF16, reason="optim/adamw_bf16.py not there yet")
def test_auto_on_bf16_models_prefers_adamw_then_adamw_bf16():
    """adamw (fp32 moments, compensated bf16 writes) when it fits, else adamw_bf16 (bf16 moments), as documented."""
    model = tiny_bert().to(torch.bfloat16)
    assert choose_auto(model, {"budget_gb": 100}).name == "adamw"
    need = {c.name: c.total_bytes for c in choose_auto(model, {"budget_gb": 100}).candidates}
    assert need["hf_eff_adamw_bf16"] < need["hf_eff_adamw"]
    between = (need["hf_eff_adamw_bf16"] + need["hf_eff_adamw"]) / 2 / (1 - AUTO_MARGIN) / 2**30
    assert choose_auto(model, {"budget_gb": between}).name == "adamw_bf16"


# ---------------------------------------------------------------------------------------- Trainer callback

def _trainer(tmp_path, optim, optim_args=None, callbacks=None):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(str(tmp_path), optim=optim, optim_args=optim_args, max_steps=2, logging_steps=50,
                             per_device_train_batch_size=8, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True)
    return Trainer(model=tiny_bert(), args=args, train_dataset=ClassificationSet(n=16), callbacks=callbacks)


class Recorder(TrainerCallback):
    """Stands for TensorBoard / W&B: records what on_log hands to callbacks after ours."""

    def __init__(self):
        self.seen = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(dict(logs))


def test_callback_is_added_for_hf_eff_names_and_logs_measured_state(tmp_path):
    from hf_efficient.integrations.transformers import MemoryCallback

    rec = Recorder()
    model_est = estimate_memory(tiny_bert(), "adam8bit")
    budget = _budget_gb(estimate_memory(tiny_bert(), "adamw").total_bytes, 0.99)  # too little for adamw
    trainer = _trainer(tmp_path, "hf_eff_auto", f"budget_gb={budget}", callbacks=[rec])
    assert isinstance(trainer.callback_handler.callbacks[0], MemoryCallback)
    trainer.train()
    assert hfe.optimizer_info(trainer.optimizer).resolution.name == "adam8bit"
    first = trainer.state.log_history[0]
    assert first["step"] == 1 and "loss" in first
    measured = optimizer_state_bytes(trainer.optimizer)
    assert first["hf_eff/optimizer_state_mb"] == pytest.approx(measured / MB)
    assert abs(measured - model_est.state_bytes) <= 0.03 * measured
    assert first["hf_eff/optimizer_state_saving"] == pytest.approx(model_est.saving, abs=0.01) and model_est.saving > 0.3
    assert first["hf_eff/peak_rss_mb"] > 0
    assert all("hf_eff/peak_rss_mb" in entry for entry in trainer.state.log_history)
    assert rec.seen[0]["hf_eff/optimizer_state_mb"] == first["hf_eff/optimizer_state_mb"]


def test_callback_on_its_own_with_a_transformers_optimizer(tmp_path):
    from hf_efficient.integrations.transformers import MemoryCallback

    rec = Recorder()
    trainer = _trainer(tmp_path, "adamw_torch", callbacks=[rec, MemoryCallback()])
    assert isinstance(trainer.callback_handler.callbacks[0], MemoryCallback)  # moved before the reporters
    trainer.train()
    first = trainer.state.log_history[0]
    assert first["hf_eff/optimizer_state_saving"] == 0.0  # fp32 AdamW is the baseline itself
    assert rec.seen[0]["hf_eff/fp32_adamw_state_mb"] == first["hf_eff/optimizer_state_mb"]
    assert not any(isinstance(cb, MemoryCallback) for cb in _trainer(tmp_path, "adamw_torch").callback_handler.callbacks)


# ------------------------------------------------------------------------------------------- misuse

def test_a_string_is_not_a_model():
    for call in (lambda: estimate_memory("bert-base-uncased", "adamw"), lambda: choose_auto("bert-base-uncased")):
        with pytest.raises(TypeError, match=r"is a string.*hf-efficient estimate bert-base-uncased.*model_from_config"):
            call()


def test_a_meta_model_is_estimated_like_the_real_one():
    with torch.device("meta"):
        meta = Small()
    for name in ("adamw", "adam8bit", "adafactor"):
        assert estimate_memory(meta, name).state_bytes == estimate_memory(Small(), name).state_bytes
    assert choose_auto(meta, {"budget_gb": 100}).name == "adamw"


def test_a_huge_count_is_refused_before_any_arithmetic():
    with pytest.raises(ValueError, match=r"at most 1e\+15.*got 99999999999999999999"):
        estimate_memory(99999999999999999999, "adamw")
    with pytest.raises(ValueError, match="budget_gb' must be a finite number, got inf"):
        estimate_memory(10**6, "auto", budget_gb=float("inf"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_adamw_on_half_precision_params_keeps_fp32_moments_and_a_kahan_buffer(dtype):
    """hf_eff_adamw on bf16/fp16 weights: fp32 moments (8 B/param) and, under kahan, a bf16 buffer (2); torch's
    AdamW would keep 4 B/param of moments in the weights' dtype and lose sub-ulp updates."""
    model = Small().to(dtype)
    opt = one_step(model, "adamw", compensation="kahan")
    est = estimate_memory(model, "adamw", compensation="kahan")
    assert optimizer_state_bytes(opt) == est.state_bytes == (8 + 2) * (EMB + BIG + VECTORS) + STEPS
    assert est.state_bytes_per_param == pytest.approx(10, abs=0.01)
    assert estimate_memory(Small(), "adamw", param_dtype=dtype, compensation="kahan").state_bytes == est.state_bytes
    none = one_step(Small().to(dtype), "adamw", compensation="none")
    assert optimizer_state_bytes(none) == estimate_memory(model, "adamw", compensation="none").state_bytes == (
        8 * (EMB + BIG + VECTORS) + STEPS)


def test_a_count_is_counted_by_kinds_of_tensor_not_one_by_one():
    n = 10**12 + 5  # 953,675 assumed tensors of 2**20 elements and one of the rest: two kinds
    tensors = memory.describe_params(n).tensors
    assert len(tensors) == 2 and sum(t.elements for t in tensors) == n
    n = memory.MAX_PARAMS  # at the cap, still instant
    est = estimate_memory(n, "adamw", device="cpu")
    assert est.num_params == n and est.state_bytes == 8 * n + 4 * -(-n // 2**20)


@pytest.mark.parametrize("optim", ["hf_eff_adam8bit", "hf_eff_adamw"])
def test_memory_log_line_says_it_one_way_in_mib(tmp_path, caplog, optim):
    """One unit (MiB, binary), the saving said one way round. (The embedding_state=8bit hint is said once, when the
    Trainer builds the optimizer: tests/test_trainer.py.)"""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(str(tmp_path), optim=optim, max_steps=1, report_to=[],
                             per_device_train_batch_size=8, save_strategy="no", use_cpu=True, disable_tqdm=True)
    model = tiny_bert(vocab=4096)  # embeddings hold most parameters, as in MiniLM or GPT-2
    with caplog.at_level(logging.INFO, logger="hf_efficient.integrations.transformers"):
        Trainer(model=model, args=args, train_dataset=ClassificationSet(n=8, vocab=4096)).train()
    line = next(r.getMessage() for r in caplog.records if "measured at step" in r.getMessage())
    assert re.fullmatch(r"hf_efficient: optimizer state [0-9.]+ MiB measured at step 1; fp32 AdamW: [0-9.]+ MiB; "
                        r"this saves \d+%", line), line
    assert " MB" not in line and "x the memory" not in line


# ----------------------------------------------------------------------------------- per rank (world_size, sharding)

def test_per_rank_hand_counts_fsdp2_zero_and_ddp():
    """Small on 3 ranks. FSDP2: each tensor's largest row shard (ceil(rows / 3)), by the same rule; ZeRO: one flat
    fp32 partition of ceil(14,976 / 3) elements; DDP (sharding=None): everything on every rank. Measured per rank
    on 2 gloo ranks in tests/test_fsdp2_integrations.py."""
    rows = {"emb": (34, 64), "big.weight": (43, 64), "big.bias": (43,), "norm.weight": (43,), "norm.bias": (43,)}
    local = sum(torch.Size(s).numel() for s in rows.values())
    fsdp = estimate_memory(Small(), "adamw", world_size=3, sharding="fsdp2")
    assert fsdp.state_bytes == 8 * local + STEPS and fsdp.param_bytes == fsdp.grad_bytes == 4 * local
    assert (fsdp.world_size, fsdp.sharding, fsdp.saving) == (3, "fsdp2", 0.0)  # the baseline is per rank too
    factored = estimate_memory(Small(), "adafactor", world_size=3, sharding="fsdp2")
    # matrices: row statistics of the shard, column statistics whole on every rank; vectors: their shard
    assert factored.state_bytes == 4 * (34 + 64 + 43 + 64 + 3 * 43) + STEPS
    part = -(-(EMB + BIG + VECTORS) // 3)
    for stage, params, grads in (("zero1", 1, 1), ("zero2", 1, 3), ("zero3", 3, 3)):
        zero = estimate_memory(Small(), "adamw", world_size=3, sharding=stage)
        assert zero.state_bytes == 8 * part + 4, stage  # one flat partition: one step
        assert zero.param_bytes == (4 * part if params == 3 else 4 * (EMB + BIG + VECTORS)), stage
        assert zero.grad_bytes == (4 * part if grads == 3 else 4 * (EMB + BIG + VECTORS)), stage
    ddp = estimate_memory(Small(), "adamw", world_size=3)
    assert ddp.state_bytes == estimate_memory(Small(), "adamw").state_bytes and ddp.sharding is None


def test_per_rank_refuses_what_cannot_run_so_sharded():
    from hf_efficient.integrations.distributed import FSDP2_UNSUPPORTED

    for (name, backend), why in FSDP2_UNSUPPORTED.items():
        if SPECS[name].backends[backend].serves("cpu") and backend != "torchao" and name != "paged_adam8bit":
            with pytest.raises(memory.UnsupportedSharding, match="does not step FSDP2 shards") as e:
                estimate_memory(Small(), name, backend=backend, device="cpu", world_size=2, sharding="fsdp2")
            assert why in str(e.value)
    with pytest.raises(memory.UnsupportedSharding, match="DeepSpeed ZeRO"):
        estimate_memory(Small(), "adafactor", world_size=2, sharding="zero2")
    with pytest.raises(ValueError, match="world_size=0"):
        estimate_memory(Small(), "adamw", world_size=0)
    with pytest.raises(ValueError, match="sharding='fsdp'"):
        estimate_memory(Small(), "adamw", world_size=2, sharding="fsdp")


def test_gradient_release_predicts_a_bucket_and_the_largest_gradient():
    from hf_efficient.release import BUCKET_BYTES

    model = tiny_llama()
    plain, released = (estimate_memory(model, "adam4bit", gradient_release=r) for r in (False, True))
    largest = max(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert plain.grad_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert released.grad_bytes == min(plain.grad_bytes, BUCKET_BYTES + largest)
    assert released.state_bytes == plain.state_bytes and released.options["gradient_release"] is True
