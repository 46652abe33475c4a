"""The guard's inf/NaN scan on CUDA (``optim/nonfinite_triton.py``), run on CPU under Triton's interpreter against
torch's check (``nonfinite._bad_flags``), its launches counted, and compiled for sm_90."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from triton_helpers import compile_for_hopper, needs_interpreter, on_cpu, triton  # noqa: F401
from hf_efficient import nonfinite

K = pytest.importorskip("hf_efficient.optim.nonfinite_triton")

NAN, INF = float("nan"), float("inf")


class Spy:
    """Counts the launches of a Triton kernel (``kernel[grid](...)``), with their grids and keywords."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.fixture
def spy(monkeypatch):
    s = Spy(K.scan_kernel)
    monkeypatch.setattr(K, "scan_kernel", s)
    return s


def _check(grads, tables=None, **kw):
    """The scan's flags and found equal torch's check."""
    found, flags = K.scan(grads, {} if tables is None else tables, **kw)
    want = nonfinite._bad_flags(grads)
    assert flags.tolist() == want.float().tolist()
    assert found.dim() == 0 and float(found) == float(want.any())  # 0-dim: torch's fused AdamW takes it as found_inf


@needs_interpreter
@pytest.mark.parametrize("dtype", K.DTYPES)
def test_each_bad_value_is_found_in_its_tensor_and_no_other(on_cpu, spy, dtype):
    gen = torch.Generator().manual_seed(0)
    sizes = [3 * K.CHUNK + 5, 1, 37, K.CHUNK, 2 * K.CHUNK]  # ragged tails, one element, a whole chunk
    half = dtype == torch.float16  # nothing finite of fp16 reaches OVERFLOW
    just_below = torch.finfo(dtype).max if half else 2.0**64 * (1 - torch.finfo(dtype).eps / 2)
    for bad in (NAN, -INF, INF if half else 2.0**64):
        for where, at in ((0, K.CHUNK), (0, -1), (1, 0), (2, -1), (3, K.CHUNK - 1), (4, K.CHUNK)):
            grads = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
            grads[3][0] = just_below  # clean: its square does not overflow
            grads[where][at] = bad
            _check(grads, max_chunks=2)  # the first tensor (4 chunks) launches alone
    clean = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    clean[1][0] = just_below
    _check(clean, max_chunks=2)
    assert len(spy.calls) == 38 and all(grid in ((4,), (4, 2)) for grid, _ in spy.calls)  # 2 launches per scan


class _Ops(TorchDispatchMode):
    """Records the torch ops run inside it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@needs_interpreter
def test_one_launch_per_gradient_dtype_on_llama_1b_shapes(on_cpu, spy, monkeypatch):
    """Llama-1B's gradient count (24 layers of 7 matrices and 2 norms, in two param groups: one scan), as tiny
    tensors: one kernel launch per gradient dtype; on the torch side, once the table is built, only the zeroed flags
    (one fill) and two views of them."""
    gen = torch.Generator().manual_seed(0)
    layer = [64] * 7 + [8] * 2
    grads = [torch.randn(n, generator=gen) for _ in range(24) for n in layer]
    grads[100][3] = NAN
    tables = {}
    found, flags = K.scan(grads, tables)
    assert len(spy.calls) == 1 and spy.calls[0][0] == (216, 1)
    assert float(found) == 1.0 and flags.nonzero().flatten().tolist() == [100]
    mixed = [g.bfloat16() if i % 9 < 7 else g for i, g in enumerate(grads)]  # bf16 matrices, fp32 norms
    _check(mixed)
    assert len(spy.calls) == 3  # one launch per dtype
    launches = []  # the interpreter's launcher runs torch ops of its own: not launched here
    monkeypatch.setattr(K, "scan_kernel", type("Stub", (), {"__getitem__": lambda self, grid: (
        lambda *a, **k: launches.append(grid))})())
    with _Ops() as ops:
        K.scan(grads, tables)
    assert launches == [(216, 1)] and sorted(ops.ops) == ["select", "slice", "zeros"]


@needs_interpreter
def test_tables_follow_moved_and_changed_gradients(on_cpu, spy):
    """A table is reused while the addresses stay (a gradient changed in place is read anew), rebuilt when they move;
    a misaligned address turns the alignment hint off."""
    tables = {}
    grads = [torch.randn(100), torch.randn(3000)]
    _check(grads, tables)
    grads[1][2999] = INF  # same addresses: same table
    _check(grads, tables)
    _check([g.clone() for g in grads], tables)  # moved
    assert [kw["ALIGNED"] for _, kw in spy.calls] == [True] * 3
    storage = torch.zeros(3101)
    storage[100] = NAN
    _check([storage[1:101], storage[101:]], tables)  # 4 bytes past a 16-byte boundary
    assert spy.calls[-1][1]["ALIGNED"] is False and len(tables) == 1


@needs_interpreter
def test_the_step_uses_the_scan_and_falls_back_where_it_does_not_apply(on_cpu, monkeypatch):
    """``flag_on_device``: the scan for plain contiguous gradients; torch's check for a transposed one."""
    monkeypatch.setattr(nonfinite, "_DEVICE_FLAG_ON_CPU", True)
    assert nonfinite._triton_scan([torch.zeros(1)]) is K.scan  # probed (its launches not counted), and it passed
    launched = Spy(K.scan_kernel)
    monkeypatch.setattr(K, "scan_kernel", launched)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    model.weight.grad, model.bias.grad = torch.randn(3, 4), torch.tensor([0.0, INF, 0.0])
    found, flags, names = nonfinite.flag_on_device(opt)
    assert len(launched.calls) == 1 and float(found) == 1.0 and flags.tolist() == [0.0, 1.0]
    model.weight.grad = torch.randn(4, 3).t()
    found, flags, names = nonfinite.flag_on_device(opt)
    assert len(launched.calls) == 1 and float(found) == 1.0 and flags.tolist() == [False, True]


@needs_interpreter
def test_the_probe_refuses_a_scan_that_never_flags(on_cpu, monkeypatch):
    """The dispatcher's probe catches a kernel that finds nothing (so such a kernel would never be used)."""
    assert nonfinite._triton_scan([torch.zeros(1)]) is K.scan  # the real one passed it

    def blind(grads, tables, max_chunks=K.MAX_CHUNKS):
        buf = torch.zeros(len(grads) + 1)
        return buf[-1], buf[:-1]

    monkeypatch.setattr(K, "scan", blind)
    assert not K.probe(torch.device("cpu"))


@pytest.mark.parametrize("dtype,table,aligned,size", [("*fp32", True, True, "i32"), ("*bf16", True, False, "i32"),
                                                      ("*fp16", False, False, "i64"), ("*fp64", True, True, "i32")])
def test_scan_compiles_for_hopper(dtype, table, aligned, size):
    info = compile_for_hopper("hf_efficient.optim.nonfinite_triton", "scan_kernel", {
        "found_ptr": "*fp32", "flags_ptr": "*fp32", "g_ptr": dtype, "ptrs": "*i64", "sizes": "*i64", "n": size,
        "idx": "i32", "count": "i32", "TABLE": "constexpr", "ALIGNED": "constexpr", "BLOCK": "constexpr",
        "ITERS": "constexpr"}, {"TABLE": table, "ALIGNED": aligned, "BLOCK": K.BLOCK, "ITERS": K.ITERS})
    assert info["cubin"] > 0
