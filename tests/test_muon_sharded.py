"""Muon on FSDP2's row shards (hf_efficient/optim/_muon_sharded.py) on 2 and 4 gloo ranks: the same bits as one
process.

Each rank computes the one-process reference itself (plain tensors, the same seeds) and compares: the momentum
updates are elementwise, whole matrices reach their owner with the bits one process stacks, and Newton-Schulz gives a
matrix the same bits in any batch on CPU, so the weights must be equal, not close. Shapes: row counts 4 ranks do not
divide (10: 3+3+3+1), fewer rows than ranks (3: a rank with none), one row, tall / wide / square, same-shaped
batches. The FSDP2 case trains a model sharded by ``fully_shard`` in which every rank sees the whole batch: with 2 or
4 ranks FSDP2's gradient average of equal gradients is exact, so that run too equals one process bit for bit.

One launch per world size, every case in it (a launch costs more than its cases).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fsdp_helpers import full, run_ranks, shard
from hf_efficient.optim._muon_sharded import bytes_per_step, plan, row_ranges
from hf_efficient.optim.compensation import weight_key
from hf_efficient.optim.muon import muon

SHAPES = [(10, 6), (3, 8), (7, 5), (7, 5), (7, 5), (6, 14), (9, 9), (1, 12), (40, 24)]
STEPS = 3


def _matrices(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(s, generator=g) * 0.1).to(dtype) for s in SHAPES]
    grads = [[torch.randn(s, generator=g).to(dtype) for s in SHAPES] for _ in range(STEPS)]
    return weights, grads


def _primitive(dtype: torch.dtype, compensation: str, chunk: int) -> dict:
    """Three steps of muon() on DTensors against the same on plain tensors; also the bytes the all-to-alls carried
    against :func:`bytes_per_step`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hf_efficient.optim import _sharded

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    weights, grads = _matrices(dtype)
    plain = [w.clone() for w in weights]
    plain_bufs = [torch.zeros(w.shape) for w in weights]
    dts = [distribute_tensor(w.clone(), mesh, [Shard(0)]) for w in weights]
    bufs = [_sharded.zeros(p, p.shape, torch.float32) for p in dts]
    moved, real = [0], dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
        me = dist.get_rank()
        moved[0] += (sum(input_split_sizes) - input_split_sizes[me]) * input.element_size()
        return real(output, input, output_split_sizes, input_split_sizes, group=group)

    dist.all_to_all_single = counting
    try:
        for t, step in enumerate(grads):
            keys = [weight_key(i, t + 1) for i in range(len(SHAPES))]
            kw = dict(lr=0.02, weight_decay=0.1, compensation=compensation, keys=keys, chunk=chunk)
            muon(plain, step, plain_bufs, **kw)
            muon(dts, [distribute_tensor(g, mesh, [Shard(0)]) for g in step], bufs, **kw)
    finally:
        dist.all_to_all_single = real
    return {"equal": [torch.equal(full(d), p) for d, p in zip(dts, plain)],
            "bufs_equal": [torch.equal(full(b), p) for b, p in zip(bufs, plain_bufs)],
            "moved": moved[0],
            "predicted": STEPS * bytes_per_step(SHAPES, dist.get_world_size(), dist.get_rank(), chunk),
            "changed": all(not torch.equal(p, w) for p, w in zip(plain, weights))}


class Block(nn.Module):
    """Linears of 20 x 10, 10 x 20 (10 rows: 3+3+3+1 on 4 ranks), 3 x 10 (a rank with none) and 10 x 3 (tall)."""

    def __init__(self, d: int = 10):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.small, self.expand = nn.Linear(d, 3, bias=False), nn.Linear(3, d)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(torch.relu(self.up(h))) + self.expand(torch.tanh(self.small(h)))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(30, 10), Block(), Block(), nn.Linear(10, 30))


def _train(model, steps: int = STEPS) -> None:
    """Muon on the blocks' linear weights (functional), torch's AdamW on the rest: a plain loop."""
    from hf_efficient.optim import _sharded
    from hf_efficient.param_groups import build_muon_param_groups

    groups = build_muon_param_groups(model, weight_decay=0.1)
    muon_params = [p for g in groups if g["muon"] for p in g["params"]]
    bufs = [_sharded.zeros(p, p.shape, torch.float32) for p in muon_params]
    adamw = torch.optim.AdamW([g for g in groups if not g["muon"]], lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 30, (4, 6), generator=g)
        F.cross_entropy(model(x).flatten(0, 1), x.roll(1, 1).flatten()).backward()
        with torch.no_grad():
            muon(muon_params, [p.grad for p in muon_params], bufs, lr=1e-2, weight_decay=0.1)
        adamw.step()
        model.zero_grad(set_to_none=True)


def _fsdp2() -> dict:
    plain, sharded = _model(), shard(_model())
    before = {n: full(p) for n, p in sharded.named_parameters()}
    _train(plain)
    _train(sharded)
    got = {n: full(p) for n, p in sharded.named_parameters()}
    return {"equal": {n: torch.equal(got[n], p.detach()) for n, p in plain.named_parameters()},
            "placements": sorted({str(p.placements) for p in sharded.parameters()}),
            "moved": [n for n in got if not torch.equal(got[n], before[n])]}


def _all_cases() -> dict:
    return {"fp32": _primitive(torch.float32, "none", 1 << 24),
            "fp32 rounds of 64": _primitive(torch.float32, "none", 64),  # several rounds, each owner batching
            "bf16 stochastic": _primitive(torch.bfloat16, "stochastic", 1 << 24),
            "fsdp2": _fsdp2()}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def ranks(request):
    return request.param, run_ranks(_all_cases, request.param)


@pytest.mark.parametrize("case", ["fp32", "fp32 rounds of 64", "bf16 stochastic"])
def test_sharded_step_equals_one_process_bit_for_bit(ranks, case):
    world, results = ranks
    for rank, result in enumerate(results):
        r = result[case]
        assert r["changed"] and all(r["equal"]) and all(r["bufs_equal"]), (rank, r)
        assert r["moved"] == r["predicted"] > 0, (rank, r)


def test_fsdp2_training_equals_one_process_bit_for_bit(ranks):
    world, results = ranks
    for result in results:
        r = result["fsdp2"]
        assert r["placements"] == ["(Shard(dim=0),)"]
        assert all(r["equal"].values()), [n for n, ok in r["equal"].items() if not ok]
        assert len(r["moved"]) == len(r["equal"])  # every parameter trained


def test_plan_deals_owners_round_robin_and_bounds_rounds():
    shapes = [(4, 4), (2, 8), (4, 4), (100, 100), (4, 4), (2, 8)]
    rounds = plan(shapes, world=2, chunk=40)
    # sorted by shape: (2, 8) x2, (4, 4) x3, (100, 100); owners 0, 1, 0, 1, 0, 1; at most 80 elements a round
    assert rounds == [[(1, 0), (5, 1), (0, 0), (2, 1), (4, 0)], [(3, 1)]]
    assert row_ranges(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)] and row_ranges(3, 4)[3] == (3, 3)
    # even shards, balanced owners: 4 N (W - 1) / W**2 bytes each way (bf16)
    assert bytes_per_step([(8, 8)] * 4, world=4, rank=0, chunk=1 << 24) == 4 * 256 * 3 // 16
