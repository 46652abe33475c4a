"""Training memory with and without gradient release (hf_efficient/release.py), on the examples' MiniLM fine-tune.

    python scripts/memory_release.py                          # all configurations, ~5 min on 2 cores
    python scripts/memory_release.py --quick --out /tmp/mem   # fewer configurations and repetitions

Writes ``memory_release.md`` (table, speed, machine), ``memory_release.json`` and ``memory_release.png`` into
``--out`` (default ``docs/results``).

Memory. Each configuration runs in its own process (peak RSS is per process): the bundled MiniLM (masked LM, 22.7M
parameters, lm head tied to the word embeddings) trains ``--steps`` steps of ``--batch`` paragraphs of Python's
documentation (examples/data.py: its model, texts and masking). On the last step (state allocated) the live bytes of weights + gradients + optimizer
state are summed at every parameter's post-accumulate-grad hook (registered before the release's, so the gradient in
flight counts), just before ``optimizer.step()`` and just after it; the table gives the peak of that sum, in bytes
per parameter, split into its three terms at the peak. Not counted: activations, the step's temporaries, the
allocator's slack: they are in the peak RSS column (the whole process, model loading included), and
``max_memory_allocated`` on a GPU. Baselines are built by transformers' own Trainer.create_optimizer
(``adamw_torch``, ``adamw_bnb_8bit``); gradient release applies to hf_eff_* names only.

Speed. The same model, two copies with the same name and weights, one released: full training steps (forward,
backward, step) alternate between them, ``--reps`` times after ``--warmup``; medians.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import RESULTS, command_line, fmt, machine, machine_md, md_table, median  # noqa: E402

import torch  # noqa: E402

# (key, weights, optim, optim_args, released): transformers' baselines first, then ours without / with release
CONFIGS = [
    ("adamw_torch", "fp32", "adamw_torch", "", False),
    ("adamw_bnb_8bit", "fp32", "adamw_bnb_8bit", "", False),
    ("hf_eff_adamw", "fp32", "hf_eff_adamw", "", False),
    ("hf_eff_adamw+release", "fp32", "hf_eff_adamw", "", True),
    ("hf_eff_adam8bit", "fp32", "hf_eff_adam8bit", "", False),
    ("hf_eff_adam8bit+release", "fp32", "hf_eff_adam8bit", "", True),
    ("hf_eff_adafactor", "fp32", "hf_eff_adafactor", "", False),
    ("hf_eff_adafactor+release", "fp32", "hf_eff_adafactor", "", True),
    ("bf16 hf_eff_adamw_bf16", "bf16", "hf_eff_adamw_bf16", "compensation=kahan", False),
    ("bf16 hf_eff_adamw_bf16+release", "bf16", "hf_eff_adamw_bf16", "compensation=kahan", True),
    ("bf16 hf_eff_adamw_bf16 stochastic+release", "bf16", "hf_eff_adamw_bf16", "compensation=stochastic", True),
    ("bf16 hf_eff_adam8bit kahan", "bf16", "hf_eff_adam8bit", "compensation=kahan", False),
    ("bf16 hf_eff_adam8bit kahan+release", "bf16", "hf_eff_adam8bit", "compensation=kahan", True),
    ("bf16 hf_eff_adam8bit stochastic+release", "bf16", "hf_eff_adam8bit", "compensation=stochastic", True),
    ("bf16 hf_eff_adam8bit stochastic, 8-bit embeddings+release", "bf16", "hf_eff_adam8bit",
     "compensation=stochastic,embedding_state=8bit", True),
]
LOWEST = "bf16 hf_eff_adam8bit stochastic, 8-bit embeddings+release"
QUICK = {"adamw_torch", "adamw_bnb_8bit", "hf_eff_adam8bit+release", LOWEST}
SPEED = [("hf_eff_adamw", None), ("hf_eff_adam8bit", None), ("hf_eff_adam8bit", 0)]  # (name, bucket_bytes)
LR, WD = 5e-5, 0.01


def _setup(weights: str, seq: int, batch: int, n_batches: int, device: str):
    """The examples' model and masked paragraphs (the first ones long enough: tokenizing all of them costs more than
    the run)."""
    from data import MLMCollator, load_model_and_tokenizer, load_texts

    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(dtype=torch.bfloat16 if weights == "bf16" else None)
    model.to(device).train()
    encoded = tok(load_texts()[:40 * batch * n_batches], truncation=True, max_length=seq)["input_ids"]
    train = [{"input_ids": ids} for ids in encoded if len(ids) >= seq // 2]
    collate = MLMCollator(tok, generator=torch.Generator().manual_seed(0))
    batches = [{k: v.to(device) for k, v in collate(train[i * batch:(i + 1) * batch]).items()}
               for i in range(n_batches)]
    return model, batches


def _optimizer(model, optim: str, optim_args: str, released: bool, out: str, bucket_bytes: int | None = None):
    """The optimizer transformers' Trainer would build for ``optim`` (decay groups, bnb's embedding override)."""
    from transformers import Trainer, TrainingArguments

    from hf_efficient import release

    args = TrainingArguments(out, optim=optim, optim_args=optim_args or None, learning_rate=LR, weight_decay=WD,
                             report_to=[], use_cpu=not torch.cuda.is_available(), max_grad_norm=0.0)
    opt = Trainer(model=model, args=args).create_optimizer()
    if released:
        release.check_trainer_args(args)
        release.attach(opt, **({} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}))
    return opt


class Tracker:
    """Peak of weights + gradients + optimizer state bytes over the events of one step."""

    def __init__(self, model, opt):
        from hf_efficient import optimizer_state_bytes

        self.params = list(model.parameters())
        self.weights = sum(p.numel() * p.element_size() for p in self.params)
        self.opt, self.state_bytes = opt, optimizer_state_bytes
        self.active, self.peak = False, None
        for p in self.params:  # before attach: runs before the release's hook, the gradient in flight counts
            p.register_post_accumulate_grad_hook(lambda p: self.event())

    def event(self):
        if not self.active:
            return
        grads = sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        total = (self.weights, grads, self.state_bytes(self.opt))
        if self.peak is None or sum(total) > sum(self.peak):
            self.peak = total


def worker(cfg: dict) -> dict:
    warnings.filterwarnings("ignore")
    key, weights, optim, optim_args, released = cfg["config"]
    device = cfg["device"]
    model, batches = _setup(weights, cfg["seq"], cfg["batch"], cfg["steps"], device)
    tracker = Tracker(model, None)  # hooks first, so they run before the release's
    opt = _optimizer(model, optim, optim_args, released, cfg["tmp"])
    tracker.opt = opt
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for i, batch in enumerate(batches):
        tracker.active = i == len(batches) - 1
        model(**batch).loss.backward()
        tracker.event()
        opt.step()
        tracker.event()
        opt.zero_grad(set_to_none=True)
    n = sum(p.numel() for p in tracker.params)
    weights_b, grads_b, state_b = tracker.peak
    return {"config": key, "weights": weights, "optim": optim, "optim_args": optim_args, "released": released,
            "params": n, "weights_bpp": weights_b / n, "grads_bpp": grads_b / n, "state_bpp": state_b / n,
            "total_bpp": (weights_b + grads_b + state_b) / n, "peak_rss_mib": resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss / 1024,
            "max_allocated_mib": torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None}


def speed(args) -> list[dict]:
    """Median training-step time of each name with and without release, steps of the two alternating."""
    warnings.filterwarnings("ignore")
    rows = []
    from hf_efficient.release import BUCKET_BYTES

    for optim, bucket in SPEED:
        arms = {}
        for released in (False, True):
            model, batches = _setup("fp32", args.seq, args.batch, 4, args.device)
            arms[released] = (model, _optimizer(model, optim, "", released, args.tmp, bucket), batches, [])
        for rep in range(args.warmup + args.reps):
            for released in ((False, True) if rep % 2 == 0 else (True, False)):
                model, opt, batches, times = arms[released]
                batch = batches[rep % len(batches)]
                t0 = time.perf_counter()
                model(**batch).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                if rep >= args.warmup:
                    times.append(time.perf_counter() - t0)
        base, rel = median(arms[False][3]) * 1e3, median(arms[True][3]) * 1e3
        rows.append({"optim": optim, "bucket_bytes": BUCKET_BYTES if bucket is None else bucket, "step_ms": base,
                     "release_step_ms": rel, "ratio": rel / base})
        del arms
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2, help="training steps per memory run (measured: the last)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128, help="max tokens per paragraph")
    p.add_argument("--reps", type=int, default=12, help="timed steps per arm")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help=f"only {sorted(QUICK)}, 4 timed steps")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.tmp = str(Path("/tmp") / "hf_eff_memory_release")
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.quick:
        args.reps = 4
    info = machine(args.device)
    rows = []
    for cfg in CONFIGS:
        if args.quick and cfg[0] not in QUICK:
            continue
        job = {"config": cfg, "device": args.device, "seq": args.seq, "batch": args.batch, "steps": args.steps,
               "tmp": args.tmp}
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True)
        if proc.returncode:
            rows.append({"config": cfg[0], "error": (proc.stderr.strip().splitlines() or ["?"])[-1]})
        else:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    speeds = speed(args)
    load_after = [round(x, 2) for x in __import__("os").getloadavg()]
    write(args.out, argv, info, load_after, rows, speeds, args)


def write(out: Path, argv, info, load_after, rows, speeds, args) -> None:
    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in rows if "error" not in r]
    base = next((r for r in ok if r["config"] == "adamw_torch"), None)
    table = [[r["config"], r["weights"], "yes" if r["released"] else "no", fmt(r["weights_bpp"]), fmt(r["grads_bpp"]),
              fmt(r["state_bpp"]), f"**{fmt(r['total_bpp'])}**", fmt(r["peak_rss_mib"], 0)]
             + ([fmt(r["max_allocated_mib"], 0)] if args.device.startswith("cuda") else []) for r in ok]
    heads = ["configuration", "weights", "release", "weights B/param", "gradients B/param (at peak)",
             "state B/param", "total B/param", "peak RSS MiB"] + (
        ["max_memory_allocated MiB"] if args.device.startswith("cuda") else [])
    lowest = min(ok, key=lambda r: r["total_bpp"]) if ok else None
    text = ["# Gradient release: training memory and step time", "",
            f"MiniLM masked-LM fine-tune (examples/data.py), {ok[0]['params'] / 1e6:.1f}M parameters, batch "
            f"{args.batch} x <= {args.seq} tokens, {args.device}. Command: `{command_line(__file__, argv)}`", "",
            machine_md(info, load_after), "",
            "Peak of live weights + gradients + optimizer state during the measured step (see the script's docstring "
            "for the method), bytes per parameter:", "", md_table(heads, table), ""]
    if lowest and base:
        text.append(f"Lowest: `{lowest['config']}` at {fmt(lowest['total_bpp'])} B/param, against "
                    f"{fmt(base['total_bpp'])} for fp32 AdamW ({fmt(base['total_bpp'] / lowest['total_bpp'], 1)}x "
                    "less). With release the gradient term is the largest single gradient in flight (the tied "
                    "word embedding), not the sum of all of them.")
    for r in rows:
        if "error" in r:
            text.append(f"\n- `{r['config']}` did not run here: {r['error']}")
    text += ["", "## Step time (forward + backward + step), median", "",
             md_table(["optimizer", "release bucket_bytes", "ordinary step ms", "with release ms",
                       "release / ordinary"],
                      [[s["optim"], s["bucket_bytes"], fmt(s["step_ms"], 1), fmt(s["release_step_ms"], 1),
                        fmt(s["ratio"], 3)] for s in speeds]),
             "", f"Target: release no more than 5% slower ({args.reps} timed steps per arm, alternating, after "
                 f"{args.warmup} warm-up steps)."]
    (out / "memory_release.md").write_text("\n".join(text) + "\n")
    (out / "memory_release.json").write_text(json.dumps(
        {"command": command_line(__file__, argv), "machine": info, "loadavg_after": load_after, "rows": rows,
         "speed": speeds}, indent=1))
    plot(out / "memory_release.png", ok, info)


def plot(path: Path, rows: list[dict], info: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.42 * len(rows) + 1.6))
    y = list(range(len(rows)))
    left = [0.0] * len(rows)
    for key, label, color in (("weights_bpp", "weights", "tab:blue"), ("grads_bpp", "gradients", "tab:red"),
                              ("state_bpp", "optimizer state", "tab:green")):
        vals = [r[key] for r in rows]
        ax.barh(y, vals, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, vals)]
    for yi, total in zip(y, left):
        ax.text(total + 0.1, yi, f"{total:.2f}", va="center", fontsize=8)
    ax.set_yticks(y, [r["config"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("peak live bytes per parameter during a training step (weights + gradients + optimizer state)")
    ax.legend(loc="lower right")
    ax.set_title(f"Gradient release, MiniLM {rows[0]['params'] / 1e6:.1f}M params on {info['cpu']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
