"""A multi-process harness for FSDP2 tests on CPU: N gloo processes on 127.0.0.1, a function run on each, its
results back in the test process; plus the sharding every FSDP2 test does the same way.

``run_ranks(fn, n, *args)`` spawns ``n`` processes (one thread each: the CI machine has few cores), each calls
``fn(*args)`` with the default process group up, and returns the list of what each rank returned. A rank that
raises fails the test with its traceback; a hung collective ends the ranks after :data:`WATCHDOG_S` with their
stacks, instead of hanging the suite; a rank that dies (a signal) fails it with the end of that rank's own output.

The ranks meet through a file store in the run's own folder, not a TCP port: a port picked free here can be taken
by another test worker's process before rank 0 binds it. The test judges what the ranks returned, written before
the process group is torn down: a rank that a signal ends after every rank wrote its result (gloo can abort a
process whose peer closed a connection first) is reported as a warning with its output, not as a failure.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
import warnings

import torch
import torch.multiprocessing as mp

WATCHDOG_S = 120


def _entry(rank: int, world: int, out_dir: str, fn, args) -> None:
    import faulthandler

    import torch.distributed as dist

    log = open(os.path.join(out_dir, f"rank{rank}.log"), "wb", buffering=0)  # C++ aborts and watchdog stacks too
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    _register_example_family()
    store = os.path.join(out_dir, "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - sent to the test process whole
        result = ("error", traceback.format_exc())
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    with open(path + ".part", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".part", path)  # whole or absent: a rank killed while writing leaves no result
    # every rank past its last collective before any tears its connections down: gloo ends a rank whose peer
    # closed a pair it still polls with std::terminate (SIGABRT), which lost the results of a passing run
    dist.barrier()
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


def _register_example_family() -> None:
    """docs/contributing.md's example family (tests/example_family.py) in this rank's registry: the FSDP2 tests run
    it beside the package's names (tests/cases.py's ``shardable``); a rank is a test process, not a user's."""
    from example_family import SPEC

    from hf_efficient import registry

    registry.SPECS.setdefault(SPEC.name, SPEC)


def run_ranks(fn, world: int, *args) -> list:
    """``fn(*args)`` on ``world`` gloo processes; each rank's return value (picklable), in rank order."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the children's, at their start; put back for later tests' own
    try:  # subprocesses (a run compared with one made in this process must get its thread count)
        with tempfile.TemporaryDirectory() as out_dir:
            try:
                mp.start_processes(_entry, (world, out_dir, fn, args), nprocs=world, start_method="spawn")
            except mp.ProcessExitedException as e:  # a signal or an exit code, not a Python exception
                written = all(os.path.exists(os.path.join(out_dir, f"rank{r}.pkl")) for r in range(world))
                assert written, f"{e}; the ranks' output:\n{_logs(out_dir, world)}"
                warnings.warn(f"every rank wrote its result, then {e} (teardown); the ranks' output:\n"
                              f"{_logs(out_dir, world)}", RuntimeWarning, stacklevel=2)
            return _results(out_dir, world)
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)


def _logs(out_dir: str, world: int, tail: int = 4000) -> str:
    parts = []
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.log")
        text = open(path, errors="replace").read()[-tail:] if os.path.exists(path) else "(no output file)"
        parts.append(f"--- rank {rank} ---\n{text}")
    return "\n".join(parts)


def _results(out_dir: str, world: int) -> list:
    results = []
    for rank in range(world):
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
            status, value = pickle.load(f)
        assert status == "ok", f"rank {rank} of {world} raised:\n{value}\n{_logs(out_dir, world)}"
        results.append(value)
    return results


def shard(model: torch.nn.Module, mesh_shape: tuple[int, ...] | None = None) -> torch.nn.Module:
    """FSDP2 as users apply it: ``fully_shard`` on each child module that has parameters, then on the model, over a
    CPU mesh of all ranks (``mesh_shape``: another shape, e.g. ``(1, 2)`` for HSDP)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh_shape = mesh_shape or (dist.get_world_size(),)
    names = ("replicate", "shard")[-len(mesh_shape):]  # HSDP's 2-D mesh must name its dims
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full(t) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every rank calls it), a plain tensor as it is; detached."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
