"""Static machine-code counts of the optimizer steps' Triton kernels, for judging a compute-bound kernel without a GPU.

    python scripts/triton_sass.py [--out docs/results/triton_sass.json] [--jobs 2] [--kernels adamw8bit_kernel ...]

Compiles every variant of each step kernel that a step launches (``blockwise_triton``'s 8-bit kernels,
``lion_triton``'s, ``adamw_triton``'s fp32-state and bf16-state kernels: fp32 weights, bf16 weights under each
compensation, fp16 weights; Adafactor's update pass on three of its variants; 16-byte aligned tensors, the usual case)
ahead of time for Hopper (``sm_90``, through ``tests/triton_helpers.compile_for_hopper``: Triton's wheel carries
ptxas, no GPU needed) and writes, per variant, the count of each SASS opcode and the instructions per element. A
developer tool: no rendering, no timing.

Instructions per element: the kernel's static instruction count over the elements one thread steps per program (or
per tile) and over the bodies it holds (whole blocks and a tensor's last, partial one: nearly the same code, 2; the
update pass's masked tile, 1). A static count, an estimate of the executed one, comparable between versions of the
same kernels: a loop's body counts once, slow paths never taken count (correctly rounded division's and square
root's), and per-program work the compiler hoists out of both bodies counts half of its share at run time.
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
from triton_helpers import compile_for_hopper, signature_8bit, signature_adamw, signature_adafactor_update  # noqa: E402

from hf_efficient.optim import adafactor_triton as AF  # noqa: E402
from hf_efficient.optim import adamw_triton as AW  # noqa: E402
from hf_efficient.optim import blockwise_triton as B  # noqa: E402
from hf_efficient.optim import lion_triton as LT  # noqa: E402

MODES = {"kahan": 0, "stochastic": 1, "none": 2}  # _triton.C_MODES
VARIANTS = [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "kahan"), ("bfloat16", "stochastic"),
            ("float16", "kahan"), ("float16", "stochastic")]
# kernel -> (module, warps, elements a thread steps per program or tile, bodies, weight variants)
KERNELS = {
    "adamw8bit_kernel": ("blockwise_triton", B.NUM_WARPS, B.NB * 256 // (32 * B.NUM_WARPS), 2, VARIANTS),
    "lion8bit_kernel": ("blockwise_triton", B.NUM_WARPS, B.NB * 256 // (32 * B.NUM_WARPS), 2, VARIANTS),
    "lion_kernel": ("lion_triton", 4, LT.BLOCK // (32 * 4), 2, VARIANTS),
    "fp32_state_kernel": ("adamw_triton", AW.NUM_WARPS, AW.BLOCK // (32 * AW.NUM_WARPS), 2, VARIANTS),
    "bf16_state_kernel": ("adamw_triton", AW.NUM_WARPS, AW.BLOCK // (32 * AW.NUM_WARPS), 2, VARIANTS[1:]),
    "_update_kernel": ("adafactor_triton", 8, 4 * AF._WIDE // (32 * 8), 1,
                       [("float32", "none"), ("bfloat16", "kahan"), ("bfloat16", "stochastic")]),
}


def _compile_args(kernel: str, dtype: str) -> tuple[dict, dict]:
    """The signature and the constexprs (but MODE) of ``kernel`` on ``dtype`` weights, as a step launches it."""
    tl_dtype = f"tl.{dtype}"
    if kernel in ("adamw8bit_kernel", "lion8bit_kernel"):
        return signature_8bit(kernel), {"OUT": tl_dtype, "GRAD": tl_dtype, "NB": B.NB, "ALIGNED": True}
    if kernel == "lion_kernel":
        return signature_8bit(kernel), {"OUT": tl_dtype, "GRAD": tl_dtype, "BLOCK": LT.BLOCK, "ALIGNED": True}
    if kernel == "_update_kernel":
        return signature_adafactor_update(), {"PDT": tl_dtype, "GDT": "tl.bfloat16", "HAS_EA": False,
                                              "ALIGNED": True, "BR": 4, "BC": AF._WIDE, "PART": AF._PART}
    grad = tl_dtype if kernel == "fp32_state_kernel" else "tl.bfloat16"  # AdamWBF16 steps bf16 gradients
    extra = {"KEYED": False} if kernel == "fp32_state_kernel" else {}
    return signature_adamw(kernel), {"OUT": tl_dtype, "GRAD": grad, "ALIGNED": True, "BLOCK": AW.BLOCK,
                                     "BLOCKS": AW.BLOCKS, **extra}


def count(kernel: str, dtype: str, mode: str) -> dict:
    """Opcode counts and instructions per element of one variant, as ``compile_for_hopper`` builds it."""
    module, warps, per_thread, bodies, _ = KERNELS[kernel]
    signature, constexprs = _compile_args(kernel, dtype)
    info = compile_for_hopper(f"hf_efficient.optim.{module}", kernel, signature, {"MODE": MODES[mode], **constexprs},
                              sass=True, num_warps=warps)
    total = sum(info["sass"].values())
    return {"kernel": kernel, "weights": dtype, "compensation": mode, "num_warps": info["num_warps"],
            "elements_per_thread": per_thread, "instructions": total, "registers": info["regs"],
            "per_element": round(total / (bodies * per_thread), 1),
            "opcodes": dict(sorted(info["sass"].items(), key=lambda kv: -kv[1]))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "triton_sass.json")
    parser.add_argument("--jobs", type=int, default=2, help="compilations in parallel (each a subprocess)")
    parser.add_argument("--kernels", nargs="+", choices=sorted(KERNELS), default=list(KERNELS))
    args = parser.parse_args(argv)
    jobs = [(k, d, m) for k in args.kernels for d, m in KERNELS[k][4]]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda job: count(*job), jobs))
    import triton

    result = {"command": command_line(__file__, argv if argv is not None else sys.argv[1:]), "target": "sm_90",
              "triton": triton.__version__, "NB": B.NB, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(f"{r['kernel']:17} {r['weights']:9} {r['compensation']:10} {r['per_element']:6} per element "
              f"({r['instructions']} instructions, {r['registers']} registers)")
    return result


if __name__ == "__main__":
    main()
