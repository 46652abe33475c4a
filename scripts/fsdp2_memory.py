"""Per-rank optimizer state under FSDP2 at 1, 2 and 4 ranks, predicted and measured, and resumes across mesh sizes.

    python scripts/fsdp2_memory.py                   # every name that steps FSDP2 shards, ~2 min on 2 cores
    python scripts/fsdp2_memory.py --out /tmp/fsdp2  # elsewhere than docs/results

Writes ``fsdp2_memory.json`` into ``--out`` (default ``docs/results``), then renders ``fsdp2_memory.md`` from it
(``python scripts/render_results.py docs/results/fsdp2_memory.json`` renders it again).

Model: a randomly initialised, untied ``LlamaForCausalLM`` from :data:`LLAMA` (nothing downloaded), in fp32 (bf16 for
``hf_eff_adamw_bf16``, which steps bf16 weights). Ranks: gloo processes on this CPU, each ``fully_shard``-ing every
decoder layer, then the model (1 rank: the same on a 1-rank mesh). Every rank trains on the same batch.

Memory: one step, then :func:`hf_efficient.optimizer_state_bytes` on every rank (its local shards); the page gives
the largest rank's (rank 0: ``torch.chunk`` gives it the most rows) beside ``estimate_memory(model, name,
world_size=N, sharding="fsdp2")`` of the unsharded model, and whether the two agree byte for byte.

Resume: on 2 ranks, :data:`STEPS` steps, model and optimizer saved through DCP (``get_model_state_dict`` /
``get_optimizer_state_dict``, ``dcp.save``) after :data:`SAVE_AT`; then 1, 2 and 4 ranks build the model afresh, load
that checkpoint (DCP reshards it), and train the remaining steps. The page gives the max |difference| of any weight
from the uninterrupted 2-rank run.
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import render_results  # noqa: E402
from _bench_common import RESULTS, command_line, machine  # noqa: E402

import torch  # noqa: E402

# Llama's shapes (untied, SwiGLU MLP) small enough for a few gloo processes on a CPU: every matrix row is whole blocks
# of 256, so the 8-bit names keep the same 8-bit state at every mesh size
LLAMA = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": False}
WORLDS = (1, 2, 4)
STEPS, SAVE_AT = 3, 1
LR, WD = 1e-3, 0.01
BATCH, SEQ = 4, 32


def shardable() -> list[str]:
    """The names whose CPU backend steps FSDP2 shards, from the registry (``hf_eff_auto`` picks one of them)."""
    from hf_efficient.registry import SPECS, resolve

    return sorted(s.name for s in SPECS.values() if s.backends and s.name not in ("paged_adam8bit", "auto")
                  and resolve(s.name, "cpu", log=False).implementation.fsdp2 is None)


def _model(name: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    return model.to(torch.bfloat16) if name == "adamw_bf16" else model


def _shard(model):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _batch() -> torch.Tensor:
    return torch.randint(0, LLAMA["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _train(model, optimizer, steps: int) -> None:
    ids = _batch()
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _weights(model) -> dict[str, torch.Tensor] | None:
    """Every weight whole, in fp32, on rank 0 (a collective: every rank gathers them); None on the others."""
    import torch.distributed as dist

    whole = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
             for n, p in model.named_parameters()}
    return whole if dist.get_rank() == 0 else None


def _dcp_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}


def _fresh(name: str):
    import hf_efficient

    model = _shard(_model(name))
    return model, hf_efficient.create_optimizer(model, name, lr=LR, weight_decay=WD)


def memory(name: str) -> dict:
    """This rank's measured state bytes after one step, and the prediction for one of this mesh's ranks."""
    import torch.distributed as dist

    import hf_efficient

    world = dist.get_world_size()
    predicted = hf_efficient.estimate_memory(_model(name), name, world_size=world,
                                             sharding="fsdp2" if world > 1 else None).state_bytes
    model, optimizer = _fresh(name)
    _train(model, optimizer, 1)
    return {"measured": hf_efficient.optimizer_state_bytes(optimizer), "predicted": predicted}


def saved_run(name: str, checkpoint: str) -> dict[str, torch.Tensor]:
    """Train on this mesh, saving through DCP after SAVE_AT steps; the final weights."""
    import torch.distributed.checkpoint as dcp

    model, optimizer = _fresh(name)
    _train(model, optimizer, SAVE_AT)
    dcp.save(_dcp_state(model, optimizer), checkpoint_id=checkpoint)
    _train(model, optimizer, STEPS - SAVE_AT)
    return _weights(model)


def resumed_run(name: str, checkpoint: str) -> dict[str, torch.Tensor]:
    """Build afresh on this mesh, load the checkpoint (resharded by DCP), train the remaining steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model, optimizer = _fresh(name)
    sd = _dcp_state(model, optimizer)
    dcp.load(sd, checkpoint_id=checkpoint)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, optimizer, sd["optim"])
    _train(model, optimizer, STEPS - SAVE_AT)
    return _weights(model)


def rank_work(names: list[str], checkpoints: dict[str, str], save: bool) -> dict:
    """What one rank measures for every name: state bytes; the 2-rank run saves, every mesh resumes."""
    out = {}
    for name in names:
        out[name] = {"memory": memory(name)}
        if save:
            out[name]["uninterrupted"] = saved_run(name, checkpoints[name])
        out[name]["resumed"] = resumed_run(name, checkpoints[name])
    return out


# ---------------------------------------------------------------------------------------------- processes

def _entry(rank: int, world: int, port: int, out_dir: str, args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = ("ok", rank_work(*args))
    except BaseException:  # noqa: BLE001 - reported by the parent, with the rank
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


def on_ranks(world: int, *args) -> list[dict]:
    """:func:`rank_work` on ``world`` gloo processes; each rank's result, in rank order."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_entry, (world, port, out_dir, args), nprocs=world, start_method="spawn")
        results = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise SystemExit(f"rank {rank} of {world} raised:\n{value}")
            results.append(value)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS, help="where fsdp2_memory.json and .md go")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    names = shardable()
    rows, resumes = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoints = {n: os.path.join(tmp, n) for n in names}
        by_world = {2: on_ranks(2, names, checkpoints, True)}  # first: it writes the checkpoints
        by_world.update({w: on_ranks(w, names, checkpoints, False) for w in WORLDS if w != 2})
    for name in names:
        base = by_world[2][0][name]["uninterrupted"]
        for world in WORLDS:
            ranks = [r[name]["memory"] for r in by_world[world]]
            rows.append({"name": f"hf_eff_{name}", "world_size": world, "predicted": ranks[0]["predicted"],
                         "measured": [r["measured"] for r in ranks]})
            got = by_world[world][0][name]["resumed"]
            resumes.setdefault(f"hf_eff_{name}", {})[f"2->{world}"] = max(
                (got[k] - base[k]).abs().max().item() for k in base)
    num_params = sum(p.numel() for p in _model("adamw").parameters())
    doc = {"command": command_line(__file__, argv if argv is not None else sys.argv[1:]), "machine": machine(),
           "model": dict(LLAMA, num_params=num_params), "steps": STEPS, "save_at": SAVE_AT, "lr": LR,
           "weight_decay": WD, "batch": [BATCH, SEQ], "memory": rows, "resume_max_abs_diff": resumes}
    print(render_results.write(args.out, "fsdp2_memory", doc))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf_efficient from this checkout
    main()
