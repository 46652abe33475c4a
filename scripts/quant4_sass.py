"""Static machine-code counts of the 4-bit codec's Triton functions, for judging them without a GPU.

    python scripts/quant4_sass.py [--out docs/results/quant4_sass.json]

Compiles ``tests/_quant4_test_kernels.moments_kernel`` (both moments of a 4-bit AdamW state decoded, updated with a
gradient and encoded again, no weight: the codec's share of a step) and ``step_kernel`` (the same with AdamW's update
of fp32 weights: a whole step, whose ``sqrt(v)`` the encoder shares) ahead of time for Hopper (``sm_90``, through
``tests/triton_helpers.compile_for_hopper``: no GPU needed) and writes the count of each SASS opcode and the
instructions per element: the static count over the elements one thread handles (``NB * 128 / (32 * num_warps)``),
an estimate comparable between versions, not a timing (as ``scripts/triton_sass.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import REPO, RESULTS, command_line  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from triton_helpers import compile_for_hopper  # noqa: E402

NB = 32  # blocks per program: 4096 elements, 32 a thread at 4 warps (8 rows of 4 blocks in one column)
SIGNATURE = {"wm_ptr": "*i32", "am_ptr": "*fp32", "wv_ptr": "*i32", "av_ptr": "*fp32", "g_ptr": "*fp32",
             "map_ptr": "*fp32", "b1": "fp32", "omb1": "fp32", "b2": "fp32", "omb2": "fp32", "nblocks": "i32",
             "NB": "constexpr"}


STEP = {"p_ptr": "*fp32", **SIGNATURE, "inv_bc2": "fp32", "eps": "fp32", "decay": "fp32", "step_size": "fp32"}
STEP = {k: STEP[k] for k in ["p_ptr", *list(SIGNATURE)[:-2], "inv_bc2", "eps", "decay", "step_size", "nblocks", "NB"]}


def count(kernel: str = "moments_kernel", nb: int = NB, num_warps: int = 4) -> dict:
    """Opcode counts, registers and instructions per element of ``kernel`` (``moments_kernel`` or ``step_kernel``)."""
    info = compile_for_hopper("_quant4_test_kernels", kernel, SIGNATURE if kernel == "moments_kernel" else STEP,
                              {"NB": nb}, sass=True, num_warps=num_warps)
    per_thread = nb * 128 // (32 * info["num_warps"])
    total = sum(info["sass"].values())
    return {"kernel": kernel, "NB": nb, "num_warps": info["num_warps"], "elements_per_thread": per_thread,
            "instructions": total, "per_element": round(total / per_thread, 1), "regs": info["regs"],
            "opcodes": dict(sorted(info["sass"].items(), key=lambda kv: -kv[1]))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "quant4_sass.json")
    args = parser.parse_args(argv)
    import triton

    rows = [count(k) for k in ("moments_kernel", "step_kernel")]
    result = {"command": command_line(__file__, argv if argv is not None else sys.argv[1:]), "target": "sm_90",
              "triton": triton.__version__, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for row in rows:
        print(f"{row['kernel']}: {row['per_element']} instructions per element ({row['instructions']} for "
              f"{row['elements_per_thread']} elements a thread), {row['regs']} registers")
    return result


if __name__ == "__main__":
    main()
