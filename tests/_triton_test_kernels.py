"""Small Triton kernels over the shared device functions, for tests/test_triton_common.py (jit needs a file)."""

import triton
import triton.language as tl

from hf_efficient.optim import _triton
from hf_efficient.optim import quant8_triton as Q

L = _triton.jit_helpers()


@triton.jit
def write_kernel(p_ptr, old_ptr, new_ptr, comp_ptr, key_out, pos, step, n, MODE: tl.constexpr, OUT: tl.constexpr,
                 BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    old = tl.load(old_ptr + offs, mask=m)
    new = tl.load(new_ptr + offs, mask=m)
    comp = tl.load(comp_ptr + offs, mask=m).to(tl.float32)
    key = L.weight_key(pos, step)
    w, c = L.compensated(old, new, comp, key, offs, MODE, OUT)
    tl.store(p_ptr + offs, w, mask=m)
    tl.store(comp_ptr + offs, L.to_bf16(c), mask=m)
    if tl.program_id(0) == 0:
        tl.store(key_out, key)


@triton.jit
def bf16_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, L.to_bf16(tl.load(x_ptr + offs, mask=m)), mask=m)


@triton.jit
def pow_kernel(n_ptr, out_ptr, base_hi, base_lo, count, BLOCK: tl.constexpr):
    for i in range(count):  # pow_int takes a scalar exponent (a tensor's step), as the kernels call it
        tl.store(out_ptr + i, L.pow_int(base_hi, base_lo, tl.load(n_ptr + i)))


@triton.jit
def encode_kernel(x_ptr, out_ptr, maps, n, SIGNED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, Q.encode(tl.load(x_ptr + offs, mask=m, other=0.0), maps, SIGNED), mask=m)
