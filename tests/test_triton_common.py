"""The device functions every Triton kernel shares (``optim/_triton_lib.py``) round bit for bit as the torch code of
``optim/compensation.py`` (and so as the C kernels): run under Triton's interpreter, and compiled for sm_90."""

from __future__ import annotations

import pytest
import torch

from triton_helpers import compile_for_hopper, needs_interpreter, triton  # noqa: F401
from hf_efficient.optim import _triton, compensation as C

tl = triton.language
L = pytest.importorskip("hf_efficient.optim._triton_lib")
from _triton_test_kernels import write_kernel  # noqa: E402


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, any NaN equal to any NaN (its payload is the hardware's)."""
    return bool(((a.view(torch.int16) == b.view(torch.int16)) | (a.isnan() & b.isnan())).all())


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", C.COMPENSATIONS)
def test_compensated_write_matches_torch_bit_for_bit(dtype, mode):
    n = 3000  # three programs of 1024, the last one partial
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(n, generator=gen).to(dtype).float()
    old[:4] = torch.tensor([float("nan"), float("inf"), 3.3895e38, 0.0])  # NaN, inf, bf16's largest, zero
    new = old + torch.randn(n, generator=gen) * 1e-3
    comp = (torch.randn(n, generator=gen) * 1e-4).bfloat16()
    ref, ref_comp = old.to(dtype), comp.clone()
    key = C.weight_key(5, 17)
    if mode == "none":
        ref = new.to(dtype)  # what the kernels store for an uncompensated weight
    else:
        C.write(ref, old, new - old, ref_comp, mode, torch.tensor(key, dtype=torch.int32), None)
    out, out_comp, key_out = torch.empty(n, dtype=dtype), comp.clone(), torch.zeros(1, dtype=torch.int32)
    write_kernel[(triton.cdiv(n, 1024),)](out, old, new, out_comp, key_out, 5, 17, n, MODE=C.C_MODES[mode],
                                          OUT=tl.bfloat16 if dtype == torch.bfloat16 else tl.float16, BLOCK=1024)
    assert key_out.item() == key
    assert same_bits(out, ref)
    assert same_bits(out_comp, ref_comp)


@needs_interpreter
def test_to_bf16_rounds_to_nearest_even_like_torch():
    from _triton_test_kernels import bf16_kernel

    x = torch.cat([torch.randn(4000) * 10.0 ** torch.randint(-30, 30, (4000,)).float(),
                   torch.tensor([float("nan"), -float("inf"), 3.4e38, -0.0, 1.00390625, 1.01171875])])
    # exact ties: 1 + 2**-8 rounds down to 1.0, 1 + 3 * 2**-8 up
    out = torch.empty(x.numel(), dtype=torch.bfloat16)
    bf16_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    assert same_bits(out, x.bfloat16())


@needs_interpreter
def test_pow_int_matches_python():
    from _triton_test_kernels import pow_kernel

    steps = torch.tensor([1, 2, 3, 10, 999, 1000, 123456, 2**24], dtype=torch.int32)
    out = torch.empty(steps.numel(), dtype=torch.float64)
    pow_kernel[(1,)](steps, out, *_triton.split64(0.999), steps.numel(), BLOCK=8)
    want = torch.tensor([0.999 ** int(s) for s in steps], dtype=torch.float64)
    assert torch.allclose(out, want, rtol=1e-10, atol=0)  # the fp32 halves carry ~48 bits of beta
    assert torch.equal((1 - out).float(), (1 - want).float())  # the bias corrections the kernels use: the host's


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_shared_functions_compile_for_hopper(mode):
    info = compile_for_hopper("_triton_test_kernels", "write_kernel", {
        "p_ptr": "*bf16", "old_ptr": "*fp32", "new_ptr": "*fp32", "comp_ptr": "*bf16", "key_out": "*i32",
        "pos": "i32", "step": "i32", "n": "i32", "MODE": "constexpr", "OUT": "constexpr", "BLOCK": "constexpr"},
        {"MODE": mode, "OUT": "tl.bfloat16", "BLOCK": 1024})
    assert info["cubin"] > 0


def test_to_bf16_is_the_conversion_instruction_on_the_gpu():
    """Compiled for sm_90 (no interpreter), ``to_bf16`` is the hardware's round-to-nearest-even conversion (F2FP),
    not the integer rounding the interpreter needs (per value a shift, a NaN compare and a select)."""
    sass = compile_for_hopper("_triton_test_kernels", "bf16_kernel", {
        "x_ptr": "*fp32", "out_ptr": "*bf16", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 1024}, sass=True)["sass"]
    assert sass.get("F2FP", 0) == 4  # 8 values a thread (1024 over 4 warps), converted in pairs
    assert not {"FSETP", "SEL", "SGXT"} & set(sass), sass
