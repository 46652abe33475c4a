"""Shared test helpers, plain functions imported by test modules (and the workers they launch), so that no test
module imports another: a small model whose tensors cover every state layout with the train / snapshot / compare
steps the cross-cutting tests (tests/cases.py's CASES) build on; a tiny masked LM with batches of uneven token
counts, for gradient accumulation under Accelerate."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hf_efficient as hfe

INF, NAN = float("inf"), float("nan")
IGNORE = -100  # the label of a token without a target
# What optional extras installed here but not on the README's path (torchao, deepspeed: CI installs them for their own
# tests) print when imported in a child process; set aside only while the package is installed
EXTRAS_NOISE = {
    "torchao": re.compile(r"torchao|_pytree\.py.*(KernelPreference|ScaleCalculationMode)"),
    "deepspeed": re.compile(r"real_accelerator\.py"),
}


def without_extras_noise(lines: list[str]) -> list[str]:
    """``lines`` less what an installed optional extra prints on import (:data:`EXTRAS_NOISE`)."""
    for package, pattern in EXTRAS_NOISE.items():
        if importlib.util.find_spec(package) is not None:
            lines = [line for line in lines if not pattern.search(line)]
    return lines


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


def net_options(name) -> dict:
    """What ``name`` needs to train :class:`Net` as it would a transformer: Net has no blocks, so a Muon name is told
    to take its hidden matrix (``fc.weight``) by name."""
    return {"muon_include": "fc.weight"} if "muon_include" in hfe.registry.get_spec(name).accepted else {}


def matrices_options(name, model) -> dict:
    """What ``name`` needs to step every 2-D parameter of ``model`` (a test model without blocks) as a matrix: a Muon
    name is told to take them all by name (Muon steps them whole, on an owner rank under FSDP2)."""
    if "muon_include" not in hfe.registry.get_spec(name).accepted:
        return {}
    return {"muon_include": "|".join(n for n, p in model.named_parameters() if p.ndim == 2)}


def make(name, backend, dtype, compensation="auto", **options):
    """A fresh :class:`Net` of ``dtype`` and its optimizer ``name`` on ``backend`` (skipped if torchao is missing)."""
    if backend == "torchao":
        pytest.importorskip("torchao")
    model = Net(dtype)
    opt = hfe.create_optimizer(model, name, lr=1e-2, weight_decay=0.01, backend=backend, compensation=compensation,
                               **{**net_options(name), **options})
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


def muon_f64(params, grads, bufs, *, lr: float, weight_decay: float, momentum: float = 0.95, nesterov: bool = True,
             ns_steps: int = 5, adjust_lr: str = "match_rms_adamw") -> None:
    """One Muon step in float64, matrix by matrix, written out from the papers independently of the package (a
    reference): ``params`` and ``bufs`` (float64, of each matrix's shape, ``nn.Linear``'s (out, in)) in place.
    torch.optim.Muon's momentum (an average), Keller Jordan's quintic after Frobenius normalisation, on the wide
    orientation; Moonlight's scale (match_rms_adamw) or the reference's (original); decoupled decay."""
    a, b, c = 3.4445, -4.7750, 2.0315
    for p, g, buf in zip(params, grads, bufs):
        g = g.double()
        buf.mul_(momentum).add_(g, alpha=1 - momentum)
        u = (1 - momentum) * g + momentum * buf if nesterov else buf
        tall = u.shape[0] > u.shape[1]
        x = u.T if tall else u
        x = x / max(x.norm().item(), 1e-7)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        rows, cols = u.shape
        scale = 0.2 * max(rows, cols) ** 0.5 if adjust_lr == "match_rms_adamw" else max(1, rows / cols) ** 0.5
        p.mul_(1 - lr * weight_decay).sub_(x.T if tall else x, alpha=lr * scale)


# --- a tiny masked LM and batches of uneven token counts (gradient accumulation) ---------------------------------

def mixed_params(seed: int = 0) -> list:
    """A quantized family's test tensors: blockwise-quantized ones (one with a partial last block, one
    non-contiguous), a small one that keeps fp32 state, and a scalar."""
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in [(64, 80), (300, 23), (1000,), (1,)]]
    ps.append(torch.nn.Parameter((torch.randn(90, 60, generator=g) * 0.1).t()))
    return ps


def fixed_grad_steps(opt, params, steps: int, start: int = 0):
    """Steps ``start`` to ``start + steps`` of a fixed sequence of random gradients (the same at each step number,
    whatever ``start``: a resumed run sees the gradients an uninterrupted one did); returns ``opt``."""
    g = torch.Generator().manual_seed(1)
    for step in range(start + steps):
        for p in params:
            grad = torch.randn(p.shape, generator=g) * 0.01
            if step >= start:
                p.grad = grad
        if step >= start:
            opt.step()
    return opt


def tiny_mlm(seed: int = 0, dropout: float = 0.0, dtype=torch.float32, intermediate: int = 64):
    """A 1-layer BERT masked LM whose matrices are all 64x64 (4096 elements: just big enough for 8-bit state;
    one shape, so torchao compiles its step once), decoder tied to the embeddings as in the real MiniLM."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=intermediate, max_position_embeddings=32, hidden_dropout_prob=dropout,
                     attention_probs_dropout_prob=dropout)
    return BertForMaskedLM(cfg).to(dtype)


def variable_batches(n_batches: int = 4, per_batch: int = 2, seed: int = 0) -> list[dict]:
    """Micro-batches of sequences whose lengths (3-24) and target counts (1 to all) differ a lot."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n_batches * per_batch):
        n = int(torch.randint(3, 25, (1,), generator=g))
        ids = torch.randint(1, 100, (n,), generator=g)
        rate = 0.1 if i % 2 else 0.9  # sparse and dense targets alternate, so token counts differ per batch
        labels = torch.where(torch.rand(n, generator=g) < rate, torch.randint(1, 100, (n,), generator=g), IGNORE)
        labels[0] = int(ids[0])  # at least one target
        seqs.append((ids, labels))
    return [collate(seqs[i:i + per_batch]) for i in range(0, len(seqs), per_batch)]


def collate(seqs) -> dict:
    width = max(len(ids) for ids, _ in seqs)
    batch = {"input_ids": torch.zeros(len(seqs), width, dtype=torch.long),
             "attention_mask": torch.zeros(len(seqs), width, dtype=torch.long),
             "labels": torch.full((len(seqs), width), IGNORE)}
    for i, (ids, labels) in enumerate(seqs):
        batch["input_ids"][i, :len(ids)], batch["attention_mask"][i, :len(ids)] = ids, 1
        batch["labels"][i, :len(ids)] = labels
    return batch


def merge(batches: list[dict]) -> dict:
    """One big batch from micro-batches (re-padded to the widest)."""
    seqs = [(b["input_ids"][i][b["attention_mask"][i] == 1], b["labels"][i][b["attention_mask"][i] == 1])
            for b in batches for i in range(len(b["input_ids"]))]
    return collate(seqs)


def logits_of(model, batch):
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def reference_grads(batch: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Gradients of the big batch's token-mean loss."""
    model = tiny_mlm(seed)
    F.cross_entropy(logits_of(model, batch).flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def accumulated_grads(accelerator, model, batches: list[dict], naive: bool = False) -> dict[str, torch.Tensor]:
    """Gradients after one window through accelerate.accumulate: token-counted, or the naive mean of means."""
    from hf_efficient.integrations.accelerate import accumulation_windows, summed_token_loss

    for window in accumulation_windows(accelerator, batches):
        for batch in window:
            with accelerator.accumulate(model):
                logits = logits_of(model, batch)
                if naive:
                    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
                else:
                    loss = window.scale(summed_token_loss(logits, batch["labels"]))
                accelerator.backward(loss)
    unwrapped = accelerator.unwrap_model(model)
    return {n: p.grad.clone() for n, p in unwrapped.named_parameters() if p.grad is not None}


def max_rel_diff(a: dict, b: dict) -> float:
    """Largest per-tensor relative difference; the floor keeps gradients that are exactly zero in exact math
    (attention's key bias: softmax ignores a per-query constant) from turning rounding noise into a ratio."""
    assert a.keys() == b.keys()
    floor = 1e-4 * torch.stack([v.norm() for v in b.values()]).norm()
    return max(((a[k] - b[k]).norm() / torch.maximum(b[k].norm(), floor)).item() for k in a)


@contextlib.contextmanager
def no_host_read(monkeypatch):
    """Every way of reading a tensor's value on the host (each a sync on CUDA) raises inside the block. Not
    ``numpy()``: on CUDA it refuses device tensors, and it is how a flag's pinned host copy is read."""
    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read on the host")

    with monkeypatch.context() as m:
        for attr in ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu"):
            m.setattr(torch.Tensor, attr, refuse)
        m.setattr(torch.cuda, "synchronize", refuse)
        yield
