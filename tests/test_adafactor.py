"""Adafactor against transformers' Adafactor (its step-size mode), its C kernel against its eager step, the
compensated writes of bf16 weights, resume, and its behaviour under misuse and overflow.

Reference: ``transformers.optimization.Adafactor(scale_parameter=False, relative_step=False)`` holds the same
math; run in float64 (weights rounded to the tested dtype after every step) it is the exact answer.

C kernel against the eager step (the reference of every other path). Tolerances, and why:

* vectors: bit for bit (weights, ``exp_avg_sq``, ``exp_avg``, ``kahan_comp``): the same fp32 operations in the same
  order (torch's lerp is a fused multiply-add, so is the kernel's); the update's sum of squares is taken in double
  by both, so the clip factor rounds to the same fp32 number.
* matrices: the row and column sums of squares (and the D sums of the factored sum of squares, see the module)
  add in another order (torch's cascade against the kernel's lanes and row slices), a few fp32 ulps apart (seen:
  4e-7 relative). So statistics within 2**-16 relative; the update and its clip factor then differ by as much, so
  ``exp_avg`` within 2**-16 of its largest element, weights within 2 fp32 ulps (one bf16 ulp: the difference can
  move a rounding) plus 2**-10 of a step, and a Kahan weight plus its buffer (the value it stands for) within
  2**-15 relative plus 2**-10 of a step. A lost row, column or update is far outside.
* the kernel's own results do not depend on the number of threads: bit for bit on 1 and 3.
"""

from __future__ import annotations

import io
import logging

import pytest
import torch
from torch import nn

from hf_efficient.optim import adafactor as af
from hf_efficient.optim.adafactor import Adafactor

LR = 1e-2
SHAPES = [(8, 16), (16,), (2, 4, 8)]  # matrix, vector, batched matrices


def _reference(params, **kw):
    from transformers.optimization import Adafactor as HFAdafactor

    return HFAdafactor(params, lr=LR, scale_parameter=False, relative_step=False, warmup_init=False, **kw)


def _pair(dtype, shapes=SHAPES, seed=0, **kw):
    """Our optimizer on ``dtype`` weights beside the reference on float64 copies of the same values (rounded to
    ``dtype`` after each step: ours rounds to nearest too, ``compensation="none"``)."""
    g = torch.Generator().manual_seed(seed)
    w0 = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    ours = [nn.Parameter(w.clone()) for w in w0]
    ref = [nn.Parameter(w.double()) for w in w0]
    return ours, Adafactor(ours, lr=LR, compensation="none", **kw), ref, _reference(ref, **kw)


def _step_both(ours, opt, ref, ref_opt, grads, dtype):
    for p, r, gr in zip(ours, ref, grads):
        p.grad, r.grad = gr.to(dtype), gr.to(dtype).double()
    opt.step()
    ref_opt.step()
    with torch.no_grad():
        for r in ref:  # the weights hold dtype values: round the reference's too
            r.copy_(r.to(dtype).double())


def _error(p, r, dtype):
    """|ours - reference| beyond one rounding of the weight, in units of lr: 1 means off by a whole update."""
    ulp = torch.finfo(dtype).eps
    return ((p.double() - r).abs() - ulp * r.abs()).clamp(min=0) / LR


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [{}, {"beta1": 0.9, "weight_decay": 0.1}], ids=["plain", "beta1-wd"])
def test_matches_transformers_adafactor(dtype, kw):
    ours, opt, ref, ref_opt = _pair(dtype, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        _step_both(ours, opt, ref, ref_opt, [torch.randn(p.shape, generator=g) for p in ours], dtype)
        for p, r in zip(ours, ref):
            assert _error(p, r, dtype).max() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("big", [2e19, 3e38])  # the square overflows fp32; the square and most sums overflow
def test_gradient_whose_square_overflows_keeps_state_and_weights_finite(dtype, big):
    ours, opt, ref, ref_opt = _pair(dtype, shapes=[(8, 16), (16,)])
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in ours]
        if i == 0:
            grads[0][2, 3] = grads[1][3] = big
        _step_both(ours, opt, ref, ref_opt, grads, dtype)
        for p in ours:
            assert p.isfinite().all()
            assert all(t.isfinite().all() for t in opt.state[p].values())
        matrix, vector = (_error(p, r, dtype) for p, r in zip(ours, ref))
        # the vector's element is clamped to 2**64, which leaves its update (g / sqrt(v) = 1) as it was
        assert vector.max() < 1e-3
        if big == 2e19:  # the row and column means of the square are within fp32: exact
            assert matrix.max() < 1e-3
        else:  # beyond fp32: the big element's row and column differ; the others stay within 10% of a step
            others = matrix[[r for r in range(8) if r != 2]][:, [c for c in range(16) if c != 3]]
            assert others.max() < 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta1", [None, 0.9])
def test_step_leaves_the_gradients_as_they_were(dtype, beta1):
    params = [nn.Parameter(torch.randn(s).to(dtype)) for s in SHAPES]
    opt = Adafactor(params, lr=LR, beta1=beta1)
    for p in params:
        p.grad = torch.randn(p.shape).to(dtype)
    before = [p.grad.clone() for p in params]
    opt.step()
    for p, g in zip(params, before):
        assert torch.equal(p.grad, g)


def test_sparse_gradient_is_refused_before_anything_is_updated():
    dense, emb = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(10, 4))
    opt = Adafactor([dense, emb], lr=LR)
    dense.grad = torch.randn(4, 4)
    emb.grad = torch.sparse_coo_tensor([[1, 3]], torch.ones(2, 4), (10, 4))
    before = dense.detach().clone()
    with pytest.raises(RuntimeError, match=r"sparse gradients \(parameter 1 of param group 0, shape \(10, 4\)\).*nothing was updated"):
        opt.step()
    assert torch.equal(dense, before) and not opt.state


def _group_error(opt_kw: dict, group: dict, match: str) -> None:
    """``group`` is refused by the constructor and by add_param_group, with ``match`` in the message."""
    with pytest.raises(ValueError, match=match):
        Adafactor([{"params": [nn.Parameter(torch.zeros(2))], **group}], **opt_kw)
    opt = Adafactor([nn.Parameter(torch.zeros(2))], **opt_kw)
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], **group})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("group, match", [
    ({"maximize": True}, r"maximize=True.*Negate the loss"),
    ({"lr": torch.tensor(1e-3)}, r"lr=tensor"),
    ({"lr": -1.0}, r"lr=-1.0"),
    ({"weight_decay": -0.1}, r"weight_decay=-0.1"),
    ({"beta1": 1.5}, r"beta1=1.5"),
    ({"clip_threshold": 0.0}, r"clip_threshold=0.0"),
    ({"decay_rate": 0.5}, r"decay_rate=0.5"),
])
def test_bad_group_is_refused_at_construction_and_in_add_param_group(group, match):
    _group_error({}, group, match)


def test_maximize_false_is_accepted():
    Adafactor([{"params": [nn.Parameter(torch.zeros(2))], "maximize": False}])


def test_duplicate_parameter_is_refused():
    p, q = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"parameter 2 of the new param group \(shape \(3,\)\) is the same tensor as parameter 0"):
        Adafactor([p, q, p])
    opt = Adafactor([q])
    with pytest.raises(ValueError, match="same tensor"):
        opt.add_param_group({"params": (x for x in (p, p))})
    with pytest.raises(ValueError, match="same tensor as parameter 0 of param group 0"):  # across groups too
        opt.add_param_group({"params": [q]})
    assert len(opt.param_groups) == 1


def test_loaded_number_step_is_accepted_like_torch():
    """torch's optimizers take a Python number as ``step`` in a loaded state and make it a tensor."""
    def run(step_as_number: bool):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(s)) for s in SHAPES]
        opt = Adafactor(params, lr=LR, beta1=0.9)
        grads = [[torch.randn(s) for s in SHAPES] for _ in range(3)]
        for p, gr in zip(params, grads[0]):
            p.grad = gr
        opt.step()
        sd = opt.state_dict()
        if step_as_number:
            for st in sd["state"].values():
                st["step"] = int(st["step"].item())
        opt.load_state_dict(sd)
        for gs in grads[1:]:
            for p, gr in zip(params, gs):
                p.grad = gr
            opt.step()
        return params, opt

    as_tensor, as_number = run(False), run(True)
    for a, b in zip(as_tensor[0], as_number[0]):
        assert torch.equal(a, b)
    assert all(torch.is_tensor(st["step"]) and st["step"].item() == 3 for st in as_number[1].state.values())


def test_a_gradient_in_another_layout_gives_the_same_step():
    w, g = torch.randn(8, 16), torch.randn(8, 16)
    a, b = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    opt_a, opt_b = Adafactor([a], lr=LR), Adafactor([b], lr=LR)
    a.grad, b.grad = g, g.t().contiguous().t()  # column-major: strides (1, 8)
    opt_a.step()
    opt_b.step()
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------ C kernel == eager

ODD = [(517, 263), (97, 2053), (3, 37, 41), (131109,), (613,), (7, 5), (1,)]  # row slices, column units, batch, units


def _native_or_skip():
    if af._native_fn() is None:
        pytest.skip("no C compiler: the C kernel is not built here")


@pytest.fixture
def threads():
    """3 threads (more than this machine's 2 cores: the kernel must split its units over any team); the test may
    set others; torch's count is put back after it."""
    n = torch.get_num_threads()
    torch.set_num_threads(3)
    yield 3
    torch.set_num_threads(n)


def _train(dtype, native: bool, monkeypatch, steps=3, shapes=ODD, seed=0, **kw):
    """``steps`` steps of Adafactor on ``shapes`` in ``dtype`` (the first step's gradients hold squares beyond fp32
    at both ends), through the C kernel or the eager step only."""
    with monkeypatch.context() as m:
        if not native:
            m.setattr(af, "_native_fn", lambda: None)
        gen = torch.Generator().manual_seed(seed)
        params = [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
        opt = Adafactor(params, lr=LR, weight_decay=0.1, **kw)
        for t in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(dtype)
                if t == 0:
                    p.grad.view(-1)[0], p.grad.view(-1)[-1] = 3e38, -2e19
            opt.step()
    return params, opt


def _assert_close(pn, pe, sn: dict, se: dict, where: str):
    """The module docstring's tolerances: C kernel (``pn``, ``sn``) against eager (``pe``, ``se``)."""
    assert set(sn) == set(se), where
    if pn.dim() < 2:
        assert torch.equal(pn, pe), where
        for k in se:
            assert torch.equal(sn[k], se[k]), (where, k)
        return
    for k in ("exp_avg_sq_row", "exp_avg_sq_col"):
        torch.testing.assert_close(sn[k], se[k], rtol=2.0**-16, atol=0.0, msg=f"{where} {k}")
    if "exp_avg" in se:
        torch.testing.assert_close(sn["exp_avg"], se["exp_avg"], rtol=0.0, atol=2.0**-16 * se["exp_avg"].abs().max().item(),
                                   msg=f"{where} exp_avg")
    ulp = 2.0**-22 if pn.dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(pn.float(), pe.float(), rtol=ulp, atol=LR * 2.0**-10, msg=f"{where} weights")
    if "kahan_comp" in se:
        torch.testing.assert_close(pn.float() + sn["kahan_comp"].float(), pe.float() + se["kahan_comp"].float(),
                                   rtol=2.0**-15, atol=LR * 2.0**-10, msg=f"{where} weight + kahan_comp")


@pytest.mark.parametrize("dtype, compensation", [(torch.float32, "kahan"), (torch.bfloat16, "kahan"),
                                                 (torch.bfloat16, "stochastic"), (torch.bfloat16, "none")])
@pytest.mark.parametrize("beta1", [None, 0.9])
@pytest.mark.parametrize("group_bytes", [6 << 20, 1 << 16], ids=["one-group", "group-per-tensor"])
def test_native_kernel_equals_eager(dtype, compensation, beta1, group_bytes, threads, monkeypatch):
    """Module docstring: tolerances. Every tensor in one group, or each in its own (every stage of the pipeline)."""
    _native_or_skip()
    monkeypatch.setattr(af, "_GROUP_BYTES", group_bytes)
    native, opt_n = _train(dtype, True, monkeypatch, compensation=compensation, beta1=beta1)
    eager, opt_e = _train(dtype, False, monkeypatch, compensation=compensation, beta1=beta1)
    for shape, pn, pe in zip(ODD, native, eager):
        _assert_close(pn, pe, opt_n.state[pn], opt_e.state[pe], f"{shape} {dtype} {compensation} beta1={beta1}")
        assert pn.isfinite().all() and all(t.isfinite().all() for t in opt_n.state[pn].values())
    assert any(not torch.equal(a, b) for a, b in zip(native, _train(dtype, True, monkeypatch, steps=0)[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_results_do_not_depend_on_threads(dtype, threads, monkeypatch):
    _native_or_skip()
    runs = []
    for n in (1, 3):
        torch.set_num_threads(n)
        runs.append(_train(dtype, True, monkeypatch, compensation="stochastic", beta1=0.9))
    (p1, o1), (p3, o3) = runs
    for a, b in zip(p1, p3):
        assert torch.equal(a, b)
        assert all(torch.equal(o1.state[a][k], o3.state[b][k]) for k in o1.state[a])


def test_native_kernel_keeps_nonfinite_values_where_eager_does(monkeypatch):
    """With nonfinite="ignore" inf and NaN gradients reach the step: NaN and inf land where the eager step puts them
    (an inf makes the clip factor 0 and its own update NaN; a NaN poisons its matrix), the rest as the docstring."""
    _native_or_skip()
    shapes = [(40, 30), (40, 30), (300,), (300,)]

    def run(native):
        with monkeypatch.context() as m:
            if not native:
                m.setattr(af, "_native_fn", lambda: None)
            params = [nn.Parameter(torch.linspace(-1, 1, 1200)[:torch.Size(s).numel()].reshape(s).bfloat16())
                      for s in shapes]
            opt = Adafactor(params, lr=LR, beta1=0.9)
            for i, p in enumerate(params):
                p.grad = torch.full(p.shape, 1e-3).bfloat16()
                p.grad.view(-1)[7] = float("inf") if i % 2 else float("nan")
            opt.step()
        return params, opt

    (pn, on), (pe, oe) = run(True), run(False)
    for a, b in zip(pn, pe):
        for sa, sb in [(a, b)] + [(on.state[a][k], oe.state[b][k]) for k in oe.state[b] if k != "step"]:
            assert torch.equal(sa.isnan(), sb.isnan()) and torch.equal(sa.isinf(), sb.isinf())
            finite = sb.isfinite()
            torch.testing.assert_close(sa[finite].float(), sb[finite].float(), rtol=2.0**-7, atol=1e-6)


def test_native_kernel_without_openmp(threads, monkeypatch, rebuild_native):
    """A compiler without OpenMP (Apple's clang): the kernel is built without it and runs on one thread, with the
    same results as the OpenMP build on 3 (they do not depend on the thread count)."""
    _native_or_skip()
    with_openmp = _train(torch.bfloat16, True, monkeypatch, compensation="stochastic", beta1=0.9)
    lib = rebuild_native(af._dispatch, _OPENMP="-fno-such-openmp-flag").load("adafactor_cpu.c")
    assert lib is not None and lib.openmp is False
    assert af._native_fn() is not None  # built again, without OpenMP, and probed
    without = _train(torch.bfloat16, True, monkeypatch, compensation="stochastic", beta1=0.9)
    for a, b in zip(with_openmp[0], without[0]):
        assert torch.equal(a, b)
        assert all(torch.equal(with_openmp[1].state[a][k], without[1].state[b][k]) for k in without[1].state[b])


def test_eager_clip_on_another_device_keeps_the_factor_on_it(monkeypatch):
    """Off the CPU the clip factor stays a tensor on the device (no wait for it per tensor): the same step as the
    CPU's Python-float factor, within an ulp of it (torch's double sqrt is not always correctly rounded)."""
    clip = af._clip_scale

    def on_device(sumsq, numel, c):  # the non-CPU branch, run on CPU tensors
        return 1.0 / torch.clamp(torch.sqrt(sumsq / max(numel, 1)) / c, min=1.0)

    cpu = _train(torch.bfloat16, False, monkeypatch, shapes=ODD[:4], beta1=0.9)
    monkeypatch.setattr(af, "_clip_scale", on_device)
    device = _train(torch.bfloat16, False, monkeypatch, shapes=ODD[:4], beta1=0.9)
    monkeypatch.setattr(af, "_clip_scale", clip)
    for a, b in zip(cpu[0], device[0]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2.0**-7, atol=LR * 2.0**-10)
        torch.testing.assert_close(cpu[1].state[a]["exp_avg"], device[1].state[b]["exp_avg"], rtol=2.0**-20, atol=0.0)


def test_probe_refuses_a_kernel_that_leaves_a_weight_behind():
    """The probe compares every element it steps: a kernel that leaves one weight as it was (the last of a tensor,
    the end that a wrong split over threads drops) is not used."""
    _native_or_skip()
    fn = af._native_fn()
    assert af._probe(fn)

    def lazy(count, params, *rest):  # the real kernel, then one tensor's last weight put back as it was
        import ctypes

        first = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))[0]
        before = ctypes.c_float.from_address(first + 4 * (1031 * 287 - 1)).value
        out = fn(count, params, *rest)
        ctypes.c_float.from_address(first + 4 * (1031 * 287 - 1)).value = before
        return out

    assert af._PROBE[0][:2] == ((1031, 287), torch.float32)
    assert not af._probe(lazy)


@pytest.mark.parametrize("key, bad", [("exp_avg_sq_row", torch.zeros(3)), ("exp_avg", torch.zeros(30, 40).t()),
                                      ("kahan_comp", torch.zeros(40, 30))], ids=["shape", "layout", "dtype"])
def test_state_the_kernel_cannot_take_goes_to_the_eager_step(key, bad):
    """A state tensor of another shape, layout or dtype (edited, or from a checkpoint that did not fit) never reaches
    the C kernel, which would write outside it: the eager step takes the tensor, and raises on a wrong shape."""
    p = nn.Parameter(torch.randn(40, 30).bfloat16())
    opt = Adafactor([p], lr=LR, beta1=0.9)
    p.grad = torch.randn(40, 30).bfloat16()
    opt.step()
    opt.state[p][key] = bad
    if bad.shape == p.shape:
        opt.step()  # a transposed exp_avg, an fp32 kahan_comp: the eager step manages them
        assert p.isfinite().all()
    else:
        with pytest.raises(RuntimeError):
            opt.step()


def test_native_kernel_is_a_torch_op():
    """One call of hf_efficient::adafactor_step per step, whatever the number of tensors."""
    _native_or_skip()
    params = [nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = Adafactor(params, lr=LR)
    for p in params:
        p.grad = torch.randn(p.shape)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    assert [e.count for e in prof.key_averages() if e.key == "hf_efficient::adafactor_step"] == [1]


# ------------------------------------------------------------------------------------------ compensation

SPACING = 2.0**-7  # bf16 spacing in [1, 2)


@pytest.mark.parametrize("dtype, native", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, False)],
                         ids=["bf16-C-kernel", "bf16-eager", "fp16"])
def test_stale_weights_shown_and_fixed(dtype, native, monkeypatch):
    """Weights in [1, 1.5) (bf16 spacing 2**-7) and steps of lr = 1e-4 (the clipped update's RMS is 1): 1/78 of a
    spacing, 60 steps. Rounded to nearest (``none``) nothing moves; Kahan holds every weight within one spacing of
    the same run on fp32 weights (the buffer keeps what the weight could not absorb); stochastic rounding is
    unbiased, so the mean over 8192 weights is within 0.1 spacing of the fp32 run's mean. fp16 weights (spacing
    2**-10) take the eager step on CPU: the same bounds hold there with room."""
    if native:
        _native_or_skip()

    def run(dtype, compensation="kahan"):
        with monkeypatch.context() as m:
            if not native:
                m.setattr(af, "_native_fn", lambda: None)
            g = torch.Generator().manual_seed(0)
            start = (1.0 + 0.5 * torch.rand(64, 128, generator=g)).bfloat16()
            params = [nn.Parameter(start.to(dtype, copy=True)), nn.Parameter(start[0].to(dtype, copy=True))]
            opt = Adafactor(params, lr=1e-4, compensation=compensation)
            for _ in range(60):
                for p in params:
                    p.grad = (1.0 + 0.1 * torch.randn(p.shape, generator=g)).to(dtype)
                opt.step()
        return [p.float() for p in params], [start.float(), start[0].float()], opt  # a matrix and a vector

    ref, start, _ = run(torch.float32)
    for r, s in zip(ref, start):
        assert 60 * 1e-4 * 0.5 < (s - r).mean().item() < 60 * 1e-4 * 1.5  # ~0.8 spacing
    stale, _, _ = run(dtype, "none")
    assert all(torch.equal(a, s) for a, s in zip(stale, start))
    kahan, _, opt = run(dtype, "kahan")
    assert all((a - r).abs().max().item() <= SPACING for a, r in zip(kahan, ref))
    assert all(st["kahan_comp"].dtype == torch.bfloat16 for st in opt.state.values())
    sr, _, opt = run(dtype, "stochastic")
    assert abs((sr[0] - ref[0]).mean().item()) < 0.1 * SPACING
    assert all("kahan_comp" not in st for st in opt.state.values())


def test_compensation_is_a_no_op_on_fp32_weights(monkeypatch):
    runs = [_train(torch.float32, True, monkeypatch, compensation=mode) for mode in ("kahan", "stochastic", "none")]
    for params, opt in runs:
        assert all("kahan_comp" not in opt.state[p] for p in params)
        assert all(torch.equal(a, b) for a, b in zip(params, runs[0][0]))


def test_bad_compensation_is_refused():
    with pytest.raises(ValueError, match=r"compensation='fancy'.*'kahan', 'stochastic', 'none'"):
        Adafactor([nn.Parameter(torch.zeros(2))], compensation="fancy")
    _group_error({}, {"compensation": "round"}, r"compensation='round'")


# ------------------------------------------------------------------------------------------ resume

RESUME = [(33, 70), (70,), (5, 6, 7)]  # matrix, vector, batch (bf16), and an fp32 matrix beside them


def _resume_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.randn(s, generator=gen).bfloat16()) for s in RESUME]
    return ps + [nn.Parameter(torch.randn(9, 4, generator=gen))]


def _resume_grads(params, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen).to(p.dtype) for p in params] for _ in range(steps)]


def _steps(opt, params, grads):
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g
        opt.step()


def _groups(params, **kw):
    return [{"params": params[:2], **kw}, {"params": params[2:], "weight_decay": 0.0}]


@pytest.mark.parametrize("native", [True, False], ids=["C-kernel", "eager"])
@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
def test_resume_is_exact(native, compensation, monkeypatch):
    """Save after 3 steps, ``torch.load(weights_only=True)``, load into a fresh optimizer on the saved weights, 3
    more steps: bit for bit the uninterrupted run (weights and every state tensor, kahan_comp included; stochastic
    rounding draws from (position, step, element), nothing saved)."""
    if native:
        _native_or_skip()
    else:
        monkeypatch.setattr(af, "_native_fn", lambda: None)
    grads = _resume_grads(_resume_params(), 6)
    full = _resume_params()
    opt = Adafactor(_groups(full, weight_decay=0.1), lr=LR, beta1=0.9, compensation=compensation)
    _steps(opt, full, grads)

    half = _resume_params()
    first = Adafactor(_groups(half, weight_decay=0.1), lr=LR, beta1=0.9, compensation=compensation)
    _steps(first, half, grads[:3])
    buf = io.BytesIO()
    torch.save({"opt": first.state_dict(), "weights": [p.detach() for p in half]}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = [nn.Parameter(w.clone()) for w in saved["weights"]]
    second = Adafactor(_groups(resumed), lr=LR, compensation="none")  # the saved groups' hyperparameters win
    second.load_state_dict(saved["opt"])
    assert [g["compensation"] for g in second.param_groups] == [compensation] * 2
    _steps(second, resumed, grads[3:])
    for a, b in zip(full, resumed):
        assert torch.equal(a, b)
        sa, sb = opt.state[a], second.state[b]
        assert set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)
    assert ("kahan_comp" in opt.state[full[0]]) == (compensation == "kahan")
    assert "kahan_comp" not in opt.state[full[-1]]  # fp32 weights have none


def test_load_keeps_fp32_statistics_of_low_precision_weights():
    """torch's load_state_dict casts floating state to the parameter's dtype; statistics stay fp32 here (from the
    saved values: no round trip through bf16), the Kahan buffer bf16, also for fp16 weights."""
    params = _resume_params() + [nn.Parameter(torch.randn(6, 5).half())]
    opt = Adafactor(_groups(params), lr=LR, beta1=0.9)
    _steps(opt, params, _resume_grads(params, 2))
    sd = opt.state_dict()
    fresh = Adafactor(_groups(params), lr=LR, beta1=0.9)
    fresh.load_state_dict(sd)
    for p in params:
        for k, v in fresh.state[p].items():
            want = torch.bfloat16 if k == "kahan_comp" else torch.float32
            assert v.dtype == want, (p.dtype, k, v.dtype)
            assert torch.equal(v, opt.state[p][k]) and v.is_contiguous()


def test_load_without_kahan_comp_starts_it_at_zero():
    """A state saved under compensation="none" (or before the option existed) resumes under kahan from a zero
    buffer, made by the load (compensation.drop_unused_buffers)."""
    params = _resume_params()
    opt = Adafactor(_groups(params), lr=LR, compensation="none")
    _steps(opt, params, _resume_grads(params, 2))
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        g["compensation"] = "kahan"
    fresh = Adafactor(_groups(params), lr=LR)
    fresh.load_state_dict(sd)
    assert all(not fresh.state[p]["kahan_comp"].any() for p in params if p.dtype != torch.float32)
    for g in sd["param_groups"]:
        del g["compensation"]  # saved before the option existed: the optimizer's own
    older = Adafactor(_groups(params), lr=LR, compensation="kahan")
    older.load_state_dict(sd)
    assert [g["compensation"] for g in older.param_groups] == ["kahan"] * 2
    _steps(older, params, _resume_grads(params, 1, seed=5))
    assert all(older.state[p]["kahan_comp"].any() for p in params[:3])


@pytest.mark.parametrize("change", ["fp32-weights", "stochastic"])
def test_load_drops_a_kahan_comp_no_longer_used(change, caplog):
    """A saved kahan_comp for weights that are fp32 now (PEFT reloads an adapter in fp32) or a group that no longer
    runs kahan is dropped, with one warning."""
    params = _resume_params()
    opt = Adafactor(_groups(params), lr=LR, compensation="kahan")  # saves a kahan_comp
    _steps(opt, params, _resume_grads(params, 2))
    sd = opt.state_dict()
    if change == "stochastic":
        for g in sd["param_groups"]:
            g["compensation"] = "stochastic"
        targets = params
    else:
        targets = [nn.Parameter(p.detach().float()) for p in params]
    fresh = Adafactor(_groups(targets), lr=LR)
    with caplog.at_level(logging.WARNING, logger="hf_efficient"):
        fresh.load_state_dict(sd)
    assert all("kahan_comp" not in fresh.state[p] for p in targets)
    warnings = [r for r in caplog.records if "kahan_comp" in r.getMessage()]
    assert len(warnings) == 1 and "dropped" in warnings[0].getMessage()
    _steps(fresh, targets, _resume_grads(targets, 1))
