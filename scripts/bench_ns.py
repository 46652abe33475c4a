"""Newton-Schulz's achieved throughput against a plain batched matmul of the same shapes (issue 33's speed goal:
at least 80% of it), on the Muon matrices of one layer of the 1.23B bench model (hidden 2048, MLP 5632).

Muon orthogonalises same-shaped matrices together (``optim/muon.py``'s ``newton_schulz_``: per step ``A = X X^T``,
``B = b A + c A A``, ``X = a X + B X``): per matrix of ``r x c`` (``r <= c``; a taller one is transposed) a step is
``4 r^2 c + 2 r^3`` flops. The reference is ``torch.bmm(X, X^T)`` on the same batch and dtype (``2 r^2 c`` flops):
what this device's matmul reaches on these shapes. Interleaved repetitions, median times, the ratio of the two
rates per batch and over the layer.

    python scripts/bench_ns.py                    # CPU, bf16 (Muon's default ns_dtype), one layer
    python scripts/bench_ns.py --device cuda --layers 24
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import RESULTS, command_line, machine, median  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_efficient.optim.muon import NS_STEPS, newton_schulz_  # noqa: E402


def batches(hidden: int, ffn: int, layers: int) -> dict[str, tuple[int, int, int]]:
    """A Llama layer's Muon matrices by shape, as (count, rows, cols) with rows <= cols: q, k, v, o (hidden x
    hidden); gate, up (ffn x hidden, orthogonalised transposed) and down (hidden x ffn)."""
    return {"attention q/k/v/o": (4 * layers, hidden, hidden), "MLP gate/up/down": (3 * layers, hidden, ffn)}


def _time(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for label, (n, r, c) in batches(args.hidden, args.ffn, args.layers).items():
        grads = torch.randn(n, r, c, generator=gen).to(device=device, dtype=dtype)
        work, gram = torch.empty_like(grads), torch.empty(n, r, r, device=device, dtype=dtype)
        ns = lambda: newton_schulz_(work.copy_(grads))  # noqa: E731  (the copy: a step's stack, as muon() fills it)
        ref = lambda: torch.bmm(grads, grads.mT, out=gram)  # noqa: E731
        ns(), ref()  # warm-up
        t_ns, t_ref = [], []
        for i in range(args.reps):
            for fn, out in ((ns, t_ns), (ref, t_ref)) if i % 2 == 0 else ((ref, t_ref), (ns, t_ns)):
                out.append(_time(fn, device))
        flops_ns = n * NS_STEPS * (4 * r * r * c + 2 * r ** 3)
        flops_ref = n * 2 * r * r * c
        rows.append({"batch": label, "count": n, "rows": r, "cols": c, "ns_ms": 1e3 * median(t_ns),
                     "matmul_ms": 1e3 * median(t_ref), "ns_tflops": flops_ns / median(t_ns) / 1e12,
                     "matmul_tflops": flops_ref / median(t_ref) / 1e12, "ns_flops": flops_ns, "matmul_flops": flops_ref})
        rows[-1]["ratio"] = rows[-1]["ns_tflops"] / rows[-1]["matmul_tflops"]
    total_ns = sum(r["ns_flops"] for r in rows) / sum(r["ns_ms"] for r in rows) / 1e9
    total_ref = sum(r["matmul_flops"] for r in rows) / sum(r["matmul_ms"] for r in rows) / 1e9
    doc = {"command": command_line("bench_ns.py", sys.argv[1:] if argv is None else argv),
           "machine": machine(args.device), "config": {k: v for k, v in vars(args).items() if k != "out"} | {
               "ns_steps": NS_STEPS, "torch_threads": torch.get_num_threads()},
           "rows": rows, "layer": {"ns_tflops": total_ns, "matmul_tflops": total_ref, "ratio": total_ns / total_ref}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_ns.json").write_text(json.dumps(doc, indent=1))
    import render_results

    render_results.render(args.out / "bench_ns.json")
    for r in rows:
        print(f"{r['batch']} ({r['count']} x {r['rows']} x {r['cols']}): Newton-Schulz {r['ns_tflops']:.3f} TFLOP/s, "
              f"matmul {r['matmul_tflops']:.3f}: {r['ratio']:.2f}")
    print(f"layer: {doc['layer']['ratio']:.2f} of the matmul's rate")
    return doc


if __name__ == "__main__":
    main()
