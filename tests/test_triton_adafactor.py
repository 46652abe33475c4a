"""Adafactor's Triton kernels (``optim/adafactor_triton.py``), run on CPU under Triton's interpreter, against the eager
step, and compiled for sm_90.

Tolerances (``adafactor._agree``, the C kernel's): vectors bit for bit (the same fp32 operations in the same order;
the sum of squares in float64 in both); matrices, whose row, column and D sums add in another order: statistics
within 2**-16 relative, ``exp_avg`` within 2**-16 of its largest element, weights within 2 fp32 ulps (one bf16 ulp)
plus 2**-10 of a step, a Kahan weight plus its buffer within 2**-15 relative. Resume on the same kernel: bit for bit.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
from torch import nn

from triton_helpers import _AOT, needs_interpreter, on_cpu  # noqa: F401
from hf_efficient.optim import _dispatch, _triton, adafactor as af
from hf_efficient.optim.adafactor import Adafactor

T = pytest.importorskip("hf_efficient.optim.adafactor_triton")
pytestmark = needs_interpreter

LR = 1e-2
CPU = torch.device("cpu")
# a matrix of row blocks and column tiles not multiples of the tiles, a batch, vectors, an empty matrix
SHAPES = [(13, 600), (70, 33), (3, 9, 7), (613,), (1,), (0, 5)]


def _params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _grads(params, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen).to(p.dtype) for p in params] for _ in range(steps)]


def _opt(params, **kw):
    """Two groups (their hyperparameters differ), as the Trainer builds them."""
    kw = dict(lr=LR, **kw)
    return Adafactor([{"params": params[::2], "weight_decay": 0.1}, {"params": params[1::2]}], **kw)


def _steps(opt, params, grads, triton: bool):
    _triton.interpret_on_cpu(triton)
    try:
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
    finally:
        _triton.interpret_on_cpu(False)


def _assert_agree(params, opt, ref_params, ref_opt):
    for a, b in zip(params, ref_params):
        sa, sb = opt.state[a], ref_opt.state[b]
        assert sa["step"].dtype == torch.float32 and sa["step"].dim() == 0
        assert af._agree(a.detach(), b.detach(), sa, sb, LR), (tuple(a.shape), a.dtype)


def _triton_ran():
    """A spy on the kernels' entry point (after their probe, which steps through it too)."""
    _triton.interpret_on_cpu(True)
    try:
        assert af._triton_module(CPU) is T
    finally:
        _triton.interpret_on_cpu(False)
    return mock.patch.object(T, "step", wraps=T.step)


@pytest.mark.parametrize("dtype, compensation, beta1", [
    (torch.float32, "kahan", 0.9), (torch.bfloat16, "stochastic", 0.9), (torch.float16, "kahan", None),
    (torch.bfloat16, "none", None)])
def test_kernels_match_the_eager_step(dtype, compensation, beta1, monkeypatch):
    monkeypatch.setattr(af, "_native_fn", lambda: None)  # the reference: the eager step
    ps, ref = _params(dtype), _params(dtype)
    opt, ref_opt = _opt(ps, beta1=beta1, compensation=compensation), _opt(ref, beta1=beta1, compensation=compensation)
    grads = _grads(ps, 2)
    grads[0][0].view(-1)[0] = torch.finfo(dtype).max  # a square beyond fp32 (fp16: its largest gradient)
    with _triton_ran() as spy:
        _steps(opt, ps, grads, True)
    assert spy.call_count == 2
    _steps(ref_opt, ref, grads, False)
    _assert_agree(ps, opt, ref, ref_opt)
    if dtype != torch.float32:  # the compensation did something the eager step also did
        assert not torch.equal(ps[0], _params(dtype)[0])


def test_the_probe_passes_and_refuses_a_wrong_kernel(on_cpu, monkeypatch):
    """The probe (every dtype and write, squares beyond fp32) passes; a kernel that drops a column block's parts does
    not."""
    assert af._triton_probe(T, CPU)
    monkeypatch.setattr(T, "_PROGRAMS", 2)  # several row blocks per matrix (4 "SMs" on CPU)
    orig = T._cols_kernel

    class Lossy:  # the column pass of a kernel that forgets the last row block's parts
        def __getitem__(self, grid):
            return lambda *a, **kw: orig[grid](*a[:9], a[9] - 1 if a[9] > 1 else a[9], *a[10:], **kw)

    monkeypatch.setattr(T, "_cols_kernel", Lossy())
    assert not af._triton_probe(T, CPU)


def test_void_flag_changes_nothing(on_cpu):
    """With the step's flag set (a non-finite gradient under the guard), weights, state and steps stay as they were."""
    ps = _params(torch.bfloat16)
    opt = _opt(ps, beta1=0.9, compensation="kahan")
    _steps(opt, ps, _grads(ps, 1), True)
    before = [p.detach().clone() for p in ps], {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in ps}
    opt.found_inf = torch.ones(1)
    _steps(opt, ps, _grads(ps, 1, seed=5), True)
    for p, old in zip(ps, before[0]):
        assert torch.equal(p, old)
        for k, v in before[1][id(p)].items():
            assert torch.equal(opt.state[p][k], v), k
    opt.found_inf = torch.zeros(1)
    _steps(opt, ps, _grads(ps, 1, seed=5), True)
    assert all(opt.state[p]["step"].item() == 2 for p in ps)


def _save(opt) -> dict:
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
def test_resume_on_the_kernel_is_exact(compensation):
    ps = _params(torch.bfloat16)
    grads = _grads(ps, 3)
    full = _opt(ps, beta1=0.9, compensation=compensation)
    _steps(full, ps, grads, True)
    rs = _params(torch.bfloat16)
    first = _opt(rs, beta1=0.9, compensation=compensation)
    _steps(first, rs, grads[:1], True)
    saved = _save(first)
    rs = [nn.Parameter(p.detach().clone()) for p in rs]
    second = _opt(rs, beta1=0.9, compensation=compensation)
    second.load_state_dict(saved)
    _steps(second, rs, grads[1:], True)
    for a, b in zip(ps, rs):
        assert torch.equal(a, b)
        for k, v in full.state[a].items():
            assert torch.equal(second.state[b][k], v), k


@pytest.mark.parametrize("first_triton", [True, False], ids=["triton-then-cpu", "cpu-then-triton"])
def test_checkpoints_move_between_triton_and_the_cpu_path(first_triton):
    """A state_dict made by one path loads into the other and continues as the first path would have."""
    ps, ref = _params(torch.bfloat16), _params(torch.bfloat16)
    grads = _grads(ps, 4)
    full = _opt(ref, beta1=0.9)
    _steps(full, ref, grads, first_triton)
    first = _opt(ps, beta1=0.9)
    _steps(first, ps, grads[:2], first_triton)
    saved = _save(first)
    assert all(s["step"].dtype == torch.float32 and s["step"].dim() == 0 for s in saved["state"].values())
    ps = [nn.Parameter(p.detach().clone()) for p in ps]
    second = _opt(ps, beta1=0.9)
    second.load_state_dict(saved)
    _steps(second, ps, grads[2:], not first_triton)
    _assert_agree(ps, second, ref, full)


def test_probe_failure_falls_back_to_the_eager_step_with_one_warning(on_cpu, monkeypatch, caplog):
    monkeypatch.setattr(_dispatch, "_COMPILED", {})
    monkeypatch.setattr(_dispatch, "_LOGGED", set())
    monkeypatch.setattr(af, "_triton_probe", lambda module, device: False)
    ps, ref = _params(torch.bfloat16), _params(torch.bfloat16)
    opt, ref_opt = _opt(ps), _opt(ref)
    grads = _grads(ps, 2)
    with caplog.at_level(logging.WARNING), mock.patch.object(T, "step", wraps=T.step) as spy:
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()
    assert spy.call_count == 0
    assert sum("Triton kernels disagree" in r.getMessage() for r in caplog.records) == 1
    _steps(ref_opt, ref, grads, False)
    for a, b in zip(ps, ref):
        assert torch.equal(a, b)


def test_state_the_kernels_cannot_take_goes_to_the_eager_step(on_cpu):
    """A transposed exp_avg (a user's, or a checkpoint's that did not fit) is stepped by the eager step."""
    p = nn.Parameter(torch.randn(40, 30))
    opt = Adafactor([p], lr=LR, beta1=0.9)
    p.grad = torch.randn(40, 30)
    opt.step()
    opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].t().contiguous().t()
    with _triton_ran() as spy:
        opt.step()
    assert spy.call_count == 0  # nothing for the kernels
    assert p.isfinite().all()


# ------------------------------------------------------------------------------------------ sm_90


def _variants():
    """Every variant the launches compile: the update and vector kernels per weight dtype, write and first moment;
    the stats pass per gradient dtype; the column pass."""
    out = []
    base = {"step_ptr": "*fp32", "flag_ptr": "*fp32"}
    for name, gdt in (("_stats_kernel", "*fp32"), ("_stats_kernel", "*bf16"), ("_stats_kernel", "*fp16")):
        out.append([name, {"g_ptr": gdt, "row_ptr": "*fp32", "part_ptr": "*fp32", "mean_ptr": "*fp64", **base,
                           "n": "i32", "m": "i32", "R": "i32", "P": "i32", "inv_k": "fp32", "k_cols": "fp32",
                           "eps": "fp32", "rate_hi": "fp32", "rate_lo": "fp32", "BR": "constexpr",
                           "BC": "constexpr"}, {"BR": 4, "BC": 512}])
    out.append(["_cols_kernel", {"col_ptr": "*fp32", "part_ptr": "*fp32", "mean_ptr": "*fp64", "cinv_ptr": "*fp32",
                                 "over_ptr": "*fp64", **base, "n": "i32", "m": "i32", "P": "i32", "C": "i32",
                                 "k_rows": "fp32", "eps": "fp32", "rate_hi": "fp32", "rate_lo": "fp32",
                                 "BC": "constexpr", "PART": "constexpr"}, {"BC": 512, "PART": 256}])
    scalars = {"lr_hi": "fp32", "lr_lo": "fp32", "clip_hi": "fp32", "clip_lo": "fp32", "decay": "fp32",
               "omb1": "fp32"}
    for pdt, modes in (("fp32", [2]), ("bf16", [0, 1, 2]), ("fp16", [0, 1, 2])):
        for mode in modes:
            for ea in (True, False):
                out.append(["_update_kernel", {
                    "p_ptr": "*" + pdt, "g_ptr": "*bf16", "row_ptr": "*fp32", "cinv_ptr": "*fp32", "mean_ptr": "*fp64",
                    "over_ptr": "*fp64", "ea_ptr": "*fp32", "comp_ptr": "*bf16" if mode == 0 else "*" + pdt, **base,
                    "B": "i32", "n": "i32", "m": "i32", "P": "i32", "C": "i32", "k": "i32", **scalars,
                    "position": "i32", "HAS_EA": "constexpr", "MODE": "constexpr", "BR": "constexpr",
                    "BC": "constexpr", "PART": "constexpr"},
                    {"HAS_EA": ea, "MODE": mode, "BR": 4, "BC": 1024, "PART": 256}])
                dt = {"fp32": "tl.float32", "bf16": "tl.bfloat16", "fp16": "tl.float16"}[pdt]
                out.append(["_vector_kernel", {"ptrs": "*i64", "sizes": "*i64", "flag_ptr": "*fp32", "count": "i32",
                                               **scalars, "eps": "fp32", "rate_hi": "fp32", "rate_lo": "fp32",
                                               "PDT": "constexpr", "GDT": "constexpr", "HAS_EA": "constexpr",
                                               "MODE": "constexpr", "BLOCK": "constexpr"},
                            {"PDT": dt, "GDT": dt, "HAS_EA": ea, "MODE": mode, "BLOCK": 1024}])
    return out


def test_every_variant_compiles_for_hopper():
    """triton_helpers' sm_90 compile (no GPU needed), all variants in one process (one per call costs seconds)."""
    script = ("import json, sys\nfrom triton_helpers import _AOT\nfor name, sig, const in json.loads(sys.argv[1]):\n"
              "    sys.argv = ['aot', json.dumps(['hf_efficient.optim.adafactor_triton', name, sig, const])]\n"
              "    exec(_AOT, {})\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), *filter(None, [env.get("PYTHONPATH")])])
    variants = _variants()
    run = subprocess.run([sys.executable, "-c", script, json.dumps(variants)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    sizes = [json.loads(line) for line in run.stdout.strip().splitlines()]
    assert len(sizes) == len(variants) and all(s["cubin"] > 0 for s in sizes)
