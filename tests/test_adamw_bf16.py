"""AdamWBF16: stale weights shown and fixed, fp32-AdamW tracking on a tiny Llama, the three paths agreeing,
exact resume, state bytes and dtypes, fp32 parameters as torch.optim.AdamW, schedulers, errors.

Tolerances, and why:
- Stale weights (weights in [1, 1.5), updates ~lr far below half an ulp, 200 steps, ~4.4 ulps travelled):
  "kahan" weights stay within half an ulp of fp32 AdamW (measured 0.42) and weight + compensation within
  a quarter ulp (0.09), mean error under 2% of the distance (0.6%); "stochastic" is a random walk around
  the reference (std 1.6 ulps per weight), so only its mean is bounded: 5% of the distance (measured 1%,
  eight standard errors).
- Tiny Llama, 100 steps, both optimizers fed the same gradients (so the comparison is about the optimizer,
  not bf16 forward noise, which alone moves the loss curve ~1.2% even with fp32 master weights): at most 1%
  of elements outside atol 2e-3 / rtol 2e-2 (torch-optimi's bf16 criterion; measured 0% kahan, 0.2%
  stochastic), loss of the stored bf16 weights within 1% of fp32 AdamW's (measured 0.25% / 0.5%).
- Paths: foreach == single tensor bitwise. Compiled vs eager: the moments are bitwise equal; eager fp32
  sqrt (MKL/Sleef) and inductor's differ by an ulp, which flips a rounding in ~3e-5 of the elements: at
  most 0.1% of weights differ, by one ulp, and the Kahan sum weight + compensation agrees to 1e-6.
"""

from __future__ import annotations

import io
import logging
import shutil

import pytest
import torch

from conftest import tiny_llama
from hf_efficient.optim import _dispatch
from hf_efficient.optim import adamw_bf16 as mod
from hf_efficient.optim.adamw_bf16 import COMPENSATIONS, AdamWBF16

HAS_COMPILER = shutil.which("g++") is not None or shutil.which("c++") is not None
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="torch.compile on CPU needs a C++ compiler")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's


def _params(dtype=torch.bfloat16, seed=0):
    """A mix: a 2-D weight, one >= 2**16 elements (own compiled call), vectors, a non-contiguous one, a scalar."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(48, 40), (70_001,), (33,), (1,)]
    ps = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5 + 1).to(dtype)) for s in shapes]
    ps.append(torch.nn.Parameter((torch.randn(24, 20, generator=g) * 0.5).to(dtype).t()))  # non-contiguous
    return ps


def _run(params, steps, start=0, opt=None, **kw):
    """Steps ``start`` to ``start + steps`` of a fixed sequence of pseudo-random gradients; returns the optimizer."""
    opt = opt or AdamWBF16(params, lr=1e-3, **kw)
    g = torch.Generator().manual_seed(1)
    for step in range(start + steps):
        for p in params:
            grad = torch.randn(p.shape, generator=g).to(p.dtype)
            if step >= start:
                p.grad = grad
        if step >= start:
            opt.step()
    return opt


def _snapshot(opt):
    params = [p for group in opt.param_groups for p in group["params"]]
    return [p.detach().clone() for p in params], [{k: v.clone() for k, v in opt.state[p].items()} for p in params]


def _assert_same(a, b):
    (pa, sa), (pb, sb) = a, b
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
    for x, y in zip(sa, sb):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


# ---------------------------------------------------------------------------------------------- stale weights


def _quadratic(make_opt, w0, target, dtype, steps=200):
    w = torch.nn.Parameter(w0.clone().to(dtype))
    opt = make_opt([w])
    for _ in range(steps):
        w.grad = (w.detach().float() - target).to(dtype)
        opt.step()
    return w.detach().float(), opt


@pytest.mark.parametrize("dtype, lr", [(torch.bfloat16, 2e-4), (torch.float16, 2.5e-5)])
def test_stale_weights_shown_and_fixed(dtype, lr):
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10  # spacing of weights in [1, 2)
    g = torch.Generator().manual_seed(0)
    w0 = (1 + 0.5 * torch.rand(4096, generator=g)).to(dtype).float()
    target = w0 - 8 * ulp  # far enough that every step pushes the same way
    ref, _ = _quadratic(lambda p: torch.optim.AdamW(p, lr=lr), w0, target, torch.float32)
    travelled = (w0 - ref).mean().item()
    assert travelled > 3 * ulp  # the fp32 reference moves several ulps...

    plain, _ = _quadratic(lambda p: torch.optim.AdamW(p, lr=lr), w0, target, dtype)
    assert torch.equal(plain, w0)  # ...bf16/fp16 torch AdamW not at all: every update is rounded away
    none, _ = _quadratic(lambda p: AdamWBF16(p, lr=lr, compensation="none", compile=False), w0, target, dtype)
    assert torch.equal(none, w0)

    kahan, opt = _quadratic(lambda p: AdamWBF16(p, lr=lr, compile=False), w0, target, dtype)
    assert (kahan - ref).abs().max().item() <= ulp / 2  # the stored weight: the reference, rounded
    comp = opt.state[opt.param_groups[0]["params"][0]]["kahan_comp"].float()
    err = kahan + comp - ref  # weight + compensation: what an fp32 master copy would hold
    assert abs(err.mean().item()) <= 0.02 * travelled and err.abs().max().item() <= ulp / 4

    sr, _ = _quadratic(lambda p: AdamWBF16(p, lr=lr, compensation="stochastic", compile=False), w0, target, dtype)
    assert abs((sr - ref).mean().item()) <= 0.05 * travelled
    assert (sr - w0).abs().mean().item() > 0.9 * travelled


def test_stochastic_rounding_picks_a_neighbour_without_bias():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g) * torch.exp(torch.randn(200_000, generator=g) * 4)
    x = torch.cat([x, torch.tensor([0.0, 1.0, 2.0, -1.0 - 2**-9, 2 - 2**-10, float("inf"), 3e38])])
    idx = torch.arange(x.numel(), dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float16):
        finite = x.abs() < (60000 if dtype == torch.float16 else 3e38)
        xs = x[finite & ((x.abs() > 1e-4) | (x == 0))] if dtype == torch.float16 else x  # fp16 normal range
        y = mod._round_stochastic(xs, dtype, mod._hash(torch.tensor(7, dtype=torch.int32), idx[: xs.numel()]))
        near = xs.to(dtype)
        other = torch.nextafter(near, torch.where(xs >= near.float(), torch.inf, -torch.inf).to(dtype)).float()
        assert ((y == near.float()) | (y == other)).all()
        for v in (1.0 + 0.3 * 2**-7, 1.0 - 0.3 * 2**-8, -5.3e-3, 1024.7):
            n = 100_000
            mean = mod._round_stochastic(torch.full((n,), v), dtype, mod._hash(
                torch.tensor(11, dtype=torch.int32), torch.arange(n, dtype=torch.int32))).double().mean().item()
            spacing = abs(v) * (2.0**-7 if dtype == torch.bfloat16 else 2.0**-10)
            assert abs(mean - v) < 5 * 0.5 * spacing / n**0.5  # five standard errors


# ---------------------------------------------------------------------------------- against fp32 on a model


def test_tracks_fp32_adamw_on_tiny_llama():
    """Same gradients into fp32 AdamW (fp32 weights) and AdamWBF16 (bf16 copies of the weights), 100 steps."""
    ref = tiny_llama()
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 256, (8, 32), generator=g) for _ in range(4)]
    runs = {}
    for mode in COMPENSATIONS:
        ps = [p.detach().clone().bfloat16() for p in ref.parameters()]
        runs[mode] = (ps, AdamWBF16(ps, lr=1e-3, compensation=mode, compile=False), [])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_losses = []

    def loss_of(weights, x):  # evaluated in fp32, so only the stored weights differ
        saved = [p.detach().clone() for p in ref.parameters()]
        with torch.no_grad():
            for p, w in zip(ref.parameters(), weights):
                p.copy_(w)
            loss = ref(input_ids=x, labels=x).loss.item()
            for p, s in zip(ref.parameters(), saved):
                p.copy_(s)
        return loss

    for step in range(101):
        x = data[step % len(data)]
        if step % 20 == 0:
            ref_losses.append(loss_of(list(ref.parameters()), x))
            for ps, _, losses in runs.values():
                losses.append(loss_of(ps, x))
        if step == 100:
            break
        ref(input_ids=x, labels=x).loss.backward()
        for ps, opt, _ in runs.values():
            for p, q in zip(ps, ref.parameters()):
                p.grad = q.grad.bfloat16()
            opt.step()
        ref_opt.step()
        ref_opt.zero_grad()

    assert ref_losses[-1] < 0.5 * ref_losses[0]  # it learned something
    total = sum(p.numel() for p in ref.parameters())
    for mode, (ps, _, losses) in runs.items():
        outside = sum((~torch.isclose(p.float(), q, atol=2e-3, rtol=2e-2)).sum().item()
                      for p, q in zip(ps, ref.parameters()))
        loss_gap = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
        if mode == "none":  # the control: stale updates are visible in the loss
            assert loss_gap > 0.05
        else:
            assert outside <= 0.01 * total, mode
            assert loss_gap <= 0.01, mode


# -------------------------------------------------------------------------------------------------- paths


@pytest.mark.parametrize("mode", COMPENSATIONS)
def test_foreach_equals_single_tensor(mode, monkeypatch):
    for dtype in (torch.bfloat16, torch.float16):
        a = _run(_params(dtype), 4, compensation=mode, foreach=False, compile=False)
        b = _run(_params(dtype), 4, compensation=mode, foreach=True, compile=False)
        _assert_same(_snapshot(a), _snapshot(b))
    monkeypatch.setattr(mod, "_FOREACH_CHUNK", 1000)  # big tensors go through the kernel in pieces
    c = _run(_params(), 4, compensation=mode, foreach=False, compile=False)
    _assert_same(_snapshot(c), _snapshot(_run(_params(), 4, compensation=mode, foreach=True, compile=False)))


@needs_compiler
@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_compiled_matches_eager(mode, monkeypatch):
    monkeypatch.setattr(_dispatch, "_COMPILED", {})  # another test may have replaced torch.compile while caching
    torch._dynamo.reset()  # graphs other tests compiled count towards dynamo's recompile limit
    eager = _run(_params(), 4, compensation=mode, foreach=False, compile=False)
    compiled = _run(_params(), 4, compensation=mode, compile=True)
    key = mod._compiled_key(mode, torch.device("cpu"), torch.bfloat16)
    assert _dispatch._COMPILED[key] is not None, "the compiled kernel was rejected"
    (pe, se), (pc, sc) = _snapshot(eager), _snapshot(compiled)
    ulp = 2.0**-7 * 2  # weights are within (0, 4)
    for x, y, a, b in zip(pe, pc, se, sc):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
        differ = (x != y).float().mean().item()
        assert differ <= 1e-3 and (x.float() - y.float()).abs().max().item() <= ulp
        if mode == "kahan":
            sum_e, sum_c = x.float() + a["kahan_comp"].float(), y.float() + b["kahan_comp"].float()
            torch.testing.assert_close(sum_c, sum_e, rtol=1e-6, atol=1e-7)


def _big():  # the usual tensors and one that splits over 2 threads (2 x 2**16 elements or more)
    return _params() + [torch.nn.Parameter(torch.rand(300_000, generator=torch.Generator().manual_seed(3))
                                           .bfloat16() + 0.5)]


def _assert_native_equals_eager(mode: str, caplog, monkeypatch) -> None:
    monkeypatch.setattr(_dispatch, "_LOGGED", set())  # the path is logged once per process
    with caplog.at_level(logging.INFO, logger=_dispatch.__name__):
        native = _run(_big(), 4, compensation=mode)
    assert "native path" in caplog.text
    eager = _run(_big(), 4, compensation=mode, foreach=False, compile=False)
    (pn, sn), (pe, se) = _snapshot(native), _snapshot(eager)
    for x, y, a, b in zip(pn, pe, sn, se):
        assert torch.equal(x, y)
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
        if mode == "kahan":
            cn, ce = a["kahan_comp"].float(), b["kahan_comp"].float()
            assert (cn != ce).float().mean().item() <= 1e-4
            torch.testing.assert_close(cn, ce, rtol=2.0**-3, atol=1e-38)  # a few bf16 ulps of the residual


@pytest.mark.parametrize("mode", COMPENSATIONS)
@pytest.mark.parametrize("threads", [1, 2])
def test_native_kernel_equals_eager(mode, threads, caplog, monkeypatch):
    """The C kernel (the automatic path for bf16 on CPU) does eager's operations in eager's order: the same
    weights and moments bit for bit, over several steps, split over threads or not. kahan_comp, the sub-ulp
    residual, differs in a few elements in 10**5 by a few of its own bf16 ulps (the weights then still agree):
    torch's vectorized fp32 sqrt on CPU is not correctly rounded (1 ulp off in ~20% of elements, torch 2.13,
    AVX-512), C's sqrtf is; the last-bit difference in the update flips the residual's rounding near a tie."""
    if mod._native_fn() is None:
        pytest.skip("no C compiler: the C kernel is not built here")
    torch.set_num_threads(threads)
    _assert_native_equals_eager(mode, caplog, monkeypatch)


def test_native_kernel_is_a_torch_op():
    """The C kernel runs as the op hf_efficient::adamw_bf16_step: one call per step in the profiler, and
    torch.compile takes a step through it as an opaque op (same results as the eager-mode call)."""
    if mod._native_fn() is None:
        pytest.skip("no C compiler: the C kernel is not built here")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _run(_params(), 1)
    calls = [e.count for e in prof.key_averages() if e.key == "hf_efficient::adamw_bf16_step"]
    assert calls == [1], [e.key for e in prof.key_averages()]

    def step(*ts):
        torch.ops.hf_efficient.adamw_bf16_step(*(list(x) for x in ts), [5, 6], coef, "kahan", -1)

    coef = mod._coefficients(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1)
    gen = torch.Generator().manual_seed(0)
    sets = [[torch.randn(n, generator=gen).bfloat16() for n in (300, 70)] for _ in range(2)]
    sets += [[torch.zeros(n, dtype=torch.bfloat16) for n in (300, 70)] for _ in range(3)]  # m, v, kahan_comp
    copy = [[t.clone() for t in ts] for ts in sets]
    before = sets[0][0].clone()
    step(*sets)
    torch.compile(step, fullgraph=True, backend="aot_eager")(*copy)
    assert all(torch.equal(a, b) for xs, ys in zip(sets, copy) for a, b in zip(xs, ys))
    assert not torch.equal(before, sets[0][0])  # the weights moved


def test_native_kernel_without_openmp(monkeypatch, caplog, rebuild_native):
    """A compiler without OpenMP (Apple's clang): the library is built without it, Python threads split the
    elements, and the results are the same."""
    # a flag the compiler refuses, as it refuses -fopenmp
    lib = rebuild_native(_dispatch, _OPENMP="-fno-such-openmp-flag").load("adamw_bf16_cpu.c")
    if lib is None:
        pytest.skip("no C compiler: the C kernel is not built here")
    assert lib.openmp is False
    torch.set_num_threads(2)
    _assert_native_equals_eager("kahan", caplog, monkeypatch)


@pytest.mark.parametrize("mode", COMPENSATIONS)
def test_native_kernel_keeps_nonfinite_values(mode):
    """With nonfinite="ignore" NaN and inf gradients reach the kernel: NaN stays NaN and inf stays inf where eager
    has them (the C rounding has no NaN test; a signalling bf16 NaN among the gradients included)."""
    fn = mod._native_fn()
    if fn is None:
        pytest.skip("no C compiler: the C kernel is not built here")
    g = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-3, 0.0, 3e38] * 20).bfloat16()
    g.view(torch.int16)[::7] = 0x7F81  # signalling NaN
    state = lambda: [torch.linspace(-2, 2, g.numel()).bfloat16(), g.clone()] + [  # noqa: E731
        torch.full_like(g, 1e-4) for _ in range(3)]
    coef = mod._coefficients(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=2)
    native, eager = state(), state()
    mod._native_path(fn, mode, *([t] for t in native[:4]), [native[4]] if mode == "kahan" else None, [7], coef)
    mod._KERNELS[mode](*eager, torch.tensor(7, dtype=torch.int32), None, torch.tensor(coef))
    for name, a, b in zip(("weights", "grads", "exp_avg", "exp_avg_sq", "kahan_comp"), native, eager):
        if name == "kahan_comp" and mode != "kahan":
            continue
        a, b = a.float(), b.float()
        assert torch.equal(a.isnan(), b.isnan()), name
        assert torch.equal(a[~a.isnan()], b[~b.isnan()]), name


def test_native_kernel_missing_compiler_falls_back(monkeypatch, caplog, rebuild_native):
    """No C compiler (or a failing one): a warning, and the optimizer keeps working on another path."""
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    native = rebuild_native(_dispatch)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        opt = _run(_params(), 2, compensation="none")
    assert "could not build adamw_bf16_cpu.c" in caplog.text
    assert _dispatch._COMPILED[("native", "adamw_bf16_cpu.c", "adamw_bf16_step")] is None
    _assert_same(_snapshot(opt), _snapshot(_run(_params(), 2, compensation="none", compile=True)))


def test_failed_compile_falls_back_to_foreach(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(_dispatch, "_COMPILED", {})
    monkeypatch.setattr(_dispatch, "_LOGGED", set())  # a failure is logged once per process
    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level(logging.WARNING, logger=_dispatch.__name__):
        fallback = _run(_params(), 3, compile=True)
    assert "no C++ compiler here" in caplog.text and "next path" in caplog.text
    _assert_same(_snapshot(fallback), _snapshot(_run(_params(), 3, foreach=True, compile=False)))


def test_probe_rejects_a_kernel_that_loses_the_compensation(monkeypatch, caplog):
    """What inductor does without emulate_precision_casts: new.float() becomes the unrounded value."""

    def elides_rounding(p, g, m, v, c, key, idx, coef):
        p32 = p.float()
        y = mod._adamw_update(p32, g, m, v, coef, mod._hash(key, mod._index(idx, p))) + c.float()
        new = p32 + y
        c.copy_(y - (new - p32))
        p.copy_(new)

    monkeypatch.setattr(_dispatch, "_COMPILED", {})
    monkeypatch.setattr(_dispatch, "_LOGGED", set())  # a failure is logged once per process
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: elides_rounding if fn is mod._KERNELS["kahan"] else fn)
    with caplog.at_level(logging.WARNING, logger=_dispatch.__name__):
        assert mod._compiled_kernel("kahan", torch.device("cpu"), torch.bfloat16) is None
    assert "disagrees with the eager one" in caplog.text


# ------------------------------------------------------------------------------------------------- resume


@pytest.mark.parametrize("mode, path", [(m, "foreach") for m in COMPENSATIONS] + [
    pytest.param(m, p, marks=needs_compiler) for m in ("kahan", "stochastic") for p in ("compiled", "native")])
def test_resume_equals_uninterrupted(mode, path):
    kw = dict(compensation=mode) if path == "native" else dict(compensation=mode, compile=path == "compiled")
    whole = _run(_params(), 6, **kw)

    params = _params()
    first = _run(params, 3, **kw)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = AdamWBF16(params, lr=1e-3, **kw)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    _run(params, 3, start=3, opt=resumed)
    _assert_same(_snapshot(whole), _snapshot(resumed))


def test_fp16_state_stays_bf16_through_save_and_load():
    params = _params(torch.float16)
    opt = _run(params, 2, compile=False)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = AdamWBF16(params, lr=1e-3, compile=False)
    loaded.load_state_dict(torch.load(buf, weights_only=True))
    for p in params:
        for key in ("exp_avg", "exp_avg_sq", "kahan_comp"):
            assert loaded.state[p][key].dtype == torch.bfloat16
            assert torch.equal(loaded.state[p][key], opt.state[p][key])


# -------------------------------------------------------------------------------------- state and fp32 params


@pytest.mark.parametrize("mode, per_param", [("kahan", 6), ("stochastic", 4), ("none", 4)])
def test_state_bytes(mode, per_param):
    for dtype in (torch.bfloat16, torch.float16):
        params = _params(dtype)
        opt = _run(params, 1, compensation=mode, compile=False)
        for p in params:
            state = opt.state[p]
            assert state["step"].dtype == torch.float32 and state["step"].item() == 1
            buffers = {k: v for k, v in state.items() if k != "step"}
            assert all(v.dtype == torch.bfloat16 for v in buffers.values())
            assert sum(v.numel() * v.element_size() for v in buffers.values()) == per_param * p.numel()
            assert ("kahan_comp" in state) == (mode == "kahan")


def test_fp32_parameters_get_plain_adamw_and_say_so(caplog):
    with caplog.at_level(logging.INFO, logger=mod.__name__):
        opt = _run(_params(torch.float32), 1, compensation="kahan", compile=False)
    assert "only [\'torch.float32\'] parameters" in caplog.text and "plain AdamW" in caplog.text
    for p in opt.param_groups[0]["params"]:
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}  # no compensation buffer: pointless
        assert opt.state[p]["exp_avg"].dtype == torch.float32

    caplog.clear()
    mixed = _params()[:2] + _params(torch.float32)[:1]
    with caplog.at_level(logging.INFO, logger=mod.__name__):
        AdamWBF16(mixed)
    assert "1 of 3 parameter tensors" in caplog.text


@pytest.mark.parametrize("ours, theirs", [({}, {"fused": True}), ({"foreach": True}, {"foreach": True}),
                                          ({"foreach": False}, {"foreach": False})],
                         ids=["default-fused", "foreach", "single-tensor"])
def test_fp32_parameters_equal_torch_adamw(ours, theirs):
    """fp32 tensors, alone or beside bf16 ones, get exactly torch.optim.AdamW (fused / foreach / for-loop), each
    gradient in its weight's layout as autograd gives it (torch's fused kernel steps a transposed weight with a
    row-major gradient wrong, walking both flat: AdamWBF16 then takes the foreach path, tests/test_layouts.py)."""
    bf16 = _params()[:2]
    mine = _params(torch.float32)
    opt = AdamWBF16([{"params": mine}, {"params": bf16, "lr": 2e-3}], lr=1e-3, weight_decay=0.1, **ours)
    reference = _params(torch.float32)
    ref_opt = torch.optim.AdamW(reference, lr=1e-3, weight_decay=0.1, **theirs)
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        for p, q in zip(mine, reference):
            p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=g))
            q.grad = p.grad.clone()
        for p in bf16:
            p.grad = torch.randn(p.shape, generator=g).bfloat16()
        opt.step()
        ref_opt.step()
    for p, q in zip(mine, reference):
        assert torch.equal(p, q)
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], ref_opt.state[q][k]), k


# ------------------------------------------------------------------------------------- schedulers and errors


def test_lambdalr_drives_the_learning_rate():
    def run(schedule: bool):
        params = _params()
        opt = AdamWBF16(params, lr=1e-2, compile=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s) if schedule else None
        g = torch.Generator().manual_seed(5)
        for step in range(4):
            if not schedule:
                opt.param_groups[0]["lr"] = 1e-2 * 0.5**step
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).bfloat16()
            opt.step()
            if sched:
                sched.step()
        return opt

    scheduled = run(True)
    assert scheduled.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**4)
    _assert_same(_snapshot(scheduled), _snapshot(run(False)))

    frozen = _params()
    before = [p.detach().clone() for p in frozen]
    opt = AdamWBF16(frozen, lr=1e-2, compile=False)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0)  # lr 0: nothing moves
    _run(frozen, 2, opt=opt)
    assert all(torch.equal(a, b) for a, b in zip(before, frozen))


def test_invalid_arguments_are_named():
    p = [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match="compensation='kahn'.*'kahan', 'stochastic', 'none'"):
        AdamWBF16(p, compensation="kahn")
    with pytest.raises(ValueError, match="lr=-1"):
        AdamWBF16(p, lr=-1)
    with pytest.raises(ValueError, match="beta2=1.0"):
        AdamWBF16(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="foreach=True and compile=True"):
        AdamWBF16(p, foreach=True, compile=True)
    opt = AdamWBF16(p)
    with pytest.raises(ValueError, match="compensation='stochastc'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "compensation": "stochastc"})
    with pytest.raises(TypeError):
        AdamWBF16(p, 1e-3)  # hyperparameters are keyword-only


_PATHS = [pytest.param({}, id="C kernel (automatic)"), pytest.param({"compile": True}, id="compiled",
                                                                    marks=needs_compiler),
          pytest.param({"foreach": True}, id="foreach"), pytest.param({"foreach": False}, id="single tensor")]


@pytest.mark.parametrize("path", _PATHS)
@pytest.mark.parametrize("compensation", COMPENSATIONS)
def test_gradients_whose_square_overflows_keep_state_finite(path, compensation):
    """A gradient of 2e19 (g * g overflows fp32) and a run of 3e38 (bf16-finite): the moments are clamped to bf16's
    largest value (fp32's rounds to bf16 inf), so state and weights stay finite, and the other elements move as
    AdamW moves them, on every path."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000, generator=g).bfloat16())
    before = p.detach().clone()
    opt = AdamWBF16([p], lr=1e-2, weight_decay=0.0, compensation=compensation, **path)
    for step in range(3):
        grad = torch.randn(p.shape, generator=g) * 0.01
        if step == 0:
            grad[5], grad[300:310] = 2e19, 3e38
        p.grad = grad.bfloat16()
        opt.step()
    assert all(t.isfinite().all() for t in opt.state[p].values() if t.is_floating_point()), opt.state[p]
    assert p.isfinite().all()
    moved = (p.detach().float() - before.float()).abs()
    others = torch.ones(1000, dtype=torch.bool)
    others[5], others[300:310] = False, False
    assert (moved[others] < 0.1).all() and (moved[others] > 0).float().mean() > 0.5


def test_number_step_in_loaded_state_becomes_a_tensor():
    """torch accepts a Python number as a saved step; it used to crash the next step (_foreach_add_ on a float)."""
    p = torch.nn.Parameter(torch.randn(100).bfloat16())
    opt = AdamWBF16([p], lr=1e-3)
    p.grad = torch.randn(100).bfloat16()
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["step"] = 1
    fresh = AdamWBF16([q := torch.nn.Parameter(p.detach().clone())], lr=1e-3)
    fresh.load_state_dict(sd)
    assert torch.is_tensor(fresh.state[q]["step"]) and fresh.state[q]["step"].dtype == torch.float32
    q.grad = p.grad.clone()
    fresh.step()
    assert fresh.state[q]["step"].item() == 2.0
    sd["state"][0]["step"] = "two"
    with pytest.raises(ValueError, match="step"):
        fresh.load_state_dict(sd)
    assert fresh.state[q]["step"].item() == 2.0


def test_compensation_state_that_no_longer_applies_is_dropped(caplog):
    """PEFT resumes a bf16 LoRA adapter in fp32: the checkpoint's kahan_comp would be kept (cast to fp32) while the
    tensor runs plain AdamW, and the Trainer would log a negative saving. It is dropped, with a warning."""
    import logging

    p = torch.nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16))
    opt = AdamWBF16([p], lr=1e-3)
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    assert "kahan_comp" in sd["state"][0]
    q = torch.nn.Parameter(p.detach().float())
    opt2 = AdamWBF16([q], lr=1e-3)
    with caplog.at_level(logging.WARNING, logger="hf_efficient.optim.adamw_bf16"):
        opt2.load_state_dict(sd)
    assert "kahan_comp" not in opt2.state[q] and opt2.state[q]["exp_avg"].dtype == torch.float32
    assert "dropped the saved kahan_comp of 1" in caplog.text
    q.grad = torch.randn_like(q)
    opt2.step()
    assert torch.isfinite(q).all()
