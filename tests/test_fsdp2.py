"""FSDP2 (torch's ``fully_shard``: DTensor parameters, Shard(0) on a 1-D mesh) on 1, 2 and 4 gloo CPU processes.

Adafactor and the 8-bit families (AdamW8bit, Lion8bit) step the shards and equal one process stepping the merged
batch; their state is DTensors that torch.distributed.checkpoint (DCP) saves on 2 ranks and loads on 1, 2 and 4. The
Muon names, told to take every 2-D parameter (helpers.matrices_options), orthogonalise each matrix whole on an owner
rank and equal one process too, the 3-D tensor and the vectors in their AdamW half. hf_eff_adamw resumes through
DCP's loader; a mesh the step cannot serve and a checkpoint of another model are refused before anything changes.

Three launches in all (2 ranks, then 1 and 4), each running every case for its world size: a launch costs more
than its cases. The single-process references run in the test process.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hf_efficient
from cases import names, plain, quantized, shardable
from fsdp_helpers import full, run_ranks, shard
from helpers import matrices_options
from hf_efficient.registry import get_spec

pytestmark = pytest.mark.example_family  # SHARDED holds the example family: registered here for each test
STEPS, SAVE_AT = 4, 2
# Names whose FSDP2 runs the checkpoint tests cover: every name that steps shards (hf_eff_adamw_bf16 on a bf16 model)
SHARDED = plain(names(shardable))
EIGHT_BIT = plain(names(shardable, quantized))
_OPTS = {"adafactor": dict(beta1=0.9), "lion8bit": dict(lr=1e-3, weight_decay=0.1)}  # beside lr 1e-2, decay 0.01
OPTS = {n: {"lr": 1e-2, "weight_decay": 0.01, **({"min_8bit_size": 1024} if n in EIGHT_BIT else {}), **_OPTS.get(n, {})}
        for n in SHARDED}
# bf16 weights (hf_eff_adamw_bf16) on shards vs one process: FSDP2's averaged gradients differ by fp32 ulps, which
# can move a weight across a rounding boundary: a bf16 ulp (2**-8 relative) now and then, against the step of 1e-2
BF16_RTOL, BF16_ATOL = 2**-7, 1e-3
# Adafactor on shards vs one process: the column sums, row means and the clip's sum of squares add the ranks'
# partial sums, and FSDP2's gradients are the ranks' mean gradients averaged: the same numbers summed in another
# order, a few fp32 ulps per step. Relative 1e-5 of a weight holds them after 4 steps with room; a lost shard, a
# local (not global) column statistic or RMS clip moves weights by ~1e-3 (the step size) and fails it.
RTOL, ATOL = 1e-5, 1e-6
# Muon's 8-bit momentum on shards vs one process: the gradients differ by fp32 ulps (above), and a momentum value that
# then lands on the other side of a code's boundary changes the whole matrix's orthogonalised update, not one element
# (3.2e-5 of the loss after 4 steps on 4 ranks, measured while the momentum was rounded stochastically, where that is
# likelier). The check that the sharded step itself is exact is
# test_muon_8bit_on_any_mesh_equals_one_process_bit_for_bit_on_equal_gradients.
MUON_8BIT = [n for n in EIGHT_BIT if n in hf_efficient.registry.SPECS and "muon_include" in get_spec(n).accepted]
MUON_8BIT_RTOL, MUON_8BIT_ATOL = 2e-4, 1e-4


class Tiny(nn.Module):
    """Row counts that 4 ranks do not divide (10: 3+3+3+1), a matrix with fewer rows than 4 ranks (3: a rank with
    none), a batch of matrices (sharded along the batch), vectors."""

    def __init__(self, hidden: int = 10):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.mix = nn.Parameter(torch.randn(3, hidden, hidden) / hidden**0.5)
        self.out = nn.Linear(hidden, 3)

    def forward(self, x):
        h = self.norm(torch.tanh(self.inp(x)))
        return self.out(torch.tanh(torch.einsum("bi,kij->bj", h, self.mix)))


class Wide(Tiny):
    """Tiny with matrices whose rows are whole 8-bit blocks (512 = 2 x 256): ``mix`` of 10 rows (3+3+3+1 on 4
    ranks) and ``out.weight`` of 3 (a rank with none) keep 8-bit state under FSDP2 at every mesh size; the rest is
    under ``min_8bit_size`` (fp32 state)."""

    def __init__(self, hidden: int = 10):
        super().__init__(hidden)
        self.mix = nn.Parameter(torch.randn(hidden, 512) / hidden**0.5)
        self.out = nn.Linear(512, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.norm(torch.tanh(self.inp(x))) @ self.mix))


def model_for(name: str, **kw) -> nn.Module:
    return (Wide if name in EIGHT_BIT else Tiny)(**kw).to(get_spec(name).facts.param_dtype)


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(STEPS)]


def train(model, optimizer, steps, whole: bool = False) -> list[float]:
    """Steps on each rank's contiguous share of every batch (all of it in one process, or on every rank where
    ``whole``); the merged batch's losses."""
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() and not whole else (0, 1)
    losses = []
    for x, y in steps:
        dtype = next(model.parameters()).dtype
        loss = F.cross_entropy(model(x.to(dtype).view(world, -1, 6)[rank]).float(), y.view(world, -1)[rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if world > 1:
            dist.all_reduce(loss := loss.detach().clone())
            loss /= world
        losses.append(loss.item())
    return losses


def params_of(model) -> dict:
    return {n: full(p) for n, p in model.named_parameters()}


def reference(name: str, steps=None) -> tuple[list[float], dict]:
    """One process, the merged batches: what every mesh must reproduce."""
    model = model_for(name)
    optimizer = hf_efficient.create_optimizer(model, name, **OPTS[name], **matrices_options(name, model))
    losses = train(model, optimizer, batches() if steps is None else steps)
    return losses, params_of(model)


def eight_bit(model, optimizer) -> list[str]:
    """Names of the parameters whose state is 8-bit codes."""
    return sorted(n for n, p in model.named_parameters()
                  if any(v.dtype == torch.uint8 for v in optimizer.state.get(p, {}).values()))


# ------------------------------------------------------------------------------------------- rank workers


def _dcp_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}


def fresh_run(name: str, save_to: str | None = None) -> dict:
    """Train all steps on this mesh, saving model and optimizer through DCP after SAVE_AT steps (and taking them
    whole, as a single-file state dict, for a user who leaves FSDP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model = shard(model_for(name))
    optimizer = hf_efficient.create_optimizer(model, name, **OPTS[name], **matrices_options(name, model))
    steps = batches()
    losses = train(model, optimizer, steps[:SAVE_AT])
    whole = None
    if save_to is not None:
        dcp.save(_dcp_state(model, optimizer), checkpoint_id=save_to)
        # copied: its step tensors (and replicated statistics) are the live ones, which the steps below advance
        whole = copy.deepcopy(get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True)))
    losses += train(model, optimizer, steps[SAVE_AT:])
    state = optimizer.state[model.mix if name in EIGHT_BIT else model.inp.weight]
    placements = {k: str(getattr(v, "placements", "plain")) for k, v in state.items()}
    return {"losses": losses, "params": params_of(model), "placements": placements, "whole": whole,
            "eight_bit": eight_bit(model, optimizer)}


class Matrices(nn.Module):
    """Only matrices, for Muon alone: 10 rows of 512 (whole 8-bit blocks: 8-bit momentum on every mesh; 3+3+3+1
    rows on 4 ranks) between two with fp32 momentum everywhere (512 x 6 under min_8bit_size 4096, and 3 x 10: a
    rank with no rows)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mix, self.out = nn.Linear(6, 512, bias=False), nn.Linear(512, 10, bias=False), nn.Linear(
            10, 3, bias=False)

    def forward(self, x):
        return self.out(torch.tanh(self.mix(torch.tanh(self.inp(x)))))


def whole_batch_run(name: str, sharded: bool = True) -> dict:
    """Every rank steps :class:`Matrices` on the whole batch: FSDP2 averages equal gradients exactly, so a Muon
    name's weights must be one process's (``sharded=False``) bit for bit: the owner-rank exchange and the momentum's
    codec run the same numbers on shards and whole tensors. (No vectors: AdamW's half on a shard takes torch's
    elementwise kernels on another length, which now and then round a weight an ulp apart; AdamW8bit's shards take its
    eager kernel where one process takes its C one. Those are held to tolerances above.)"""
    model = shard(Matrices()) if sharded else Matrices()
    options = {**OPTS[name], "min_8bit_size": 4096, **matrices_options(name, model)}  # inp (3072) fp32 in one process
    optimizer = hf_efficient.create_optimizer(model, name, **options)
    train(model, optimizer, batches(), whole=True)
    return {"params": params_of(model), "eight_bit": eight_bit(model, optimizer)}


def resumed_run(name: str, load_from: str) -> dict:
    """Build afresh on this mesh, load what :func:`fresh_run` saved (DCP reshards it), train the remaining steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model = shard(model_for(name))
    optimizer = hf_efficient.create_optimizer(model, name, **OPTS[name], **matrices_options(name, model))
    sd = _dcp_state(model, optimizer)
    dcp.load(sd, checkpoint_id=load_from)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, optimizer, sd["optim"])
    losses = train(model, optimizer, batches()[SAVE_AT:])
    return {"losses": losses, "params": params_of(model)}


def refusals() -> dict:
    """Bad input on 2 ranks: each refusal's message, and whether anything changed."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    out = {}
    hsdp = shard(Tiny(), mesh_shape=(1, 2))  # HSDP: (Replicate(), Shard(0)) on a 2-D mesh
    try:
        hf_efficient.create_optimizer(hsdp, "adafactor", **OPTS["adafactor"])
        out["hsdp"] = None
    except ValueError as e:
        out["hsdp"] = str(e)
    model, other = shard(Tiny()), shard(Tiny(hidden=12))
    optimizer = hf_efficient.create_optimizer(model, "adafactor", **OPTS["adafactor"])
    other_opt = hf_efficient.create_optimizer(other, "adafactor", **OPTS["adafactor"])
    train(model, optimizer, batches()[:1])
    train(other, other_opt, batches()[:1])
    before = {k: full(v) for k, v in optimizer.state[model.inp.weight].items()}
    try:
        set_optimizer_state_dict(model, optimizer, _dcp_state(other, other_opt)["optim"])
        out["other_model"] = None
    except ValueError as e:
        out["other_model"] = str(e)
    after = optimizer.state[model.inp.weight]
    out["unchanged"] = all(torch.equal(v, full(after[k])) for k, v in before.items())
    return out


def stochastic_vector(world: int) -> dict:
    """A bf16 vector stepped under stochastic rounding from the same gradient (set whole, then sharded): the noise
    is keyed by the global element index, so the shards round exactly as one process does."""
    from torch.distributed.tensor import Shard, distribute_tensor

    w = torch.linspace(-1, 1, 37).to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(37, generator=g).to(torch.bfloat16) for _ in range(3)]
    model = nn.Module()
    model.w = nn.Parameter(w.clone())
    if world:
        shard(model)
    # no clip (the threshold is far above any RMS): the update is elementwise, so the result is exact
    optimizer = hf_efficient.create_optimizer(model, "adafactor", lr=1e-3, compensation="stochastic",
                                              clip_threshold=1e9)
    for grad in grads:
        p = model.w
        p.grad = distribute_tensor(grad, p.device_mesh, [Shard(0)]) if world else grad.clone()
        optimizer.step()
    return {"w": full(model.w)}


# Adafactor's factored statistics sum across ranks (not bit for bit): its own test is stochastic_vector
STOCHASTIC = [n for n in SHARDED if n != "adafactor"]
# one process on the paths the shards take (eager kernels / torch's ops), so that they must agree bit for bit
EAGER = {**{n: {"compile": False} for n in EIGHT_BIT}, "adamw_bf16": {"foreach": False}}


def stochastic_bf16(name: str, world: int) -> dict:
    """bf16 weights stepped under stochastic rounding from the same gradients (set whole, then sharded): a matrix of
    rows of whole blocks (8-bit state: the eager kernel) and a vector (fp32 state: torch's path), in one process on
    those same paths (:data:`EAGER`): the noise is keyed by the global element index, so the shards must round
    exactly as one process does."""
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(3)
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(5, 256, generator=g).to(torch.bfloat16))
    model.v = nn.Parameter(torch.linspace(-1, 1, 37).to(torch.bfloat16))
    grads = [{n: torch.randn(p.shape, generator=g).to(torch.bfloat16) for n, p in model.named_parameters()}
             for _ in range(3)]
    if world:
        shard(model)
    optimizer = hf_efficient.create_optimizer(model, name, compensation="stochastic", **OPTS[name],
                                              **matrices_options(name, model))
    for group in optimizer.param_groups:
        group.update(EAGER.get(name, {}))
    for step in grads:
        for n, p in model.named_parameters():
            p.grad = distribute_tensor(step[n], p.device_mesh, [Shard(0)]) if world else step[n].clone()
        optimizer.step()
    return {"params": params_of(model), "eight_bit": eight_bit(model, optimizer)}


def fp32_rule() -> dict:
    """Which tensors keep 8-bit state under FSDP2: a matrix over min_8bit_size whose rows are not whole blocks keeps
    fp32 state (its blocks would straddle ranks), one whose rows are keeps 8-bit."""
    model = nn.Module()
    model.odd = nn.Parameter(torch.randn(40, 30))  # 1200 elements, rows of 30
    model.even = nn.Parameter(torch.randn(4, 512))
    shard(model)
    optimizer = hf_efficient.create_optimizer(model, "adam8bit", **OPTS["adam8bit"])
    from torch.distributed.tensor import Shard, distribute_tensor

    for p in model.parameters():
        p.grad = distribute_tensor(torch.ones(p.shape), p.device_mesh, [Shard(0)])
    optimizer.step()
    return {"eight_bit": eight_bit(model, optimizer)}


def two_ranks(dirs: dict) -> dict:
    out = {"stochastic": stochastic_vector(2), "refusals": refusals(), "fp32_rule": fp32_rule()}
    for name, d in dirs.items():
        out[name], out[f"{name}_2to2"] = fresh_run(name, d), resumed_run(name, d)
    for name in STOCHASTIC:
        out[f"{name}_stochastic"] = stochastic_bf16(name, 2)
    return out | {f"{name}_whole": whole_batch_run(name) for name in MUON_8BIT}


def other_ranks(dirs: dict) -> dict:
    out = {"fp32_rule": fp32_rule()}
    for name, d in dirs.items():
        if name != "adamw":
            out[name] = fresh_run(name)
        out[f"{name}_resumed"] = resumed_run(name, d)
    return out | {f"{name}_whole": whole_batch_run(name) for name in MUON_8BIT}


# ------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every rank's results: {world size: [rank 0's dict, ...]}; the 2-rank run writes the checkpoints."""
    dirs = {name: str(tmp_path_factory.mktemp(f"{name}_ckpt")) for name in SHARDED}
    out = {2: run_ranks(two_ranks, 2, dirs)}
    for world in (1, 4):
        out[world] = run_ranks(other_ranks, world, dirs)
    return out


def _tol(name: str = "") -> tuple[float, float]:
    if name in MUON_8BIT:
        return MUON_8BIT_RTOL, MUON_8BIT_ATOL
    return (BF16_RTOL, BF16_ATOL) if name and get_spec(name).facts.param_dtype == torch.bfloat16 else (RTOL, ATOL)


def _close(a: dict, b: dict, name: str = "") -> None:
    rtol, atol = _tol(name)
    for n in b:
        torch.testing.assert_close(a[n], b[n], rtol=rtol, atol=atol, msg=lambda m, n=n: f"{n}: {m}")


def test_adafactor_on_two_ranks_equals_one_process_on_the_merged_batch(ranks):
    losses, params = reference("adafactor")
    for r in ranks[2]:
        _close(r["adafactor"]["params"], params)
        assert r["adafactor"]["losses"] == pytest.approx(losses, rel=RTOL)


def test_adafactor_state_is_placed_like_its_parameter(ranks):
    # row statistics and moments sharded like the rows; column statistics whole on every rank
    placed = ranks[2][0]["adafactor"]["placements"]
    assert placed["exp_avg_sq_row"] == placed["exp_avg"] == "(Shard(dim=0),)"
    assert placed["exp_avg_sq_col"] == "(Replicate(),)"
    assert placed["step"] == "plain"


def test_adafactor_final_loss_does_not_depend_on_the_mesh(ranks):
    losses, _ = reference("adafactor")
    for world in (1, 2, 4):
        assert ranks[world][0]["adafactor"]["losses"] == pytest.approx(losses, rel=RTOL), world


@pytest.mark.parametrize("name", EIGHT_BIT)
def test_8bit_on_two_ranks_equals_one_process_on_the_merged_batch(ranks, name):
    # elementwise: only the gradients differ (FSDP2 averages the ranks' mean gradients), by fp32 ulps; RTOL holds
    losses, params = reference(name)
    for r in ranks[2]:
        _close(r[name]["params"], params, name)
        assert r[name]["losses"] == pytest.approx(losses, rel=_tol(name)[0])


@pytest.mark.parametrize("name", MUON_8BIT)
def test_muon_8bit_on_any_mesh_equals_one_process_bit_for_bit_on_equal_gradients(ranks, name, one_thread):
    params = whole_batch_run(name, sharded=False)["params"]  # on one thread, as each rank: the same sums, in order
    for world in (1, 2, 4):
        got = ranks[world][0][f"{name}_whole"]
        assert got["eight_bit"] == ["mix.weight"], world
        assert [n for n in params if not torch.equal(got["params"][n], params[n])] == [], world


@pytest.mark.parametrize("name", EIGHT_BIT)
def test_8bit_state_and_its_precision_do_not_depend_on_the_mesh(ranks, name):
    placed = ranks[2][0][name]["placements"]  # of mix: codes of its shape, absmaxes (rows, 2), placed like its rows
    assert {k: v for k, v in placed.items() if k != "step"} == {
        k: "(Shard(dim=0),)" for k in placed if k != "step"}, placed
    assert placed["step"] == "plain"
    losses, _ = reference(name)
    for world in (1, 2, 4):
        assert ranks[world][0][name]["eight_bit"] == ["mix", "out.weight"], world
        assert ranks[world][0][name]["losses"] == pytest.approx(losses, rel=_tol(name)[0]), world


def test_sharded_matrices_whose_rows_are_not_whole_blocks_keep_fp32_state(ranks):
    for world in (1, 2, 4):
        assert ranks[world][0]["fp32_rule"]["eight_bit"] == ["even"], world


def test_adamw_bf16_on_two_ranks_equals_one_process_on_the_merged_batch(ranks):
    losses, params = reference("adamw_bf16")
    for world in (1, 2, 4):
        _close(ranks[world][0]["adamw_bf16"]["params"], params, "adamw_bf16")
        assert ranks[world][0]["adamw_bf16"]["losses"] == pytest.approx(losses, rel=BF16_RTOL), world
    assert set(ranks[2][0]["adamw_bf16"]["placements"].values()) == {"(Shard(dim=0),)", "plain"}


@pytest.mark.parametrize("name", STOCHASTIC)
def test_stochastic_rounding_of_bf16_shards_rounds_as_one_process(ranks, name):
    one = stochastic_bf16(name, 0)
    assert one["eight_bit"] == (["w"] if name in EIGHT_BIT else [])
    for r in ranks[2]:
        assert r[f"{name}_stochastic"]["eight_bit"] == one["eight_bit"]
        for n, p in one["params"].items():
            assert torch.equal(r[f"{name}_stochastic"]["params"][n], p), n


@pytest.mark.parametrize("name", SHARDED)
def test_dcp_save_on_two_ranks_resumes_exactly_on_two(ranks, name):
    for r in ranks[2]:
        uninterrupted, resumed = r[name], r[f"{name}_2to2"]
        assert resumed["losses"] == uninterrupted["losses"][SAVE_AT:]
        for n, p in uninterrupted["params"].items():
            assert torch.equal(resumed["params"][n], p), n


@pytest.mark.parametrize("name", SHARDED)
@pytest.mark.parametrize("world", [1, 4])
def test_dcp_save_on_two_ranks_resumes_on_another_mesh(ranks, name, world):
    uninterrupted = ranks[2][0][name]
    resumed = ranks[world][0][f"{name}_resumed"]
    _close(resumed["params"], uninterrupted["params"], name)
    assert resumed["losses"] == pytest.approx(uninterrupted["losses"][SAVE_AT:], rel=_tol(name)[0])


@pytest.mark.parametrize("name", SHARDED)
def test_a_whole_state_taken_on_two_ranks_resumes_in_one_process(ranks, name):
    # DCP's full_state_dict: the single-file state a user leaving FSDP loads with the ordinary load_state_dict
    run = ranks[2][0][name]
    model_sd, optim_sd = run["whole"]
    model = model_for(name)
    model.load_state_dict(model_sd)
    optimizer = hf_efficient.create_optimizer(model, name, **OPTS[name], **matrices_options(name, model))
    optimizer.load_state_dict(optim_sd)
    losses = train(model, optimizer, batches()[SAVE_AT:])
    _close(params_of(model), run["params"], name)
    assert losses == pytest.approx(run["losses"][SAVE_AT:], rel=_tol(name)[0])


def test_stochastic_rounding_on_shards_rounds_as_one_process(ranks):
    one = stochastic_vector(0)["w"]
    for r in ranks[2]:
        assert torch.equal(r["stochastic"]["w"], one)


def test_a_mesh_the_step_cannot_serve_is_refused_by_name(ranks):
    message = ranks[2][0]["refusals"]["hsdp"]
    assert message is not None, "an HSDP (2-D mesh) model was accepted"
    assert "Shard(0) on a 1-D device mesh" in message and "Replicate()" in message


def test_a_checkpoint_of_another_model_is_refused_before_anything_loads(ranks):
    for r in ranks[2]:
        refused = r["refusals"]
        assert refused["other_model"] is not None and "another model" in refused["other_model"], refused
        assert refused["unchanged"]


# ------------------------------------------------------------------- single-file state <-> FSDP2, 8-bit choice differs

MIXED_OPTS = dict(lr=1e-2, weight_decay=0.01, min_8bit_size=1024)
# what one process gives 8-bit state and FSDP2 keeps fp32 (rows not whole blocks), and what both keep 8-bit
MIXED_DIFFER, MIXED_SAME = ("vec", "odd"), "even"


def mixed_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.vec = nn.Parameter(torch.randn(1024))  # >= min_8bit_size: 8-bit in one process, a vector under FSDP2
    model.odd = nn.Parameter(torch.randn(40, 30))  # 1200 elements, rows of 30: not whole blocks
    # rows of whole blocks: 8-bit everywhere; 3 rows of 2 blocks: rows split 2 + 1, so the blocks 4 + 2, where DCP's
    # full-state loader splits the 6 absmaxes of a single-file state 3 + 3 (the load re-shards them by rows)
    model.even = nn.Parameter(torch.randn(3, 512))
    return model


def mixed_grads() -> list[dict]:
    g = torch.Generator().manual_seed(4)
    return [{n: torch.randn(p.shape, generator=g) for n, p in mixed_model().named_parameters()} for _ in range(STEPS)]


def mixed_steps(model, optimizer, grads) -> None:
    """Set each gradient whole (sharded like its parameter under FSDP2) and step."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for step in grads:
        for n, p in model.named_parameters():
            p.grad = (distribute_tensor(step[n], p.device_mesh, [Shard(0)]) if hasattr(p, "device_mesh")
                      else step[n].clone())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def single_file_into_shards(single: dict) -> dict:
    """The single-file state a process saved after SAVE_AT steps (``single``: model and optimizer state) loaded on
    this rank through DCP's full-state loader, then the remaining steps: which tensors had 8-bit state after the
    load, and the final weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    full_sd = StateDictOptions(full_state_dict=True)
    model = shard(mixed_model())
    optimizer = hf_efficient.create_optimizer(model, "adam8bit", **MIXED_OPTS)
    set_model_state_dict(model, single["model"], options=full_sd)
    set_optimizer_state_dict(model, optimizer, single["optim"], options=full_sd)
    loaded = eight_bit(model, optimizer)
    mixed_steps(model, optimizer, mixed_grads()[SAVE_AT:])
    return {"params": params_of(model), "eight_bit": loaded}


def mixed_on_shards(single: dict) -> dict:
    """Both directions on this rank. In: :func:`single_file_into_shards`. Out: an FSDP2 run of
    SAVE_AT steps, its whole (single-file) state taken, then the remaining steps (what one process must continue)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full_sd = StateDictOptions(full_state_dict=True)
    into = single_file_into_shards(single)

    model = shard(mixed_model())
    optimizer = hf_efficient.create_optimizer(model, "adam8bit", **MIXED_OPTS)
    mixed_steps(model, optimizer, mixed_grads()[:SAVE_AT])
    saved = {"model": params_of(model), "optim": copy.deepcopy(get_optimizer_state_dict(model, optimizer,
                                                                                         options=full_sd)),
             "eight_bit": eight_bit(model, optimizer)}
    mixed_steps(model, optimizer, mixed_grads()[SAVE_AT:])
    return {"into": into, "out": dict(saved, params=params_of(model))}


# 8-bit moments re-quantized once vs kept in fp32 (or the reverse) for 2 steps of lr 1e-2: Adam's update
# m / sqrt(v) moves with the codec's rounding of m and v (a few % of a block's absmax near zero), so weights differ
# by a fraction of the step size; a moment lost or zeroed moves them by whole steps (~1e-2) and fails it
MIXED_ATOL = 3e-3


def test_single_file_state_and_fsdp2_convert_where_the_8bit_choice_differs(caplog):
    import logging

    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = mixed_model()
    optimizer = hf_efficient.create_optimizer(model, "adam8bit", **MIXED_OPTS)
    mixed_steps(model, optimizer, mixed_grads()[:SAVE_AT])
    assert eight_bit(model, optimizer) == sorted((*MIXED_DIFFER, MIXED_SAME))
    single = {"model": copy.deepcopy(model.state_dict()),
              "optim": copy.deepcopy(get_optimizer_state_dict(model, optimizer))}  # what a user saves: by name
    mixed_steps(model, optimizer, mixed_grads()[SAVE_AT:])
    stayed = params_of(model)  # the run that never left its layout
    ranks = run_ranks(mixed_on_shards, 2, single)

    for r in ranks:  # one process -> FSDP2: vec and odd dequantized to fp32, even stays 8-bit
        assert r["into"]["eight_bit"] == [MIXED_SAME]
        for n, w in stayed.items():
            torch.testing.assert_close(r["into"]["params"][n], w, rtol=0, atol=MIXED_ATOL, msg=n)

    out = ranks[0]["out"]  # FSDP2 -> one process through the ordinary load_state_dict: vec and odd quantized
    assert out["eight_bit"] == [MIXED_SAME]
    model = mixed_model()
    model.load_state_dict(out["model"])
    optimizer = hf_efficient.create_optimizer(model, "adam8bit", **MIXED_OPTS)
    with caplog.at_level(logging.WARNING):
        optimizer.load_state_dict(out["optim"])
    assert "keeps in 8 bits, quantized (lossy" in caplog.text and all(n in caplog.text for n in MIXED_DIFFER), caplog.text
    assert eight_bit(model, optimizer) == sorted((*MIXED_DIFFER, MIXED_SAME))
    mixed_steps(model, optimizer, mixed_grads()[SAVE_AT:])
    for n, w in out["params"].items():
        torch.testing.assert_close(params_of(model)[n], w, rtol=0, atol=MIXED_ATOL, msg=n)


def test_fp32_single_file_state_loads_into_shards_that_keep_it_8bit():
    """DCP's full-state loader fills what a saved state lacks from the optimizer's own state, so fp32 moments arrive
    beside the shards' current absmaxes: they are not the checkpoint's, and the moments are quantized (not refused
    as a corrupt checkpoint)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = mixed_model()
    optimizer = hf_efficient.create_optimizer(model, "adam8bit", **dict(MIXED_OPTS, min_8bit_size=10**6))
    mixed_steps(model, optimizer, mixed_grads()[:SAVE_AT])
    assert eight_bit(model, optimizer) == []
    single = {"model": copy.deepcopy(model.state_dict()), "optim": copy.deepcopy(get_optimizer_state_dict(model, optimizer))}
    for r in run_ranks(single_file_into_shards, 2, single):  # the matrix saved fp32 (min_8bit_size 10**6) is quantized
        assert r["eight_bit"] == [MIXED_SAME]


def _abort_rank_1(after_result: bool) -> int:
    """Rank 1 prints a line, then dies of SIGABRT: now, or at its exit after its result is written (gloo's teardown
    abort)."""
    import atexit
    import os
    import signal

    import torch.distributed as dist

    if dist.get_rank() == 1:
        print("rank 1 was here", flush=True)
        if not after_result:
            os.kill(os.getpid(), signal.SIGABRT)
        atexit.register(os.kill, os.getpid(), signal.SIGABRT)
    return dist.get_rank()


def test_the_harness_fails_a_rank_that_dies_with_its_output():
    with pytest.raises(AssertionError, match="(?s)SIGABRT.*rank 1 was here"):
        run_ranks(_abort_rank_1, 2, False)


def test_the_harness_keeps_results_written_before_a_teardown_abort():
    with pytest.warns(RuntimeWarning, match="(?s)every rank wrote its result.*SIGABRT.*rank 1 was here"):
        assert run_ranks(_abort_rank_1, 2, True) == [0, 1]
