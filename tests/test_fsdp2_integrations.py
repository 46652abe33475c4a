"""FSDP2 through the integrations, on 2 gloo CPU processes: the accelerate plugin and the Trainer train the names
whose backends step shards (the registry's ``fsdp2`` field), refuse the others with the reason, and memory is
predicted and measured per rank.

accelerate offers FSDP only on accelerator process groups (its ``AcceleratorState`` never turns ``MULTI_CPU`` into
``FSDP``): :func:`_as_fsdp_capable` marks the gloo group as one before the Accelerator is made, so accelerate's own
FSDP2 preparation (``fully_shard`` of the model, the optimizer's parameters swapped for DTensors) runs on CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from cases import names, plain, shardable
from fsdp_helpers import full, run_ranks, shard
from hf_efficient import create_optimizer, estimate_memory, optimizer_state_bytes
from hf_efficient.info import unwrap
from hf_efficient.integrations.distributed import FSDP2_UNSUPPORTED, check_fsdp
from hf_efficient.registry import SPECS, get_spec, resolve

STEPS = 3
# The names whose backend on CPU steps FSDP2 shards, read from the registry (never a hand-written list); what
# docs/distributed.md calls "yes" under FSDP2 (tests/test_docs.py checks)
pytestmark = pytest.mark.example_family  # SHARDABLE holds the example family: registered here for each test
SHARDABLE = plain(names(shardable))
RUN = [n for n in ("adafactor", "adamw") if n in SHARDABLE]  # the names whose memory is measured on 2 ranks (time)
RUN_8BIT = [n for n in ("adam8bit", "lion8bit") if n in SHARDABLE]  # measured on _Blocks: 8-bit state under FSDP2
LOOPS = SHARDABLE  # every name that steps shards trains in both loops


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)  # 33 rows: an uneven Shard(0) split on 2 ranks (17 + 16)
    return torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 8, generator=g), torch.randn(4, 5, generator=g)


def _as_fsdp_capable() -> None:
    """Let accelerate make an FSDP Accelerator on this gloo group (see the module docstring)."""
    import torch.distributed as dist
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    os.environ.update(ACCELERATE_USE_CPU="true", RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()),
                      LOCAL_RANK=str(dist.get_rank()), MASTER_ADDR="127.0.0.1")
    PartialState(cpu=True).distributed_type = DistributedType.MULTI_GPU


def _accelerate_run(name: str) -> dict:
    """The plugin's loop under accelerate's FSDP2 on this rank: losses, state placement, bytes, final weights."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from hf_efficient.integrations.accelerate import EfficientOptimPlugin

    _as_fsdp_capable()
    plugin = EfficientOptimPlugin(optim=name, lr=1e-2, weight_decay=0.0, optim_args="budget_gb=1" if name == "auto"
                                  else "")
    acc = plugin.create_accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model, opt, sched = plugin.prepare(acc, _mlp(), num_training_steps=STEPS)
    x, y = _data()
    losses = []
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    inner = unwrap(opt, until="state")
    placed = {k: type(v).__name__ for st in inner.state.values() for k, v in st.items() if k != "step"}
    return {"type": acc.distributed_type.value, "losses": losses, "placed": placed,
            "ran": type(inner).__name__, "measured": optimizer_state_bytes(opt),
            "predicted": estimate_memory(model, name if name != "auto" else "adamw").state_bytes,
            "weights": [full(p) for p in model.parameters()]}


def _one_process(name: str) -> tuple[list[float], list[torch.Tensor]]:
    """The same loop in one process: each rank above trains on the same batch, so FSDP2 must match it."""
    model = _mlp()
    opt = create_optimizer(model, name, lr=1e-2, weight_decay=0.0)
    x, y = _data()
    losses = []
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_shardable_names_come_from_the_registry():
    assert set(RUN) == {"adafactor", "adamw"} & set(SHARDABLE)
    assert RUN, "no name steps FSDP2 shards: the registry lost its fsdp2 facts"


@pytest.mark.parametrize("name", LOOPS)
def test_accelerate_fsdp2_trains_like_one_process(name):
    ranks = run_ranks(_accelerate_run, 2, name)
    losses, weights = _one_process(name)
    for r in ranks:
        assert r["type"] == "FSDP"
        assert set(r["placed"].values()) == {"DTensor"}, r["placed"]  # state placed like the parameters: DCP saves it
        assert r["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
        for got, want in zip(r["weights"], weights):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # per rank: rank 0 holds the larger shard (17 of 33 rows), and that is what is predicted
    assert ranks[0]["measured"] == ranks[0]["predicted"]
    assert ranks[1]["measured"] < ranks[0]["measured"]


class _Blocks(torch.nn.Module):
    """Every case of the 8-bit rule under FSDP2 (decided from the global shape, see optim/_blockwise.py), each
    layer its own FSDP2 unit, fed its own input: rows of 256 and 512 elements (8-bit; 33 rows split unevenly), a
    matrix whose shard is below min_8bit_size (24 x 256: 8-bit, as the whole), rows that are not whole blocks
    (40 x 300: fp32), and a vector of min_8bit_size elements (the norm: fp32 under FSDP2, 8-bit in one process)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        for i, m in enumerate([torch.nn.Linear(256, 33), torch.nn.Linear(512, 40), torch.nn.Linear(256, 24),
                               torch.nn.Linear(300, 40), torch.nn.LayerNorm(4096)]):
            self.add_module(f"l{i}", m)

    def loss(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(1)
        return sum(m(torch.randn(2, m.weight.shape[-1], generator=g)).square().mean() for m in self.children())


def _memory_case(name: str) -> dict:
    """Shard by hand, step once, and compare per-rank bytes: measured (local tensors) against predicted, both for
    the sharded model itself (its mesh read from its DTensors) and for the plain model with world_size=2. The 8-bit
    names train :class:`_Blocks` (the MLP's matrices are too small for 8-bit state)."""
    make = _Blocks if name in RUN_8BIT else _mlp
    plain = make()
    predicted = estimate_memory(plain, name, world_size=2, sharding="fsdp2").state_bytes
    model = shard(make())
    opt = create_optimizer(model, name, lr=1e-2)
    if name in RUN_8BIT:
        model.loss().backward()
    else:
        x, y = _data()
        torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return {"measured": optimizer_state_bytes(opt), "predicted": predicted,
            "from_sharded": estimate_memory(model, name).state_bytes,
            "whole": estimate_memory(plain, name).state_bytes}


@pytest.mark.parametrize("name", RUN + RUN_8BIT)
def test_per_rank_state_bytes_predicted_equal_measured(name):
    r0, r1 = run_ranks(_memory_case, 2, name)
    assert r0["measured"] == r0["predicted"] == r0["from_sharded"] == r1["predicted"]  # the largest shard's bytes
    assert r1["measured"] <= r0["measured"]
    if name not in RUN_8BIT:  # _Blocks' norm and 40 x 300 keep fp32 state under FSDP2, 8-bit in one process
        assert r0["predicted"] < r0["whole"]


def _save_state_run(name: str, tmp: str) -> dict:
    """accelerate's FSDP2 loop on this rank: save_state after one step, then two more; a fresh Accelerator, model
    and optimizer load_state and take the same two steps. Losses, weights and the 8-bit state's dtypes of both."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from hf_efficient.integrations.accelerate import EfficientOptimPlugin

    x, y = _data()
    x = torch.nn.functional.pad(x, (0, 248))  # 256 inputs: the first matrix (33 x 256) keeps 8-bit state

    def run(load: bool) -> dict:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state()  # a fresh Accelerator (else the second one keeps the first's state, no FSDP)
        _as_fsdp_capable()
        plugin = EfficientOptimPlugin(optim=name, lr=1e-2, weight_decay=0.01)
        acc = plugin.create_accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        torch.manual_seed(int(load))  # the resumed run starts from other weights: load_state must restore them
        model = torch.nn.Sequential(torch.nn.Linear(256, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
        model, opt, _ = plugin.prepare(acc, model, num_training_steps=STEPS)
        if load:
            acc.load_state(tmp)
        losses = []
        for step in range(1 if load else 0, STEPS):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if step == 0:
                acc.save_state(tmp)
        inner = unwrap(opt, until="state")
        dtypes = sorted({str(v.dtype) for st in inner.state.values() for k, v in st.items() if k != "step"})
        return {"losses": losses[-(STEPS - 1):], "weights": [full(p) for p in model.parameters()], "dtypes": dtypes}

    return {"uninterrupted": run(load=False), "resumed": run(load=True)}


@pytest.mark.parametrize("name", [n for n in ("adam8bit",) if n in SHARDABLE])
def test_accelerate_save_state_load_state_under_fsdp2_resumes_exactly(name, tmp_path):
    for r in run_ranks(_save_state_run, 2, name, str(tmp_path / "ckpt")):
        want, got = r["uninterrupted"], r["resumed"]
        assert "torch.uint8" in want["dtypes"] and got["dtypes"] == want["dtypes"]  # 8-bit state saved and loaded
        assert got["losses"] == want["losses"]
        for a, b in zip(got["weights"], want["weights"]):
            assert torch.equal(a, b)


def _trainer_run(name: str, tmp: str) -> dict:
    from transformers import Trainer, TrainingArguments

    _as_fsdp_capable()
    x, y = _data()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def forward(self, x, labels=None):
            out = self.net(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    data = [{"x": x[i], "labels": y[i]} for i in range(4)]
    args = TrainingArguments(tmp, optim=f"hf_eff_{name}", optim_args="budget_gb=1" if name == "auto" else None,
                             fsdp="full_shard", fsdp_config={"version": 2}, per_device_train_batch_size=4,
                             max_steps=STEPS, learning_rate=1e-2, weight_decay=0.0, lr_scheduler_type="constant",
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, max_grad_norm=0.0,
                             dataloader_drop_last=False)
    _ = args.device  # TrainingArguments sets up its process state first (and resets accelerate's): mark it after
    _as_fsdp_capable()
    trainer = Trainer(model=Model(), args=args, train_dataset=data)
    trainer.train()
    inner = unwrap(trainer.optimizer, until="state")
    logged = next(h for h in trainer.state.log_history if "hf_eff/optimizer_state_mb" in h)
    return {"type": trainer.accelerator.distributed_type.value, "ran": type(inner).__name__,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "placed": {k: type(v).__name__ for st in inner.state.values() for k, v in st.items() if k != "step"},
            "measured": optimizer_state_bytes(trainer.optimizer), "logged_mb": logged["hf_eff/optimizer_state_mb"],
            "logged_fp32_adamw_mb": logged["hf_eff/fp32_adamw_state_mb"],
            "fp32_adamw_per_rank": estimate_memory(_mlp(), "adamw", world_size=2, sharding="fsdp2").state_bytes}


@pytest.mark.parametrize("name", LOOPS)
def test_trainer_fsdp2_trains_and_logs_per_rank_state(name, tmp_path):
    ranks = run_ranks(_trainer_run, 2, name, str(tmp_path))
    losses, _ = _one_process(name)
    for r in ranks:
        assert r["type"] == "FSDP"
        assert set(r["placed"].values()) == {"DTensor"}, r["placed"]
        assert r["losses"] == pytest.approx(losses, rel=1e-4)
        assert r["logged_mb"] * 2**20 == pytest.approx(r["measured"])  # the memory log: this rank's bytes
    assert ranks[1]["measured"] < ranks[0]["measured"]
    # the saving is against fp32 AdamW on the same shards (rank 0: the largest), not on the whole model
    assert ranks[0]["logged_fp32_adamw_mb"] * 2**20 == pytest.approx(ranks[0]["fp32_adamw_per_rank"])


@pytest.mark.parametrize("name, backend", sorted(FSDP2_UNSUPPORTED))
def test_names_that_cannot_step_shards_are_refused_with_the_registrys_reason(name, backend, tmp_path):
    from transformers import TrainingArguments

    if not SPECS[name].backends[backend].serves("cpu"):
        pytest.skip(f"{backend} does not serve cpu")
    why = FSDP2_UNSUPPORTED[(name, backend)]
    with pytest.raises(ValueError, match="not supported with FSDP2") as e:
        check_fsdp(name, backend, version=2)
    assert why in str(e.value)
    if resolve(name, "cpu", log=False).backend == backend:  # the default here: the Trainer refuses before the model
        with pytest.raises(ValueError, match="not supported with FSDP2"):
            TrainingArguments(str(tmp_path), optim=f"hf_eff_{name}", fsdp="full_shard", fsdp_config={"version": 2},
                              use_cpu=True, report_to=[])


def test_trainer_checks_fsdp_args_before_the_model(tmp_path):
    from transformers import TrainingArguments

    with pytest.raises(ValueError, match="FSDP version 1 is not supported.*'version': 2"):
        TrainingArguments(str(tmp_path), optim="hf_eff_adamw", fsdp="full_shard", fsdp_config={"version": 1},
                          use_cpu=True, report_to=[])
    TrainingArguments(str(tmp_path), optim="hf_eff_adafactor", fsdp="full_shard", fsdp_config={"version": 2},
                      use_cpu=True, report_to=[])


def test_gradient_release_under_fsdp2_is_refused_with_fsdp2s_reason(tmp_path):
    from transformers import TrainingArguments

    with pytest.raises(ValueError, match="after its reduce-scatter, inside its reduction stream"):
        check_fsdp("adamw", None, version=2, gradient_release=True)
    with pytest.raises(ValueError, match="gradient release is not supported with FSDP2"):
        TrainingArguments(str(tmp_path), optim="hf_eff_adamw", optim_args="gradient_release=true", fsdp="full_shard",
                          fsdp_config={"version": 2}, use_cpu=True, report_to=[], max_grad_norm=0.0)


def test_plugin_tells_auto_the_sharding():
    """accelerate's prepare builds the optimizer before it shards the model: the plugin passes the sharding on."""
    from hf_efficient import optimizer_info
    from hf_efficient.integrations.accelerate import EfficientOptimPlugin

    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    whole = estimate_memory(model, "adamw").total_bytes
    per_rank = estimate_memory(model, "adamw", world_size=4, sharding="fsdp2").total_bytes
    plugin = EfficientOptimPlugin(optim="auto", optim_args=f"budget_gb={(per_rank + whole) / 2 / 0.8 / 2**30}")
    assert optimizer_info(plugin.create_optimizer(model)).resolution.name != "adamw"
    opt = plugin.create_optimizer(model, world_size=4, sharding="fsdp2")
    assert optimizer_info(opt).resolution.name == "adamw"


def test_trainer_tells_auto_the_sharding(tmp_path):
    """The Trainer builds the optimizer before FSDP2 shards the model: its kwargs carry the sharding to auto."""
    from types import SimpleNamespace

    from hf_efficient import optimizer_info
    from hf_efficient.integrations.transformers import _get_optimizer_cls_and_kwargs

    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    whole = estimate_memory(model, "adamw").total_bytes
    per_rank = estimate_memory(model, "adamw", world_size=4, sharding="fsdp2").total_bytes
    args = SimpleNamespace(optim=SimpleNamespace(value="hf_eff_auto"), learning_rate=1e-3, adam_beta1=0.9,
                           adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, world_size=4, fsdp="full_shard",
                           fsdp_config={"version": 2},
                           optim_args=f"budget_gb={(per_rank + whole) / 2 / 0.8 / 2**30}")
    cls, kwargs = _get_optimizer_cls_and_kwargs(args, model)
    assert (kwargs["world_size"], kwargs["sharding"]) == (4, "fsdp2")
    assert optimizer_info(cls(**kwargs)).resolution.name == "adamw"
    args.fsdp = None
    assert optimizer_info(cls(**_get_optimizer_cls_and_kwargs(args, model)[1])).resolution.name != "adamw"


def test_auto_chooses_from_the_per_rank_footprint():
    """A budget that holds adamw's per-rank bytes on 4 ranks but not its whole bytes: auto picks adamw sharded,
    adafactor unsharded; under FSDP2 it never picks a name that cannot step shards."""
    from hf_efficient.auto import choose_auto

    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    whole = estimate_memory(model, "adamw").total_bytes
    per_rank = estimate_memory(model, "adamw", world_size=4, sharding="fsdp2").total_bytes
    budget = {"budget_gb": (per_rank + whole) / 2 / 0.8 / 2**30}
    assert choose_auto(model, budget).name != "adamw"
    sharded = choose_auto(model, budget, world_size=4, sharding="fsdp2")
    assert sharded.name == "adamw" and sharded.chosen.state_bytes == estimate_memory(
        model, "adamw", world_size=4, sharding="fsdp2").state_bytes
    tiny = choose_auto(model, {"budget_gb": 1e-9}, world_size=4, sharding="fsdp2")
    assert {c.name.removeprefix("hf_eff_") for c in tiny.candidates} <= set(SHARDABLE)



RESUME_STEPS, RESUME_AT = 4, 2


def _trainer_resume_runs(names: list[str], tmp: str) -> dict:
    """For each name, on this rank: a Trainer under FSDP2 trains RESUME_STEPS steps, saving a checkpoint at step
    RESUME_AT; a new Trainer resumes from it. The largest |weight difference| of the two runs' final weights and the
    resumed state's dtypes. One spawn for every name: a launch costs more than a run."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)  # rows of 256 inputs: the first matrix keeps 8-bit state (adam8bit, lion8bit)
            self.net = torch.nn.Sequential(torch.nn.Linear(256, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))

        def forward(self, x, labels=None):
            out = self.net(x.to(self.net[0].weight.dtype))
            return {"loss": torch.nn.functional.mse_loss(out.float(), labels), "logits": out}

    g = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(256, generator=g), "labels": torch.randn(5, generator=g)} for _ in range(16)]

    def run(name: str, out_dir: str, resume: str | None = None) -> tuple[list[torch.Tensor], list[str]]:
        AcceleratorState._reset_state(reset_partial_state=True)  # each Trainer as in a fresh process launched
        _as_fsdp_capable()  # with RANK / WORLD_SIZE set, so that both runs shard the data alike
        args = TrainingArguments(out_dir, optim=f"hf_eff_{name}", fsdp="full_shard", fsdp_config={"version": 2},
                                 per_device_train_batch_size=2, max_steps=RESUME_STEPS, learning_rate=1e-2,
                                 weight_decay=0.01, lr_scheduler_type="linear", save_strategy="steps",
                                 save_steps=RESUME_AT, report_to=[], use_cpu=True, max_grad_norm=1.0, seed=3,
                                 disable_tqdm=True)
        _ = args.device  # TrainingArguments sets up its process state first (and resets accelerate's): mark it after
        _as_fsdp_capable()
        model = Model().to(torch.bfloat16) if name == "adamw_bf16" else Model()
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train(resume_from_checkpoint=resume)
        inner = unwrap(trainer.optimizer, until="state")
        dtypes = sorted({str(v.dtype) for st in inner.state.values() for k, v in st.items() if k != "step"})
        return [full(p).float() for p in trainer.model.parameters()], dtypes

    out = {}
    for name in names:
        first = os.path.join(tmp, name, "first")
        want, _ = run(name, first)
        got, dtypes = run(name, os.path.join(tmp, name, "resumed"), os.path.join(first, f"checkpoint-{RESUME_AT}"))
        out[name] = {"max_diff": max(float((a - b).abs().max()) for a, b in zip(got, want)), "dtypes": dtypes}
    return out


def test_trainer_fsdp2_checkpoints_resume_exactly(tmp_path):
    """Every name that steps shards: a Trainer checkpoint saved under FSDP2 (accelerate's DCP path) resumes in a new
    Trainer to the uninterrupted run's weights exactly (same mesh, same data order: nothing is re-quantized)."""
    ranks = run_ranks(_trainer_resume_runs, 2, LOOPS, str(tmp_path))
    for r in ranks:
        assert set(r) == set(LOOPS)
        for name, got in r.items():
            assert got["max_diff"] == 0.0, (name, got)
            if name in RUN_8BIT:  # 8-bit state was saved and resumed as 8-bit
                assert "torch.uint8" in got["dtypes"], (name, got)


class _BlocksAndEmbedding(_Blocks):
    """:class:`_Blocks` and an embedding whose rows are whole blocks: kept 32-bit by policy (embedding_state=32bit)
    where the shape alone would give it 8-bit state."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(300, 256)

    def loss(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(1)
        layers = [m for m in self.children() if m is not self.emb]
        return (sum(m(torch.randn(2, m.weight.shape[-1], generator=g)).square().mean() for m in layers)
                + self.emb(torch.arange(4)).square().mean())


def _eligibility(names: list[str]) -> dict:
    """Per name, for every parameter of :class:`_BlocksAndEmbedding` in order: (the estimator's 8-bit decision on
    this rank's shape records, whether the optimizer's state is 8-bit after a step), one process (no process group)
    or FSDP2 on every rank of the group. The estimator reads the model as the user hands it (sharded: its mesh)."""
    import torch.distributed as dist

    from hf_efficient.backends import _torch_keeps_8bit_shape
    from hf_efficient.memory import _state_view, describe_params

    out = {}
    for name in names:
        model = shard(_BlocksAndEmbedding()) if dist.is_initialized() else _BlocksAndEmbedding()
        described = describe_params(model)
        options = estimate_memory(model, name).options
        records = _state_view([t for t in described.tensors if t.trainable], described.world_size, described.sharding)
        opt = create_optimizer(model, name, lr=1e-2)
        model.loss().backward()
        opt.step()
        inner = unwrap(opt, until="state")
        stepped = [inner.state[p]["exp_avg"].dtype == torch.uint8 for p in model.parameters()]
        codec = get_spec(name).facts.codec
        out[name] = [(_torch_keeps_8bit_shape(t, options, codec), s) for t, s in zip(records, stepped, strict=True)]
    return out


def test_estimator_and_optimizer_agree_on_which_tensors_keep_8bit_state():
    """One rule (optim.facts.keeps_quantized_state) decides both: every tensor alike in one process, on a 1-rank FSDP2 mesh
    and on 2 FSDP2 ranks, and the cases differ between plain and sharded (the norm and the 40 x 300 matrix: 8-bit
    whole, fp32 sharded, whatever the mesh size)."""
    one = _eligibility(RUN_8BIT)
    mesh1 = run_ranks(_eligibility, 1, RUN_8BIT)
    two = run_ranks(_eligibility, 2, RUN_8BIT)
    for name in RUN_8BIT:
        for decisions in (one[name], mesh1[0][name], two[0][name], two[1][name]):
            assert [e for e, _ in decisions] == [s for _, s in decisions], (name, decisions)
        assert [s for _, s in one[name]] != [s for _, s in two[0][name]]
        assert [s for _, s in mesh1[0][name]] == [s for _, s in two[0][name]]
        assert {s for _, s in two[0][name]} == {True, False}
