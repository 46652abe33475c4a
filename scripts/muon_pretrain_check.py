"""Pre-training check of the Muon names: a small Llama from random init, byte-level, on Python's documentation.

    python scripts/muon_pretrain_check.py --steps 300 --threads 2            # adamw, muon, muon8bit
    python scripts/muon_pretrain_check.py --only muon --lr 3e-3 --out /tmp/m   # /tmp/m/muon_pretrain.json and .md
    python scripts/muon_pretrain_check.py --seed 1 --out /tmp/s1 && \
        python scripts/muon_pretrain_check.py --merge /tmp/s1/muon_pretrain.json  # another seed (or lr) on the page

Each run is one name through ``hf_efficient.create_optimizer`` (``adamw``: fp32 AdamW, torch's fused kernel on the
decay groups; ``muon`` / ``muon8bit``: Muon on the blocks' matrices, AdamW on the rest, the package's split), with
the same init, data order, learning rate and its schedule (linear warm-up, cosine to 10%), betas (0.9, 0.95),
weight decay, decay groups and gradient clipping (norm 1): only the optimizer of the blocks' matrices differs (and,
for ``muon8bit``, the precision of every state). Muon's update is scaled to match AdamW's RMS
(``match_rms_adamw``), so one learning rate serves both halves. scripts/convergence.py is the fine-tuning side.

Data: ``pydoc_data.topics`` (``examples/data.py``'s text), its paragraphs in a seeded shuffle, 90% for training and
10% for evaluation, as UTF-8 bytes (vocabulary 256: no tokenizer to download, and the blocks hold most parameters).
Training windows are drawn at random from the training bytes; the eval loss is the mean over fixed windows of the
held-out bytes. Prints one JSON line per evaluation and a summary; writes ``muon_pretrain.json`` into ``--out``
(default docs/results) and renders ``muon_pretrain.md`` from it (scripts/render_results.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import render_results  # noqa: E402
from _bench_common import RESULTS, command_line, machine  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def byte_splits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    from pydoc_data.topics import topics

    paragraphs = [p.strip() for key in sorted(topics) for p in re.split(r"\n\s*\n", topics[key]) if p.strip()]
    random.Random(seed).shuffle(paragraphs)
    cut = int(0.9 * len(paragraphs))
    as_bytes = lambda ps: torch.tensor(list("\n\n".join(ps).encode()), dtype=torch.long)  # noqa: E731
    return as_bytes(paragraphs[:cut]), as_bytes(paragraphs[cut:])


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 8 * 8,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 32,
                      num_key_value_heads=args.hidden // 32, max_position_embeddings=args.seq, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


KINDS = ("adamw", "muon", "muon8bit")  # hf_efficient names


def build_optimizer(model, kind: str, args):
    import hf_efficient as hfe

    return hfe.create_optimizer(model, kind, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model, data: torch.Tensor, args) -> float:
    starts = torch.arange(0, len(data) - args.seq - 1, (len(data) - args.seq - 1) // args.eval_windows)
    starts = starts[:args.eval_windows]
    losses = []
    for batch in starts.split(args.batch):
        x = torch.stack([data[s:s + args.seq + 1] for s in batch.tolist()])
        logits = model(input_ids=x[:, :-1]).logits
        losses.append(F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum"))
    return (torch.stack(losses).sum() / (len(starts) * args.seq)).item()


def run(kind: str, train: torch.Tensor, evals: torch.Tensor, args) -> dict:
    import hf_efficient as hfe

    model = build_model(args)
    opt = build_optimizer(model, kind, args)
    g = torch.Generator().manual_seed(args.seed + 1)
    curve, start = [], time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        idx = torch.randint(0, len(train) - args.seq - 1, (args.batch,), generator=g)
        x = torch.stack([train[s:s + args.seq + 1] for s in idx.tolist()])
        loss = F.cross_entropy(model(input_ids=x[:, :-1]).logits.flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            row = {"optimizer": kind, "step": step + 1, "train_loss": round(loss.item(), 4),
                   "eval_loss": round(evaluate(model, evals, args), 4), "seconds": round(time.perf_counter() - start, 1)}
            curve.append(row)
            print(json.dumps(row), flush=True)
    return {"optimizer": kind, "final_eval_loss": curve[-1]["eval_loss"], "curve": curve,
            "state_bytes": hfe.optimizer_state_bytes(opt), "num_params": sum(p.numel() for p in model.parameters())}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=KINDS, action="append", help="run only these (repeatable)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=RESULTS, help="where muon_pretrain.json and .md go")
    p.add_argument("--merge", type=Path, default=None,
                   help="only add this muon_pretrain.json (a session of another --seed or --lr, the same settings "
                        "otherwise, any of the names) to --out's page")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.out / "muon_pretrain.json", args.merge)
    if args.threads:
        torch.set_num_threads(args.threads)
    train, evals = byte_splits(args.seed)
    info = machine("cpu")
    info["torch_threads"] = torch.get_num_threads()
    t0 = time.perf_counter()
    runs = [run(kind, train, evals, args) for kind in (args.only or KINDS)]
    doc = {"command": command_line(__file__, list(argv if argv is not None else sys.argv[1:])), "machine": info,
           "loadavg_after": [round(x, 2) for x in os.getloadavg()], "wall_s": time.perf_counter() - t0,
           "settings": {k: v for k, v in vars(args).items() if k != "out"}, "train_bytes": len(train),
           "eval_bytes": len(evals), "runs": runs}
    print(json.dumps({"final_eval_loss": {r["optimizer"]: r["final_eval_loss"] for r in runs}}))
    render_results.write(args.out, "muon_pretrain", doc)
    return doc


def merge(page: Path, new: Path) -> dict:
    """``page``'s doc with ``new``'s session (another seed or lr) under ``"other_sessions"`` (one per seed, lr and
    names run, a later one replacing an earlier), rendered; refused unless only those (and the threads) differ."""
    doc, other = json.loads(page.read_text()), json.loads(new.read_text())
    free = ("seed", "lr", "threads", "only")
    differ = sorted(k for k in doc["settings"] if k not in free and doc["settings"][k] != other["settings"].get(k))
    key = lambda d: (d["settings"]["seed"], d["settings"]["lr"], [r["optimizer"] for r in d["runs"]])  # noqa: E731
    if differ or key(other)[:2] == key(doc)[:2]:
        raise SystemExit(f"{new}: not another seed or lr of {page} (settings that differ: {differ or 'none'}; seed "
                         f"{other['settings']['seed']}, lr {other['settings']['lr']})")
    doc["other_sessions"] = [s for s in doc.get("other_sessions", []) if key(s) != key(other)]
    doc["other_sessions"].append({k: other[k] for k in ("command", "machine", "loadavg_after", "wall_s", "settings",
                                                        "runs")})
    render_results.write(page.parent, "muon_pretrain", doc)
    return doc


if __name__ == "__main__":
    main()
