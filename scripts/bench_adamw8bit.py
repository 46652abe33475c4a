"""Step time of this package's 8-bit AdamW (torch backend: its C kernel on CPU, and its compiled kernel) beside
torch's fused fp32 AdamW and bitsandbytes' AdamW8bit (and torchao's, with --torchao), on tensors shaped like a
BERT-base layer and its embedding.

    python scripts/bench_adamw8bit.py                     # 768x768, 768x3072, 3072x768, 30522x768
    python scripts/bench_adamw8bit.py --threads 1 --reps 15
    python scripts/bench_adamw8bit.py --quick             # 1024x1024 only
    python scripts/bench_adamw8bit.py --bf16              # the 8-bit optimizers on bf16 weights

Method: one parameter per shape, fixed random gradients, every tensor 8-bit (``min_8bit_size=0``). After
warm-up (which compiles), each repetition runs one step of every optimizer in turn, starting at a different
one each time; medians and minima of wall time, ratios to fused fp32 AdamW. The machine may be shared:
compare the ratios, which are measured side by side, not absolute times across runs.

Writes ``bench_adamw8bit.json`` into ``--out`` (default ``docs/results``) and renders ``bench_adamw8bit.md`` from it
(``python scripts/render_results.py DIR/bench_adamw8bit.json`` renders it again).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import render_results  # noqa: E402
from _bench_common import RESULTS, command_line, machine, median  # noqa: E402

import torch  # noqa: E402

from hf_efficient.optim.adamw8bit import AdamW8bit  # noqa: E402

SHAPES = [(768, 768), (768, 3072), (3072, 768), (30522, 768)]


def _optimizers(shape, torchao: bool, dtype: torch.dtype = torch.float32) -> dict:
    def param(dtype=dtype):  # the 8-bit optimizers get ``dtype`` weights; the reference stays fp32
        g = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter((torch.randn(shape, generator=g) * 0.02).to(dtype))
        p.grad = (torch.randn(shape, generator=g) * 1e-3).to(dtype)
        return [p]

    out = {"torch fused fp32 AdamW": torch.optim.AdamW(param(torch.float32), lr=1e-3, fused=True),
           "hf_efficient AdamW8bit": AdamW8bit(param(), lr=1e-3, min_8bit_size=0),  # its C kernel on CPU
           "hf_efficient AdamW8bit, compile=True": AdamW8bit(param(), lr=1e-3, min_8bit_size=0, compile=True)}
    try:
        import bitsandbytes as bnb

        out["bitsandbytes AdamW8bit"] = bnb.optim.AdamW8bit(param(), lr=1e-3, min_8bit_size=0)
    except ImportError:
        pass
    if torchao:
        from torchao.optim import AdamW8bit as AoAdamW8bit

        out["torchao AdamW8bit"] = AoAdamW8bit(param(), lr=1e-3)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one 1024x1024 tensor")
    ap.add_argument("--torchao", action="store_true", help="also torchao's AdamW8bit (~30 s compile per shape)")
    ap.add_argument("--bf16", action="store_true", help="bf16 weights and gradients for the 8-bit optimizers")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine()
    rows = []
    for shape in [(1024, 1024)] if args.quick else SHAPES:
        opts = _optimizers(shape, args.torchao, torch.bfloat16 if args.bf16 else torch.float32)
        for opt in opts.values():
            for _ in range(args.warmup):
                opt.step()
        times = {name: [] for name in opts}
        names = list(opts)
        for r in range(args.reps):
            for name in names[r % len(names):] + names[: r % len(names)]:
                t = time.perf_counter()
                opts[name].step()
                times[name].append(time.perf_counter() - t)
        base = median(times[names[0]])
        for name in names:
            med = median(times[name])
            rows.append({"shape": f"{shape[0]}x{shape[1]}", "optimizer": name, "median_ms": med * 1e3,
                         "min_ms": min(times[name]) * 1e3, "ratio": med / base, "samples_s": times[name]})
        del opts
    config = {k: getattr(args, k) for k in ("threads", "reps", "warmup", "quick", "torchao")}
    config["dtype"] = "bfloat16" if args.bf16 else "float32"
    print(render_results.write(args.out, "bench_adamw8bit", {
        "command": command_line(__file__, sys.argv[1:] if argv is None else argv), "machine": info, "config": config,
        "rows": rows}))


if __name__ == "__main__":
    main()
