"""Two CPU processes under ``accelerate launch`` (gloo, DDP): exact accumulation across
processes, every optimizer training in step on both ranks, and the LR schedule independent of process count.

The test launches this file; run as a script, it is the worker and writes what it saw to ``rank{N}.json``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
from cases import names, packaged, plain

HERE = os.path.dirname(os.path.abspath(__file__))
WATCHDOG_S = 60  # a hung collective ends the worker (with tracebacks) instead of the 600 s launch timeout
OPTIMIZERS = plain(names(packaged))  # every name of the package (the workers are other processes: not the example)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    # `accelerate launch --cpu --num_processes 2` starts ONE process unless MPI is set up (accelerate 1.x's simple
    # launcher); the torchrun-based launcher with ACCELERATE_USE_CPU gives two gloo processes on any machine.
    from conftest import launch_two_processes  # here: this file is also the workers' script

    launch_two_processes("--multi_gpu", __file__, str(out), env={"ACCELERATE_USE_CPU": "true"})
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_accumulation_across_two_processes_equals_big_batch(ranks):
    for r in ranks:
        assert r["exact_vs_big_batch"] < 1e-5, r
        assert r["naive_vs_big_batch"] > 1e-2, r  # mean of per-micro-batch means: visibly wrong
        assert r["window_num_items"] == r["big_batch_targets"] > r["local_targets"]  # counted on both ranks


def test_every_optimizer_ends_identical_on_both_ranks(ranks):
    a, b = ranks
    for name in a["trained"]:
        ra, rb = a["trained"][name], b["trained"][name]
        if "skipped" in ra:
            continue
        assert ra["sha256"] == rb["sha256"], f"{name}: ranks ended with different parameters"
        assert ra["changed"], f"{name}: parameters did not move"
    assert {"adamw", "adam8bit", "adafactor"} <= {n for n in a["trained"] if "skipped" not in a["trained"][n]}


def test_two_process_training_matches_one_process_big_batch(ranks):
    # hf_eff_adamw, 2 ranks x 2 micro-batches per step == 1 process stepping on the merged batch
    for r in ranks:
        assert r["trained"]["adamw"]["vs_single_process"] < 1e-5, r["trained"]["adamw"]


def test_learning_rate_after_k_steps_does_not_depend_on_process_count(ranks):
    for r in ranks:
        for name, t in r["trained"].items():
            if "skipped" not in t:
                assert t["lrs"] == pytest.approx([1e-2, 5e-3, 0.0], abs=1e-12), name


def test_fsdp2_rank_without_gradients_does_not_hang(ranks):
    """Under FSDP2 a rank holding no gradient enters the step's collectives too (reaching here at all means neither
    rank hung), and a step of some ranks' shards only is refused on every rank, naming the tensor, with nothing
    stepped: stepping the rank with gradients alone would make the ranks' shards of one model diverge."""
    for rank in ranks:
        for mode in ("raise", "skip"):
            seen = rank["fsdp2_rank_without_grads"][mode]
            assert seen["refused"] and "'0.weight'" in seen["refused"] and "1 of the 2 ranks" in seen["refused"], seen
            assert not any(seen["changed"]), seen


def test_fsdp2_support_table_matches_what_runs(ranks):
    """The refusal table in integrations/distributed.py against torch's FSDP2 on CPU: a combination runs on
    DTensor shards exactly when the table allows it (and 8-bit state keeps embeddings in full precision)."""
    from hf_efficient.integrations.distributed import FSDP2_UNSUPPORTED

    probe = ranks[0]["fsdp2"]
    assert {"adamw/torch", "adam8bit/bnb", "adafactor/torch"} <= set(probe)
    for key, seen in probe.items():
        if "skipped" in seen:
            continue
        allowed = tuple(key.split("/")) not in FSDP2_UNSUPPORTED
        assert seen["ok"] == allowed, f"{key}: table says {'supported' if allowed else 'unsupported'}, saw {seen}"
        if seen["ok"]:
            assert seen["dtensor"] == "DTensor"
    # torchao runs on shards (so it stays forcible), but is never chosen automatically: see
    # test_accelerate.py::test_fsdp2_never_falls_back_to_torchao_and_says_why
    if importlib.util.find_spec("torchao") is None:  # its own extra: the worker probes what is installed
        assert "adam8bit/torchao" not in probe
        return
    # 8-bit state for a matrix whose shard has 4096 elements (torchao decides per local shard), full precision
    # for embeddings: the 32-bit choice followed the parameter swap
    assert probe["adam8bit/torchao"]["matrix_state"] == "OptimState8bit"
    assert probe["adam8bit/torchao"]["embedding_state"] == "Tensor"


# ------------------------------------------------------------------------------------------- worker

def worker(out_dir: str) -> None:
    import hashlib

    import torch
    import torch.nn.functional as F
    from accelerate.utils import gather_object

    sys.path.insert(0, HERE)
    import hf_efficient
    from hf_efficient.integrations.accelerate import EfficientOptimPlugin, accumulation_windows, summed_token_loss
    from helpers import (IGNORE, accumulated_grads, logits_of, max_rel_diff, merge, reference_grads, tiny_mlm,
                         variable_batches)

    accelerator = EfficientOptimPlugin(gradient_accumulation_steps=2).create_accelerator()
    rank = accelerator.process_index
    assert accelerator.num_processes == 2 and accelerator.distributed_type.value == "MULTI_CPU"
    result = {"rank": rank}

    # 1. one window: 4 micro-batches of 2 sequences, 2 per rank, vs the batch of 8 in one process
    batches = variable_batches(n_batches=4, per_batch=2)
    mine = batches[2 * rank: 2 * rank + 2]
    ref = reference_grads(merge(batches))
    model = accelerator.prepare(tiny_mlm())
    result["exact_vs_big_batch"] = max_rel_diff(accumulated_grads(accelerator, model, mine), ref)
    result["window_num_items"] = next(iter(accumulation_windows(accelerator, mine))).num_items
    accelerator.step = 0
    model.zero_grad(set_to_none=True)
    result["naive_vs_big_batch"] = max_rel_diff(accumulated_grads(accelerator, model, mine, naive=True), ref)
    result["big_batch_targets"] = sum(int((b["labels"] != IGNORE).sum()) for b in batches)
    result["local_targets"] = sum(int((b["labels"] != IGNORE).sum()) for b in mine)

    # 2. three optimizer steps with each optimizer; each rank has its own micro-batches
    result["trained"] = {}
    steps = [variable_batches(n_batches=4, per_batch=2, seed=10 + s) for s in range(3)]
    for name in OPTIMIZERS:
        spec = hf_efficient.registry.get_spec(name)
        try:
            hf_efficient.resolve(name, "cpu").optimizer_cls
        except (ImportError, RuntimeError) as e:
            result["trained"][name] = {"skipped": str(e)}
            continue
        dtype = spec.facts.param_dtype
        plugin = EfficientOptimPlugin(optim=name, lr=1e-2, weight_decay=0.01, warmup_steps=1,
                                      gradient_accumulation_steps=2)
        start = tiny_mlm(0, dtype=dtype)
        model, optimizer, scheduler = plugin.prepare(accelerator, tiny_mlm(0, dtype=dtype), num_training_steps=3)
        lrs = []
        for step_batches in steps:
            for window in accumulation_windows(accelerator, step_batches[2 * rank: 2 * rank + 2]):
                for batch in window:
                    with accelerator.accumulate(model):
                        accelerator.backward(window.scale(summed_token_loss(logits_of(model, batch), batch["labels"])))
                        optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad()
            lrs.append(scheduler.get_last_lr()[0])
        final = accelerator.unwrap_model(model)
        digest = hashlib.sha256()
        for n, p in sorted(final.named_parameters()):
            digest.update(p.detach().float().numpy().tobytes())
        entry = {"sha256": digest.hexdigest(), "lrs": lrs,
                 "changed": any(not torch.equal(p, q) for p, q in zip(start.parameters(), final.parameters()))}
        if name == "adamw":  # the same three steps in one process, on the merged batches
            single = tiny_mlm(0)
            opt = hf_efficient.create_optimizer(single, "adamw", lr=1e-2, weight_decay=0.01)
            for k, step_batches in enumerate(steps):
                for g in opt.param_groups:
                    g["lr"] = 1e-2 * [0.0, 1.0, 0.5][k]  # linear, 1 warm-up step of 3: lr used by steps 1..3
                big = merge(step_batches)
                F.cross_entropy(logits_of(single, big).flatten(0, 1), big["labels"].flatten(),
                                ignore_index=IGNORE).backward()
                opt.step()
                opt.zero_grad()
            # Attention key biases are left out: their exact gradient is 0 (softmax ignores a per-query constant),
            # so Adam turns rounding noise into lr-sized steps of either sign; every other tensor must agree.
            mine_p = dict(final.named_parameters())
            compared = [n for n, _ in single.named_parameters() if not n.endswith("attention.self.key.bias")]
            entry["vs_single_process"] = max_rel_diff({n: mine_p[n].detach() for n in compared},
                                                      {n: dict(single.named_parameters())[n].detach() for n in compared})
        result["trained"][name] = entry
    result["fsdp2"] = fsdp2_probe()
    result["fsdp2_rank_without_grads"] = fsdp2_rank_without_grads()
    gather_object([0])  # both ranks done before either writes
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    accelerator.end_training()


def fsdp2_probe() -> dict:
    """Each optimizer/backend on torch's FSDP2 (``fully_shard``) DTensor parameters over the 2 gloo ranks, built
    before sharding and switched after it, as accelerate's FSDP2 preparation does. Records what ran."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hf_efficient
    from hf_efficient.integrations.accelerate import EfficientOptimPlugin, summed_token_loss
    from hf_efficient.integrations.accelerator_checks import fp32_state_flags, restore_fp32_state_ids
    from helpers import logits_of, tiny_mlm, variable_batches

    mesh = init_device_mesh("cpu", (2,))
    batch = variable_batches(n_batches=1, per_batch=2)[0]
    out = {}
    for spec in hf_efficient.registry.SPECS.values():
        for backend in spec.backends.values():
            if backend.why_not("cpu") is not None or (spec.fallback and spec.fallback[0] != "cpu"):
                continue
            key = f"{spec.name}/{backend.name}"
            try:
                backend.build.optimizer_cls()
            except ImportError as e:
                out[key] = {"skipped": str(e)}
                continue
            dtype = spec.facts.param_dtype
            model = tiny_mlm(0, dtype=dtype, intermediate=128)  # a 128x64 matrix: 4096-element shards
            optimizer = EfficientOptimPlugin(optim=spec.name, backend=backend.name, lr=1e-3).create_optimizer(model)
            name_of = {id(p): n for n, p in model.named_parameters()}
            flags = fp32_state_flags(optimizer)
            fully_shard(model, mesh=mesh)
            new = dict(model.named_parameters())
            for g in optimizer.param_groups:
                g["params"] = [new[name_of[id(p)]] for p in g["params"]]
            restore_fp32_state_ids(optimizer, flags)
            try:
                for _ in range(2):
                    summed_token_loss(logits_of(model, batch), batch["labels"]).backward()
                    optimizer.step()
                    optimizer.zero_grad()
                def state_type(name):
                    st = optimizer.state[new[name]].get("exp_avg")
                    return None if st is None else type(st.to_local()).__name__

                out[key] = {"ok": True, "embedding_state": state_type("bert.embeddings.word_embeddings.weight"),
                            "matrix_state": state_type("bert.encoder.layer.0.intermediate.dense.weight"),
                            "dtensor": type(new["cls.predictions.bias"]).__name__}
            except Exception as e:  # what fails is the finding
                out[key] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
    return out


def fsdp2_rank_without_grads() -> dict:
    """One FSDP2 step where rank 1 holds no gradient at all: both ranks must enter the step's collectives (a rank
    that returned early left the other waiting forever) and refuse it. A watchdog ends a hang in 60 s."""
    import faulthandler

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hf_efficient

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    out = {}
    for nonfinite in ("raise", "skip"):
        optimizer = hf_efficient.create_optimizer(model, "adamw", lr=0.1, nonfinite=nonfinite)
        before = [p.to_local().clone() for p in model.parameters()]
        if dist.get_rank() == 0:  # set by hand: a backward would itself be a collective
            for p in model.parameters():
                p.grad = torch.ones_like(p)
        faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
        try:
            optimizer.step()
            refused = None
        except ValueError as e:
            refused = str(e)
        faulthandler.cancel_dump_traceback_later()
        out[nonfinite] = {"refused": refused,
                          "changed": [not torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters())]}
        model.zero_grad(set_to_none=True)
    return out


if __name__ == "__main__":
    worker(sys.argv[1])
