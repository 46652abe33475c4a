"""A/B of the AdamW 8-bit C kernel: a git revision's source against the working tree's, in one process.

``bench_step.py`` compares optimizers; on a shared machine its run-to-run noise hides a few percent. Here both
kernels are built with the package's flags, called through ctypes on the same tensors (one thread), alternately, and
timed by the calling thread's CPU time: the ratio new / old per pair, its median and interquartile range.

    python scripts/ab_c_kernel.py --old 78cc98c --dtype float32 --reps 40

The old source may predate the drivers (commit 8c7d629), whose kernel took each moment's codes and absmaxes as
separate arguments; both signatures are handled.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hf_efficient.optim import _native, quant8  # noqa: E402

SOURCE = "hf_efficient/optim/adamw8bit_cpu.c"


def build(src_dir: Path, out: Path) -> ctypes.CDLL:
    cc = _native.c_compiler()
    subprocess.run([cc, *_native._FLAGS, _native._OPENMP, str(src_dir / SOURCE), "-o", str(out), "-lm"], check=True)
    fn = ctypes.CDLL(str(out)).adamw8bit_step
    fn.restype = None
    fn.split_moments = "uint32_t *const *wm" in (src_dir / SOURCE).read_text()  # before the drivers
    return fn


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="git revision of the old source")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--numel", type=int, default=1 << 21, help="elements per tensor (a multiple of 256)")
    p.add_argument("--reps", type=int, default=40, help="timed pairs")
    args = p.parse_args(argv)
    dtype, n, numel = getattr(torch, args.dtype), args.tensors, args.numel
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        old_dir = tmp / "old"
        old_dir.mkdir()
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", args.old, "hf_efficient/optim"], check=True,
                             capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old_dir)], input=tar, check=True)
        fns = {"old": build(old_dir, tmp / "old.so"), "new": build(ROOT, tmp / "new.so")}
        torch.manual_seed(0)
        ptrs = lambda ts: (ctypes.c_void_p * len(ts))(*[t.data_ptr() for t in ts])  # noqa: E731
        ps = [torch.randn(numel).to(dtype) for _ in range(n)]
        gs = [(torch.randn(numel) * 1e-3).to(dtype) for _ in range(n)]
        blocks = numel // quant8.BLOCK
        words = [[torch.full((blocks * 64,), 0x7F7F7F7F, dtype=torch.int32) for _ in range(n)],
                 [torch.zeros(blocks * 64, dtype=torch.int32) for _ in range(n)]]
        absmax = [[torch.zeros(blocks) for _ in range(n)] for _ in range(2)]
        maps = quant8.c_tables()
        coef = torch.tensor([0.9, 0.1, 0.999, 0.001, 1.0, 1e-8, 0.99999, 1e-4] * n, dtype=torch.float32)
        common = ((ctypes.c_int64 * n)(*[numel] * n), (ctypes.c_int32 * n)(*[int(dtype == torch.bfloat16)] * n),
                  (ctypes.c_void_p * n)(*[None] * n), (ctypes.c_int32 * n)(*range(n)),
                  ctypes.c_int(1 if dtype == torch.bfloat16 else 2),  # stochastic on bf16 weights, none on fp32
                  ctypes.c_void_p(maps.data_ptr()), ctypes.c_void_p(coef.data_ptr()), ctypes.c_int64(0),
                  ctypes.c_int64(n * blocks), ctypes.c_int(1))

        def call(tag: str) -> float:
            fn = fns[tag]
            moments = ((ptrs(words[0]), ptrs(words[1]), ptrs(absmax[0]), ptrs(absmax[1])) if fn.split_moments
                       else (ptrs(words[0] + words[1]), ptrs(absmax[0] + absmax[1])))
            start = time.thread_time()
            fn(ctypes.c_int64(n), ptrs(ps), ptrs(gs), *moments, *common)
            return time.thread_time() - start

        for _ in range(3):
            call("old"), call("new")
        ratios = []
        for r in range(args.reps):
            t = {tag: call(tag) for tag in (("old", "new") if r % 2 else ("new", "old"))}
            ratios.append(t["new"] / t["old"])
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    out = {"old": args.old, "dtype": args.dtype, "pairs": len(ratios), "median": statistics.median(ratios),
           "iqr": [q[0], q[2]]}
    print(f"adamw8bit_step {args.dtype}, working tree / {args.old}: CPU time median {out['median']:.3f} "
          f"(IQR {q[0]:.3f}-{q[2]:.3f}), {len(ratios)} pairs")
    return out


if __name__ == "__main__":
    main()
