"""Helpers of the Triton kernels' tests: run them on CPU under the interpreter, compile them for a GPU.

Two checks no GPU is needed for: the kernel code itself runs on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, set by conftest), and it compiles, ahead of time, to Hopper machine code (``sm_90``: the
interpreter accepts things the compiler refuses, such as a global that is not a ``tl.constexpr``).
"""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton", reason="the Triton kernels' tests need triton (pip install triton numpy)")

from hf_efficient.optim import _triton  # noqa: E402

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="runs the kernels on CPU under TRITON_INTERPRET=1")


@pytest.fixture
def on_cpu():
    """The Triton kernels take CPU tensors (interpreter) for the test, and only for it."""
    _triton.interpret_on_cpu(True)
    yield
    _triton.interpret_on_cpu(False)


_AOT = r"""
import json, sys, importlib
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name, signature, constexprs, *num_warps = json.loads(sys.argv[1])
kernel = getattr(importlib.import_module(module), name)
constexprs = {k: eval(v, {"tl": tl}) if isinstance(v, str) else v for k, v in constexprs.items()}
compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"enable_fp_fusion": False, "num_warps": (num_warps or [4])[0]})
info = {"shared": compiled.metadata.shared, "ptx": len(compiled.asm["ptx"]), "cubin": len(compiled.asm["cubin"]),
        "num_warps": compiled.metadata.num_warps}
if len(sys.argv) > 2:  # nvdisasm's lines: scheduling fields, a tab, [@predicate] OPCODE.modifiers operands;
    info["sass"] = {}
    for line in compiled.asm["sass"].splitlines():
        words = line.split("\t", 1)[1].split() if "\t" in line else []
        words = words[1:] if words and words[0].startswith("@") else words
        if words:
            op = words[0].rstrip(";").split(".")[0]
            info["sass"][op] = info["sass"].get(op, 0) + 1
    import re, subprocess, tempfile  # registers per thread (they bound the warps an SM holds): cuobjdump's
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True,
                               text=True)
    found = re.search(r"REG:(\d+)", usage.stdout)
    assert found, usage.stdout + usage.stderr
    info["regs"] = int(found.group(1))
print(json.dumps(info))
"""


def compile_for_hopper(module: str, kernel: str, signature: dict, constexprs: dict, sass: bool = False,
                       num_warps: int = 4) -> dict:
    """Compile ``module.kernel`` ahead of time for sm_90 (no GPU needed: Triton's wheel carries ptxas), in a
    subprocess without the interpreter; returns its sizes (shared memory bytes, PTX and cubin lengths, ``num_warps``)
    and, with ``sass``, the static count of each machine instruction's opcode (``{"FSEL": 36, ...}``: for judging a
    compute-bound kernel without a GPU; loops count once) and ``regs``, the registers a thread uses (they bound how
    many warps an SM holds to hide latency). ``num_warps``: the launch's. ``signature``: argument -> Triton type
    ("*bf16", "i32", "fp32", "constexpr"); ``constexprs``: values, dtypes written as strings ("tl.bfloat16").

    Raises:
        AssertionError: the compiler's error, whole.
    """
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), *filter(None, [env.get("PYTHONPATH")])])
    run = subprocess.run([sys.executable, "-c", _AOT, json.dumps([module, kernel, signature, constexprs, num_warps]),
                          *(["sass"] if sass else [])],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def signature_8bit(kernel: str) -> dict:
    """The argument types of ``blockwise_triton``'s 8-bit kernels (or ``lion_triton.lion_kernel``) for
    :func:`compile_for_hopper`."""
    head = {"table": "*i64", "info": "*i64", "flag_ptr": "*fp32", "count": "i32"}
    if kernel == "lion_kernel":
        scalars = "b1 omb1 b2 omb2 decay lr"
    elif kernel == "adamw8bit_kernel":
        head["coef"] = "*fp32"
        head["maps"] = "*fp32"
        scalars = "omb1 omb2 eps decay beta1 beta2"
    else:
        head["maps"] = "*fp32"
        scalars = "b1 omb1 b2 omb2 decay lr"
    constexprs = ("MODE", "OUT", "GRAD", "ALIGNED", "BLOCK" if kernel == "lion_kernel" else "NB")
    return {**head, **{x: "fp32" for x in scalars.split()}, **{c: "constexpr" for c in constexprs}}


def signature_adamw(kernel: str) -> dict:
    """The argument types of ``adamw_triton``'s ``fp32_state_kernel`` or ``bf16_state_kernel``."""
    head = {"table": "*i64", "info": "*i64", "flag_ptr": "*fp32", "count": "i32", "coef": "*fp32"}
    fp32 = kernel == "fp32_state_kernel"
    scalars = "b2 omb2 lerp_w decay eps" if fp32 else "b1 omb1 b2 omb2 eps decay"
    constexprs = ("MODE", "OUT", "GRAD", "ALIGNED", *(("KEYED",) if fp32 else ()), "BLOCK", "BLOCKS")
    return {**head, **{x: "fp32" for x in scalars.split()}, **{c: "constexpr" for c in constexprs}}


def signature_adafactor_update() -> dict:
    """The argument types of ``adafactor_triton._update_kernel``."""
    scalars = "lr_hi lr_lo clip_hi clip_lo decay omb1"
    return {"ptrs": "*i64", "sizes": "*i64", "mean_ptr": "*fp64", "cinv_ptr": "*fp32", "over_ptr": "*fp64",
            "flag_ptr": "*fp32", "count": "i32", **{x: "fp32" for x in scalars.split()},
            **{c: "constexpr" for c in ("PDT", "GDT", "HAS_EA", "MODE", "ALIGNED", "BR", "BC", "PART")}}
