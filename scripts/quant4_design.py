"""Which 4-bit codec for AdamW's moments? Train with each candidate beside fp32 AdamW and compare final eval losses.

    python scripts/quant4_design.py --jobs 2 --threads 1                 # every design, both tasks
    python scripts/quant4_design.py --task llama --only fp32,ao4 --out /tmp/q4   # a subset
    python scripts/quant4_design.py --quick --out /tmp/q4                # smoke test

Each design is a pair of codecs (first moment, second moment) applied as a round trip after every step: AdamW's
math in fp32 in an eager loop of this script (``torch.optim.AdamW``'s order of operations, the update from the fresh
fp32 moments, as torchao's and this package's 8-bit kernels do), then ``exp_avg`` and ``exp_avg_sq`` replaced by
what their codec would decode. Storing the decoded values is storing the codes: the run is the codec's, without its
kernels. Tensors under 4096 elements keep fp32 moments (torchao's and bitsandbytes' rule); every other tensor,
embeddings included, is quantized. The row ``torchao AdamW4bit`` is torchao's optimizer itself (its compiled step),
on the same run. It differs from ``ao4`` (its maps in this loop) by one more rule: torchao floors every scale at
1e-12 (``scale_tensor``'s ``clip``), so a block of second moments below 1e-12 decodes as if its largest were 1e-12
(at least 1e-12 / 16): a larger ``eps`` for the parameters of tiny gradients (``ao4`` here has no such floor).

Candidates (normalized by each block's absmax unless said; "nearest": the map value nearest to the normalized
value, "companded": rounding in the companded domain):

- first moment: ``de``: torchao's signed 4-bit dynamic map (``create_dynamic_map(True, 3, 4)``: 0, +-0.0055 ..
  +-0.8875, 1), nearest; ``softsign``: FlashOptim's companding ``y = 2x / (1 + |x|)`` on 15 levels, companded;
  ``sq``: ``x = sign * (q / 7)**2``, q in -7..7, companded (rounding sqrt|x|).
- second moment: ``lin``: torchao's linear map without zero (k / 16, k = 1..16), nearest; ``de0``: the unsigned
  4-bit dynamic map with this package's floor (a positive value never gets 0), nearest; ``sqrt``: the square root
  stored on the linear map without zero (k / 16 of the block's largest root), nearest root; ``rank1``: Li et al.
  2023's rank-1 normalisation (an element's scale is the smaller of its row's and its column's maximum; blocks for
  1-D tensors) on the linear map without zero.
- ``8bit``: this package's 8-bit codec (:mod:`hf_efficient.optim.quant8`, blocks of 256), for reference.

Tasks: ``minilm``, scripts/convergence.py's task (masked-LM fine-tuning of the pretrained all-MiniLM-L6-v2 on
Python's documentation, 150 steps of 16, lr 1e-4); ``llama``, a config-built 4-layer Llama (hidden 256, the
tokenizer's 4095 most frequent tokens) trained from scratch on the same text as a causal LM (300 steps of 16 windows
of 64 tokens, lr 1e-3): from scratch the moments matter more than in a short fine-tuning. Both: linear warm-up over
10% then linear decay, weight decay 0.01 on this package's decay groups, seed 0 (``--seed``: another model
initialization, data order and masks, on the same split and eval set). Writes ``--out``/quant4_design.json (with
``--seed``, ``quant4_design_seedN.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import RESULTS, command_line, machine  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MIN_SIZE = 4096  # tensors below keep fp32 moments (torchao, bitsandbytes)

# ------------------------------------------------------------------------------------------ codecs (round trips)


def _blocks(x: torch.Tensor, block: int, fn) -> torch.Tensor:
    """``fn`` applied to ``x``'s blocks normalized by their absmax (zero-padded to whole blocks), scaled back."""
    flat = x.reshape(-1)
    xb = F.pad(flat, (0, -flat.numel() % block)).view(-1, block)
    a = xb.abs().amax(1, keepdim=True)
    a = torch.where(a > 0, a, torch.ones_like(a))
    return (fn(xb / a) * a).reshape(-1)[: flat.numel()].view_as(x)


def _nearest(xn: torch.Tensor, values: torch.Tensor, floor: bool = False) -> torch.Tensor:
    """The value of ``values`` (sorted) nearest to each of ``xn``; with ``floor``, never ``values[0]`` (0) for a
    positive one."""
    idx = torch.bucketize(xn, (values[1:] + values[:-1]) / 2)
    if floor:
        idx = torch.where(xn > 0, idx.clamp_min(1), idx)
    return values[idx]


def _dynamic_map(signed: bool) -> torch.Tensor:
    from torchao.optim.quant_utils import create_dynamic_map
    return torch.tensor(sorted(create_dynamic_map(signed, 3, 4)), dtype=torch.float32)


LIN16 = torch.arange(1, 17, dtype=torch.float32) / 16  # torchao's unsigned 4-bit map: no zero


def m_de(x, block=128):
    values = _dynamic_map(True)
    return _blocks(x, block, lambda xn: _nearest(xn, values))


def m_softsign(x, block=128):
    def fn(xn):
        y = torch.round(7 * (2 * xn / (1 + xn.abs()))) / 7
        return y / (2 - y.abs())
    return _blocks(x, block, fn)


def m_sq(x, block=128):
    return _blocks(x, block, lambda xn: torch.sign(xn) * (torch.round(7 * xn.abs().sqrt()) / 7) ** 2)


def v_lin(x, block=128):
    return _blocks(x, block, lambda xn: _nearest(xn, LIN16))


def v_de0(x, block=128):
    values = _dynamic_map(False)
    return _blocks(x, block, lambda xn: _nearest(xn, values, floor=True))


def v_sqrt(x, block=128):
    return _blocks(x.sqrt(), block, lambda xn: _nearest(xn, LIN16)) ** 2


def v_log2(x, block=128):
    """Powers of two ``2**-c`` (c = 0..15) of the block's largest, no zero; the nearest in the log domain."""
    return _blocks(x, block, lambda xn: 2.0 ** -torch.round(-torch.log2(xn)).clamp(0, 15))


def v_rank1(x, block=128):
    if x.dim() < 2:
        return v_lin(x, block)
    x2 = x.reshape(x.shape[0], -1)
    scale = torch.minimum(x2.amax(1, keepdim=True), x2.amax(0, keepdim=True))
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (_nearest(x2 / scale, LIN16) * scale).view_as(x)


def q8(signed: bool):
    def fn(x):
        from hf_efficient.optim import quant8
        codes, absmax = quant8.quantize_blockwise(x, signed)
        return quant8.dequantize_blockwise(codes, absmax, signed)
    return fn


def q4(signed: bool):
    """This package's 4-bit codec (:mod:`hf_efficient.optim.quant4`), once it exists: the chosen design's code."""
    def fn(x):
        from hf_efficient.optim import quant4
        codes, absmax = quant4.quantize_blockwise(x, signed)
        return quant4.dequantize_blockwise(codes, absmax, signed, x.shape)
    return fn


def _designs() -> dict:
    """label -> (first-moment round trip, second-moment round trip, description); None: fp32 / torchao itself."""
    return {
        "fp32": (None, None, "fp32 AdamW (this script's loop, fp32 moments)"),
        "ao": (None, None, "torchao AdamW4bit (its own compiled step)"),
        "8bit": (q8(True), q8(False), "this package's 8-bit codec, blocks of 256"),
        "ao4": (m_de, v_lin, "m: de, v: lin (torchao AdamW4bit's maps; scales without its 1e-12 floor), B128"),
        "de+de0": (m_de, v_de0, "m: de, v: unsigned dynamic map with the floor, B128"),
        "de+sqrt": (m_de, v_sqrt, "m: de, v: sqrt on lin, B128"),
        "de+log2": (m_de, v_log2, "m: de, v: powers of two of the block's largest (2**-15 .. 1), B128"),
        "de+rank1": (m_de, v_rank1, "m: de, v: rank-1 normalised lin (Li et al. 2023); B128 for 1-D"),
        "softsign+sqrt": (m_softsign, v_sqrt, "m: softsign companding, v: sqrt on lin, B128"),
        "sq+sqrt": (m_sq, v_sqrt, "m: sign * (q/7)**2, v: sqrt on lin, B128"),
        "de+sqrt B64": (lambda x: m_de(x, 64), lambda x: v_sqrt(x, 64), "m: de, v: sqrt on lin, B64"),
        "ao4 B64": (lambda x: m_de(x, 64), lambda x: v_lin(x, 64), "ao4 with blocks of 64"),
        "quant4": (q4(True), q4(False), "hf_efficient.optim.quant4 (the chosen design, this package's code)"),
    }


DEFAULT = ["fp32", "ao", "8bit", "ao4", "de+de0", "de+sqrt", "de+rank1", "softsign+sqrt", "sq+sqrt"]


# ------------------------------------------------------------------------------------------ the optimizer


class FakeQuantAdamW(torch.optim.Optimizer):
    """AdamW (``torch.optim.AdamW``'s math, fp32) whose moments go through round trips ``qm`` / ``qv`` after every
    step on tensors of :data:`MIN_SIZE` elements or more."""

    def __init__(self, params, lr, weight_decay, qm=None, qv=None, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps))
        self.qm, self.qv = qm, qv

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                st["step"] += 1
                t, m, v, g = st["step"], st["exp_avg"], st["exp_avg_sq"], p.grad
                p.mul_(1 - group["lr"] * group["weight_decay"])
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(group["eps"])
                p.addcdiv_(m, denom, value=-group["lr"] / (1 - b1**t))
                if self.qm is not None and p.numel() >= MIN_SIZE:
                    m.copy_(self.qm(m))
                    v.copy_(self.qv(v))


# ------------------------------------------------------------------------------------------ tasks


def _schedule(opt, steps: int):
    warmup = max(1, int(0.1 * steps))
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / max(1, steps - warmup))))


def _minilm(cfg: dict):
    """(model, train batches iterator factory, eval function, loss function) of convergence.py's task."""
    from convergence import evaluate, masked_lm_stats
    from data import MLMCollator, build_datasets, load_model_and_tokenizer
    from torch.utils.data import DataLoader

    model, tok = load_model_and_tokenizer()
    train, ev = build_datasets(tok, max_length=64, seed=0)
    seed = cfg.get("seed", 0)  # the split and the eval masks stay seed 0's: every seed is scored on one set
    masker = MLMCollator(tok, generator=torch.Generator().manual_seed(seed))
    loader = DataLoader(train, batch_size=16, shuffle=True, drop_last=True, collate_fn=masker,
                        generator=torch.Generator().manual_seed(seed))
    eval_loader = DataLoader(ev[:cfg["eval_examples"] or None], batch_size=64, collate_fn=MLMCollator(tok))

    def loss(batch):
        s, _, n = masked_lm_stats(model, batch)
        return s / max(n, 1)
    return model, loader, lambda: evaluate(model, eval_loader)["loss"], loss


def _llama(cfg: dict):
    """A small Llama trained from scratch as a causal LM on the documentation text, windows of 64 tokens."""
    from data import bundled_model_path, load_texts
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(bundled_model_path())
    ids = tok(load_texts(), add_special_tokens=False)["input_ids"]
    counts = Counter(t for seq in ids for t in seq)
    vocab = {t: i + 1 for i, (t, _) in enumerate(counts.most_common(4095))}  # 0: every other token
    stream = torch.tensor([vocab.get(t, 0) for seq in ids for t in seq + [tok.sep_token_id]])
    windows = stream[: stream.numel() // 65 * 65].view(-1, 65)
    windows = windows[torch.randperm(len(windows), generator=torch.Generator().manual_seed(0))]
    n_eval = max(16, len(windows) // 20)
    ev, train = windows[:n_eval], windows[n_eval:]
    seed = cfg.get("seed", 0)  # the split stays seed 0's
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=64, tie_word_embeddings=False))
    gen = torch.Generator().manual_seed(seed)

    def loader():
        while True:
            for idx in torch.randperm(len(train), generator=gen).split(16):
                if len(idx) == 16:
                    yield train[idx]

    def loss(w):
        logits = model(input_ids=w[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), w[:, 1:].reshape(-1))

    @torch.no_grad()
    def evaluate():
        model.eval()
        out = sum(loss(b).item() * len(b) for b in ev.split(64)) / len(ev)
        model.train()
        return out
    return model, loader(), evaluate, loss


TASKS = {"minilm": (_minilm, 150, 1e-4), "llama": (_llama, 300, 1e-3)}


def train_one(task: str, design: str, cfg: dict) -> dict:
    import hf_efficient as hfe

    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    build, steps, lr = TASKS[task]
    steps = cfg.get("steps") or steps
    torch.manual_seed(cfg.get("seed", 0))
    model, loader, evaluate, loss_fn = build(cfg)
    groups = hfe.build_param_groups(model, weight_decay=0.01)
    if design == "ao":
        from torchao.optim import AdamW4bit
        opt = AdamW4bit(groups, lr=lr, weight_decay=0.01)
    else:
        qm, qv, _ = _designs()[design]
        opt = FakeQuantAdamW(groups, lr=lr, weight_decay=0.01, qm=qm, qv=qv)
    schedule = _schedule(opt, steps)
    t0, step, curve = time.perf_counter(), 0, []
    model.train()
    while step < steps:
        for batch in loader:
            loss_fn(batch).backward()
            opt.step()
            schedule.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % (steps // 2) == 0 or step == steps:
                curve.append({"step": step, "eval_loss": evaluate()})
                print(f"[{task} {design}] step {step}: eval loss {curve[-1]['eval_loss']:.4f}", file=sys.stderr,
                      flush=True)
            if step == steps:
                break
    return {"task": task, "design": design, "description": _designs()[design][2], "steps": steps, "lr": lr,
            "final_loss": curve[-1]["eval_loss"], "curve": curve, "wall_s": round(time.perf_counter() - t0, 1),
            "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=["minilm", "llama", "both"], default="both")
    p.add_argument("--only", default="", help="comma-separated design labels (default: all but quant4)")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--steps", type=int, default=0, help="override each task's steps")
    p.add_argument("--eval-examples", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="the model's initialization, data order and masks")
    p.add_argument("--quick", action="store_true", help="4 steps, 64 eval paragraphs: a smoke test")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(train_one(args.worker[0], args.worker[1], json.loads(args.worker[2]))))
        return {}
    cfg = {"threads": args.threads, "steps": 4 if args.quick else args.steps,
           "eval_examples": 64 if args.quick else args.eval_examples, **({"seed": args.seed} if args.seed else {})}
    designs = [d for d in args.only.split(",") if d] or DEFAULT
    unknown = [d for d in designs if d not in _designs()]
    if unknown:
        raise SystemExit(f"unknown design {unknown[0]!r}; known: {', '.join(_designs())}")
    tasks = ["minilm", "llama"] if args.task == "both" else [args.task]
    jobs = [(t, d) for d in designs for t in tasks]
    t0, start = time.perf_counter(), machine()

    keep = args.out / "quant4_design_runs"  # each run's row as it ends: a later call with the same --out reuses it
    keep.mkdir(parents=True, exist_ok=True)

    def launch(job):
        seed = f"-seed{cfg['seed']}" if cfg.get("seed") else ""
        done = keep / f"{job[0]}-{job[1].replace(' ', '_').replace('+', '_')}{seed}.json"
        if done.exists() and json.loads(done.read_text()).get("config") == cfg:
            return json.loads(done.read_text())
        proc = subprocess.run([sys.executable, __file__, "--worker", job[0], job[1], json.dumps(cfg)],
                              capture_output=True, text=True)
        sys.stderr.write("".join(line + "\n" for line in proc.stderr.splitlines() if line.startswith("[")))
        if proc.returncode != 0:
            sys.stderr.write(f"{job} failed:\n{proc.stderr[-3000:]}\n")
            return {"task": job[0], "design": job[1], "error": proc.stderr.strip().splitlines()[-1]}
        row = {**json.loads(proc.stdout.strip().splitlines()[-1]), "config": cfg}
        done.write_text(json.dumps(row))
        return row

    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(launch, jobs))
    base = {r["task"]: r["final_loss"] for r in rows if r["design"] == "fp32" and "final_loss" in r}
    for r in rows:
        if "final_loss" in r and r["task"] in base:
            r["vs_fp32_pct"] = round(100 * (r["final_loss"] / base[r["task"]] - 1), 2)
    doc = {"command": command_line(__file__, argv), "machine": start, "loadavg_after": machine()["loadavg_1_5_15"],
           "wall_s": round(time.perf_counter() - t0, 1), "config": cfg, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"quant4_design_seed{args.seed}.json" if args.seed else "quant4_design.json"
    (args.out / name).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'task':7} {'design':14} {'final eval loss':>15} {'vs fp32':>8}")
    for r in rows:
        print(f"{r['task']:7} {r['design']:14} {r.get('final_loss', float('nan')):15.4f} "
              f"{r.get('vs_fp32_pct', float('nan')):+7.2f}%")
    return doc


if __name__ == "__main__":
    main()
