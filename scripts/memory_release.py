"""Training memory with and without gradient release (hf_efficient/release.py), on two models.

    python scripts/memory_release.py                          # both models, all configurations, ~15 min on 2 cores
    python scripts/memory_release.py --quick --out /tmp/mem   # fewer configurations and repetitions
    python scripts/memory_release.py --models llama           # one model

Writes ``memory_release.json`` (the measurements) into ``--out`` (default ``docs/results``), then renders
``memory_release.md`` (a table per model, speed, machine) and ``memory_release.png`` from it
(``python scripts/render_results.py docs/results/memory_release.json`` renders them again).

Models. ``minilm``: the examples' MiniLM fine-tune (examples/data.py: masked LM, 22.7M parameters, its lm head tied to
the word embeddings: one tensor of 52% of the parameters, whose gradient lives through the whole backward).
``llama``: a randomly initialised, untied ``LlamaForCausalLM`` built from a ``LlamaConfig`` (nothing downloaded;
hidden 1024, 16 layers, MLP 2816, vocabulary 4096: 214M parameters), shaped like a real LLM, whose largest tensors
(embedding, lm head) are 2.0% of the parameters each (Llama-7B: 2.0%); causal LM on the same documentation text,
tokenized by :func:`_llama_tokens`. What gradient release leaves of the gradients is about the largest tensor, so the
second model shows what it leaves on an LLM.

Memory. Each configuration runs in its own process (peak RSS is per process) and trains ``--steps`` steps of
``--batch`` sequences of at most ``--seq`` tokens of Python's documentation. On the last step (state allocated) the
live bytes of weights + gradients + optimizer state are summed at every parameter's post-accumulate-grad hook
(registered before the release's, so the gradient in flight counts), just before ``optimizer.step()`` and just after
it; the table gives the peak of that sum, in bytes per parameter, split into its three terms at the peak. Not
counted: activations, the step's temporaries, the allocator's slack: they are in the peak RSS column (the whole
process, model loading included), and ``max_memory_allocated`` on a GPU. Baselines are built by transformers' own
Trainer.create_optimizer (``adamw_torch``, ``adamw_bnb_8bit``); gradient release applies to hf_eff_* names only.

Speed (MiniLM, the examples' model). Two copies with the same name and weights, one released: full training steps
(forward, backward, step) alternate between them, ``--reps`` times after ``--warmup``; medians.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import render_results  # noqa: E402
from _bench_common import RESULTS, command_line, machine, median  # noqa: E402

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
    # the 24 GB recipe (README): bf16 weights, 4-bit state everywhere, released gradients
    ("bf16 hf_eff_adam4bit stochastic, 4-bit embeddings+release", "bf16", "hf_eff_adam4bit",
     "compensation=stochastic,embedding_state=4bit", True),
]
LOWEST8 = "bf16 hf_eff_adam8bit stochastic, 8-bit embeddings+release"
LOWEST = "bf16 hf_eff_adam4bit stochastic, 4-bit embeddings+release"
QUICK = {"adamw_torch", "adamw_bnb_8bit", "hf_eff_adam8bit+release", LOWEST8, LOWEST}
# the Llama runs are ~10x MiniLM's: the baselines, ours with / without release, the lowest and the steps to it
LLAMA_CONFIGS = {"adamw_torch", "adamw_bnb_8bit", "hf_eff_adamw+release", "hf_eff_adam8bit", "hf_eff_adam8bit+release",
                 "bf16 hf_eff_adam8bit stochastic+release", LOWEST8, LOWEST}
# LlamaConfig of the second model: Llama's shapes (untied, SwiGLU MLP ~2.75x hidden) at 214M parameters, largest
# tensor 2.0% of them as in Llama-7B (embedding 32000 x 4096 of 6.7B); sdpa attention, no score matrices kept
LLAMA = {"vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16,
         "num_attention_heads": 16, "num_key_value_heads": 16, "tie_word_embeddings": False}
SPEED = [("hf_eff_adamw", None), ("hf_eff_adam8bit", None), ("hf_eff_adam8bit", 0)]  # (name, bucket_bytes)
LR, WD = 5e-5, 0.01
MODELS = ("minilm", "llama")  # see the module docstring


def _setup(model_name: str, weights: str, seq: int, batch: int, n_batches: int, device: str):
    """Model ``model_name`` (see the module docstring) in ``weights``, and ``n_batches`` training batches."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if weights == "bf16" else None
    model, batches = (_llama if model_name == "llama" else _minilm)(dtype, seq, batch, n_batches)
    model.to(device).train()
    return model, [{k: v.to(device) for k, v in b.items()} for b in batches]


def _minilm(dtype, seq: int, batch: int, n_batches: int):
    """The examples' model and masked paragraphs (the first ones long enough: tokenizing all of them costs more than
    the run)."""
    from data import MLMCollator, load_model_and_tokenizer, load_texts

    model, tok = load_model_and_tokenizer(dtype=dtype)
    encoded = tok(load_texts()[:40 * batch * n_batches], truncation=True, max_length=seq)["input_ids"]
    train = [{"input_ids": ids} for ids in encoded if len(ids) >= seq // 2]
    collate = MLMCollator(tok, generator=torch.Generator().manual_seed(0))
    return model, [collate(train[i * batch:(i + 1) * batch]) for i in range(n_batches)]


def _llama_tokens(vocab: int) -> list[int]:
    """Python's documentation as one stream of token ids: each of the ``vocab - 256`` most frequent words (with its
    leading space) or punctuation runs is one token, anything else its UTF-8 bytes (ids 0-255). Real text and a
    vocabulary of a few thousand, with no tokenizer to download."""
    from data import load_texts

    split = re.compile(r" ?\w+| ?[^\w\s]+|\s+")
    pieces = split.findall("\n\n".join(load_texts()))
    ids = {w: 256 + i for i, (w, _) in enumerate(collections.Counter(pieces).most_common(vocab - 256))}
    return [i for w in pieces for i in ((ids[w],) if w in ids else w.encode())]


def _llama(dtype, seq: int, batch: int, n_batches: int):
    """A randomly initialised, untied LlamaForCausalLM of :data:`LLAMA`'s shapes, and full windows of ``seq`` tokens
    of the documentation (next-token loss)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM._from_config(LlamaConfig(**LLAMA, max_position_embeddings=seq),
                                          dtype=dtype or torch.float32)
    stream = torch.tensor(_llama_tokens(LLAMA["vocab_size"])[:n_batches * batch * seq]).view(n_batches, batch, seq)
    return model, [{"input_ids": ids, "labels": ids} for ids in stream]


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
    model, batches = _setup(cfg["model"], weights, cfg["seq"], cfg["batch"], cfg["steps"], device)
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
    largest, big = max(model.named_parameters(), key=lambda np_: np_[1].numel())
    weights_b, grads_b, state_b = tracker.peak
    return {"model": cfg["model"], "config": key, "weights": weights, "optim": optim, "optim_args": optim_args,
            "released": released, "params": n, "largest_tensor": largest, "largest_share": big.numel() / n,
            "weights_bpp": weights_b / n, "grads_bpp": grads_b / n, "state_bpp": state_b / n,
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
            model, batches = _setup("minilm", "fp32", args.seq, args.batch, 4, args.device)
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
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: minilm, llama (module docstring)")
    p.add_argument("--steps", type=int, default=2, help="training steps per memory run (measured: the last)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128, help="max tokens per sequence")
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
    models = args.models.split(",")
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        p.error(f"--models {args.models!r}: unknown {unknown}; choose from {sorted(MODELS)}")
    if args.quick:
        args.reps = 4
    info = machine(args.device)
    rows = []
    for model in models:
        for cfg in CONFIGS:
            if (args.quick and cfg[0] not in QUICK) or (model == "llama" and cfg[0] not in LLAMA_CONFIGS):
                continue
            job = {"model": model, "config": cfg, "device": args.device, "seq": args.seq, "batch": args.batch,
                   "steps": args.steps, "tmp": args.tmp}
            proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True,
                                  text=True)
            if proc.returncode:
                rows.append({"model": model, "config": cfg[0],
                             "error": (proc.stderr.strip().splitlines() or ["?"])[-1]})
            else:
                rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    speeds = speed(args)
    from hf_efficient.release import BUCKET_BYTES

    config = {k: getattr(args, k) for k in ("models", "steps", "batch", "seq", "reps", "warmup", "quick", "device")}
    print(render_results.write(args.out, "memory_release", {
        "command": command_line(__file__, argv), "machine": info,
        "loadavg_after": [round(x, 2) for x in __import__("os").getloadavg()],
        "config": {**config, "bucket_bytes": BUCKET_BYTES}, "rows": rows, "speed": speeds}))


if __name__ == "__main__":
    main()
