"""Static machine-code counts of the 8-bit Triton kernels, for judging a compute-bound kernel without a GPU.

    python scripts/triton_sass.py [--out docs/results/triton_sass.json] [--jobs 2]

Compiles every variant of ``blockwise_triton``'s kernels that a step launches (``adamw8bit_kernel`` and
``lion8bit_kernel``; fp32 weights, bf16 weights under each compensation, fp16 weights; 16-byte aligned tensors, the
usual case) ahead of time for Hopper (``sm_90``, through ``tests/triton_helpers.compile_for_hopper``: Triton's wheel
carries ptxas, no GPU needed) and writes, per variant, the count of each SASS opcode and the instructions per
element. A developer tool: no rendering, no timing.

Instructions per element: the kernel's static instruction count over the elements one thread steps per program
(``NB * 256 / (32 * num_warps)``) and over 2, the bodies each kernel holds (whole blocks, and the tensor's last,
partial program: nearly the same code). A static count, an estimate of the executed one, comparable between versions
of the same kernels: a loop's body counts once (``pow_int``'s, over the step's bits, runs ~log2(step) times per
program), slow paths never taken count (correctly rounded division's and square root's), and per-program work the
compiler hoists out of both bodies (the bias corrections) counts half of its share at run time.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import REPO, RESULTS, command_line  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from triton_helpers import compile_for_hopper, signature_8bit  # noqa: E402

from hf_efficient.optim import blockwise_triton as B  # noqa: E402

KERNELS = ("adamw8bit_kernel", "lion8bit_kernel")
MODES = {"kahan": 0, "stochastic": 1, "none": 2}  # _triton.C_MODES
VARIANTS = [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "kahan"), ("bfloat16", "stochastic"),
            ("float16", "kahan"), ("float16", "stochastic")]
BODIES = 2  # each kernel's whole-block and partial-block programs (blockwise_triton: FULL True / False)


def count(kernel: str, dtype: str, mode: str) -> dict:
    """Opcode counts and instructions per element of one variant, as ``compile_for_hopper`` builds it."""
    info = compile_for_hopper("hf_efficient.optim.blockwise_triton", kernel, signature_8bit(kernel),
                              {"MODE": MODES[mode], "OUT": f"tl.{dtype}", "GRAD": f"tl.{dtype}", "NB": B.NB,
                               "ALIGNED": True}, sass=True)
    per_thread = B.NB * 256 // (32 * info["num_warps"])
    total = sum(info["sass"].values())
    return {"kernel": kernel, "weights": dtype, "compensation": mode, "num_warps": info["num_warps"],
            "elements_per_thread": per_thread, "instructions": total,
            "per_element": round(total / (BODIES * per_thread), 1),
            "opcodes": dict(sorted(info["sass"].items(), key=lambda kv: -kv[1]))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "triton_sass.json")
    parser.add_argument("--jobs", type=int, default=2, help="compilations in parallel (each a subprocess)")
    args = parser.parse_args(argv)
    jobs = [(k, d, m) for k in KERNELS for d, m in VARIANTS]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda job: count(*job), jobs))
    import triton

    result = {"command": command_line(__file__, argv if argv is not None else sys.argv[1:]), "target": "sm_90",
              "triton": triton.__version__, "NB": B.NB, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(f"{r['kernel']:17} {r['weights']:9} {r['compensation']:10} {r['per_element']:6} per element")
    return result


if __name__ == "__main__":
    main()
