"""Sharded checkpoints (torch.distributed.checkpoint, DCP) and whole states loaded into FSDP2 shards give the verdicts
of single-file loads in one process (issue 30, items 10, 11, 14, 15 and 16), on 2 gloo ranks.

DCP's ``dcp.load`` reads a checkpoint into the loading optimizer's own state dict (its keys and dtypes). Loaded that
way, a state saved under other 8-bit settings is refused instead of its codes being cast into fp32 moments, a state
of another family is refused by the tag the param groups carry, and the step counts survive. Loaded with
``hf_efficient.checkpoint.LoadPlanner``, which reads what the checkpoint holds, and a whole state loaded by the
optimizer's own ``load_state_dict`` (which shards it; torch's full-state loader fails on group keys only the saved
state has), the state converts to exactly what one process loads from the same state (the same tensors, bit for
bit, and the same warning), or is refused with the same message. A gradient on some ranks only is refused before
anything steps.

One launch of 2 ranks runs every case; the single-process loads it is compared with run in the test process.
"""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
from torch import nn

import hf_efficient
from fsdp_helpers import full, run_ranks, shard

OPTS = dict(lr=1e-2, weight_decay=0.01, nonfinite="skip")
EIGHT = dict(OPTS, min_8bit_size=1024)  # w (4 rows of 2 blocks) keeps 8-bit state, v (10) fp32
FP32 = dict(OPTS, min_8bit_size=10**6)  # every tensor fp32
# each saved run: (name, options)
SAVES = {"adam8bit": ("adam8bit", EIGHT), "adam8bit_fp32": ("adam8bit", FP32), "adamw": ("adamw", OPTS),
         "lion8bit": ("lion8bit", EIGHT), "adafactor": ("adafactor", OPTS), "adamw_bf16": ("adamw_bf16", OPTS)}
LOADS = {  # case: (loader, options, what it loads, the ways it is loaded: see load_one)
    "8bit_into_fp32": ("adam8bit", FP32, "adam8bit", ("dcp", "planner", "whole", "full")),  # item 10: dequantized
    "fp32_into_8bit": ("adam8bit", EIGHT, "adam8bit_fp32", ("planner", "whole", "full")),  # item 15: quantized
    # item 15: another family of AdamW's math (torch's full-state loader fails on AdamW's amsgrad: a torch KeyError)
    "adamw_into_8bit": ("adam8bit", EIGHT, "adamw", ("planner", "whole")),
    "adam8bit_into_lion": ("lion8bit", EIGHT, "adam8bit", ("dcp", "planner", "whole")),  # item 11: refused
    "lion_into_adam8bit": ("adam8bit", EIGHT, "lion8bit", ("planner", "whole")),  # refused
    "adafactor_into_adamw": ("adamw", OPTS, "adafactor", ("planner", "whole")),  # refused
    "adafactor": ("adafactor", OPTS, "adafactor", ("planner", "whole", "full")),  # column statistics replicated
}
CONVERTED = ("8bit_into_fp32", "fp32_into_8bit", "adamw_into_8bit", "adafactor")
REFUSED = ("adam8bit_into_lion", "lion_into_adam8bit", "adafactor_into_adamw")
INF_AT = 1  # the step of a non-finite gradient: each saved run has taken 2 steps and skipped 1


def make_model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(4, 512))  # rows of whole 256-element blocks: 8-bit on any mesh
    model.v = nn.Parameter(torch.randn(10))
    return model.to(dtype)


def set_grads(model, step: int) -> None:
    """The same whole gradient on every rank, sharded like its parameter under FSDP2 (a non-finite one at INF_AT)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(step)
    for n, p in model.named_parameters():
        grad = torch.randn(p.shape, generator=g).to(p.dtype)
        if step == INF_AT:
            grad[0] = float("inf")
        p.grad = distribute_tensor(grad, p.device_mesh, [Shard(0)]) if hasattr(p, "device_mesh") else grad


def steps(model, optimizer, first: int, count: int) -> None:
    for step in range(first, first + count):
        set_grads(model, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def build(name: str, options: dict, sharded: bool):
    model = make_model(torch.bfloat16 if name == "adamw_bf16" else torch.float32)
    if sharded:
        shard(model)
    return model, hf_efficient.create_optimizer(model, name, **options)


def counts(optimizer) -> tuple[int, int]:
    info = hf_efficient.optimizer_info(optimizer)
    return info.steps, info.skipped_steps


def by_name(state: dict, groups: list) -> dict:
    """Per-parameter state by name, whole tensors (absmaxes flat: FSDP2 keeps them by rows, one process by blocks)."""
    ids = {pid: n for g in groups for pid, n in zip(g["params"], g.get("param_names", g["params"]))}
    return {ids[pid]: {k: (full(v) if torch.is_tensor(v) else torch.tensor(v)).reshape(-1) for k, v in st.items()}
            for pid, st in state.items()}


class Logged:
    """The package's warnings while in the block."""

    def __enter__(self):
        self.text = io.StringIO()
        self.handler = logging.StreamHandler(self.text)
        logging.getLogger("hf_efficient").addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        logging.getLogger("hf_efficient").removeHandler(self.handler)


# ------------------------------------------------------------------------------------------- rank workers


def save_all(base: str) -> dict:
    """Each saved run: 3 steps (one skipped), its optimizer saved by dcp.save and taken whole (the single-file state);
    and its counts after a default-planner DCP load and a full-state load into the same settings (item 14)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    out = {}
    whole_sd = StateDictOptions(full_state_dict=True)
    for key, (name, options) in SAVES.items():
        model, optimizer = build(name, options, sharded=True)
        steps(model, optimizer, 0, 3)
        dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=f"{base}/{key}")
        whole = copy.deepcopy(get_optimizer_state_dict(model, optimizer, options=whole_sd))
        model, resumed = build(name, options, sharded=True)
        sd = {"optim": get_optimizer_state_dict(model, resumed)}
        dcp.load(sd, checkpoint_id=f"{base}/{key}")
        set_optimizer_state_dict(model, resumed, sd["optim"])
        model, from_whole = build(name, options, sharded=True)
        set_optimizer_state_dict(model, from_whole, copy.deepcopy(whole), options=whole_sd)
        out[key] = {"whole": whole, "saved": counts(optimizer), "dcp": counts(resumed), "full": counts(from_whole)}
    return out


def load_one(base: str, case: str, how: str, whole: dict) -> dict:
    """LOADS[case], ``how``: through dcp.load with DCP's own planner ("dcp") or the package's ("planner"), then
    set_optimizer_state_dict; the whole (single-file) state through the optimizer's own load_state_dict ("whole") or
    torch's full-state loader ("full"). The error, or the warnings, the whole state loaded, and the weights and counts
    after a step. (Whether a refused DCP load left the state alone is not asked: dcp.load writes into the tensors of
    the state dict it fills, which torch's optimizer state shares.)"""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    name, options, source, _ = LOADS[case]
    whole_sd = StateDictOptions(full_state_dict=True)
    model, optimizer = build(name, options, sharded=True)
    steps(model, optimizer, 5, 1)
    with Logged() as logged:
        try:
            if how in ("dcp", "planner"):
                sd = {"optim": get_optimizer_state_dict(model, optimizer)}
                dcp.load(sd, checkpoint_id=f"{base}/{source}",
                         planner=hf_efficient.checkpoint.LoadPlanner() if how == "planner" else None)
                set_optimizer_state_dict(model, optimizer, sd["optim"])
            elif how == "whole":
                optimizer.load_state_dict(copy.deepcopy(whole))
            else:
                set_optimizer_state_dict(model, optimizer, copy.deepcopy(whole), options=whole_sd)
        except ValueError as e:
            return {"error": str(e)}
    loaded = get_optimizer_state_dict(model, optimizer, options=whole_sd)
    loaded = by_name(loaded["state"], loaded["param_groups"])
    steps(model, optimizer, 6, 1)
    return {"log": logged.text.getvalue(), "state": loaded, "counts": counts(optimizer),
            "params": {n: full(p) for n, p in model.named_parameters()}}


def grad_on_one_rank(name: str) -> dict:
    """Item 16: a gradient set on rank 0 only: refused on both ranks, before anything changed."""
    import torch.distributed as dist

    model, optimizer = build(name, OPTS, sharded=True)
    steps(model, optimizer, 5, 1)
    before = {n: full(p) for n, p in model.named_parameters()}
    set_grads(model, 6)
    if dist.get_rank() == 1:
        model.w.grad = None
    try:
        optimizer.step()
        error = None
    except ValueError as e:
        error = str(e)
    return {"error": error, "unchanged": all(torch.equal(full(p), before[n]) for n, p in model.named_parameters()),
            "counts": counts(optimizer)}


def two_ranks(base: str) -> dict:
    out = {"saved": save_all(base)}
    for case, (*_, source, ways) in LOADS.items():
        out[case] = {how: load_one(base, case, how, out["saved"][source]["whole"]) for how in ways}
    out["grad_on_one_rank"] = {name: grad_on_one_rank(name) for name in ("adamw", "adam8bit", "adafactor")}
    return out


# ------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(two_ranks, 2, str(tmp_path_factory.mktemp("dcp")))


def single_file(ranks, case: str) -> dict:
    """LOADS[case] in one process through the ordinary load_state_dict of the whole state: the verdict the sharded
    loads must give."""
    name, options, source, _ = LOADS[case]
    model, optimizer = build(name, options, sharded=False)
    steps(model, optimizer, 5, 1)
    with Logged() as logged:
        try:
            optimizer.load_state_dict(copy.deepcopy(ranks[0]["saved"][source]["whole"]))
        except ValueError as e:
            return {"error": str(e)}
    sd = optimizer.state_dict()
    return {"log": logged.text.getvalue(), "state": by_name(sd["state"], sd["param_groups"])}


@pytest.mark.parametrize("key", SAVES)
def test_step_counts_survive_sharded_and_whole_round_trips(ranks, key):
    for r in ranks:
        saved = r["saved"][key]
        assert saved["saved"] == (2, 1)
        assert saved["dcp"] == saved["full"] == (2, 1), saved


@pytest.mark.parametrize("case", CONVERTED)
def test_sharded_loads_convert_as_the_single_file_load_does(ranks, case):
    """DCP through the package's planner, and a whole state through the optimizer's own load_state_dict: the tensors
    one process loads from the same state, bit for bit, with the same warning."""
    expected = single_file(ranks, case)
    assert ("converted" in expected["log"]) == (case != "adafactor"), expected["log"]
    for r in ranks:
        for how in ("planner", "whole"):
            got = r[case][how]
            assert "error" not in got, (how, got["error"])
            assert got["log"] == expected["log"], how
            assert got["state"].keys() == expected["state"].keys(), how
            for n, st in expected["state"].items():
                assert got["state"][n].keys() == st.keys(), (how, n)
                for k, v in st.items():
                    assert torch.equal(got["state"][n][k], v), (how, n, k)
            assert got["counts"] == (3, 1), how  # the saved (2, 1), and the step after the load


@pytest.mark.parametrize("case", [c for c in CONVERTED if "full" in LOADS[c][3]])
def test_a_whole_state_loads_into_shards_as_torch_s_full_state_loader_loads_it(ranks, case):
    for r in ranks:
        got, full_loader = r[case]["whole"], r[case]["full"]
        assert got["log"] == full_loader["log"]
        for n, p in full_loader["params"].items():
            assert torch.equal(got["params"][n], p), n


def test_8bit_codes_read_into_fp32_state_are_refused_by_dcp_s_planner(ranks):
    for r in ranks:
        got = r["8bit_into_fp32"]["dcp"]
        assert "error" in got, "8-bit codes were loaded as fp32 moments"
        assert "state of w was saved as 8-bit codes" in got["error"], got["error"]
        assert "LoadPlanner()" in got["error"] and "Nothing was loaded" in got["error"]


@pytest.mark.parametrize("case", REFUSED)
def test_another_family_is_refused_with_the_single_file_message(ranks, case):
    expected = single_file(ranks, case)["error"]
    for r in ranks:
        for how, got in r[case].items():
            assert got.get("error") == expected, (how, got)


@pytest.mark.parametrize("name", ["adamw", "adam8bit", "adafactor"])
def test_a_gradient_on_one_rank_only_is_refused_by_name_on_every_rank(ranks, name):
    for r in ranks:
        got = r["grad_on_one_rank"][name]
        assert got["error"] is not None and "'w'" in got["error"] and "1 of the 2 ranks" in got["error"], got
        assert got["unchanged"] and got["counts"] == (1, 0)
