"""Shared test helpers: a small model whose tensors cover every state layout, and the train / snapshot / compare
steps the cross-cutting tests (tests/cases.py's CASES) build on. Plain functions, imported by test modules, so that
no test module imports another."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import hf_efficient as hfe

INF, NAN = float("inf"), float("nan")


class Net(nn.Module):
    """An embedding (32-bit state by default), a matrix large enough for 8-bit state, a small head and a norm layer
    (no weight decay): one tensor of each kind the optimizers treat differently."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 64)  # 4096 elements
        self.fc = nn.Linear(64, 128)  # 8192: 8-bit state by size
        self.out = nn.Linear(128, 4)
        self.norm = nn.LayerNorm(128)
        self.to(dtype)

    def forward(self, x):
        return self.out(self.norm(torch.relu(self.fc(self.emb(x))))).float()


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (8, 5), generator=g), torch.randint(0, 4, (8,), generator=g)


def loss_of(model, seed=0):
    """The loss of ``model`` on batch ``seed``: a fixed seed per step makes two runs comparable exactly."""
    x, y = batch(seed)
    return nn.functional.cross_entropy(model(x).mean(1), y)


def make(name, backend, dtype, compensation="auto", **options):
    """A fresh :class:`Net` of ``dtype`` and its optimizer ``name`` on ``backend`` (skipped if torchao is missing)."""
    if backend == "torchao":
        pytest.importorskip("torchao")
    model = Net(dtype)
    opt = hfe.create_optimizer(model, name, lr=1e-2, weight_decay=0.01, backend=backend, compensation=compensation,
                               **options)
    return model, opt


def train(model, opt, steps, start=0):
    """``steps`` optimizer steps on batches ``start``, ``start + 1``, ..."""
    for i in range(start, start + steps):
        loss_of(model, i).backward()
        opt.step()
        opt.zero_grad()


def snapshot(model, opt):
    """Copies of the parameters and the serialized optimizer state: what "nothing half-applied" compares."""
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    return [p.detach().clone() for p in model.parameters()], buf.getvalue()


def assert_unchanged(model, opt, snap):
    params, state = snap
    for a, b in zip(model.parameters(), params):
        assert torch.equal(a, b)
    assert snapshot(model, opt)[1] == state
