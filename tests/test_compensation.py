"""compensation=kahan|stochastic|none for every name on bf16/fp16 weights (optim/compensation.py).

The stale-weights problem: weights near 1.0 (bf16 spacing 2**-7) and updates of ~1e-4 per step, 1/78 of that
spacing (each name at the learning rate that moves a weight by that much a step on average: Muon's update has an
RMS of 0.2 lr, AdamW's here ~lr). Rounded to nearest (``none``) every update is lost; Kahan and stochastic rounding
must track the same optimizer run on fp32 weights. Tolerances: Kahan holds each weight within one bf16 spacing of the fp32 run (the
buffer keeps what the weight could not absorb; weight decay 0, so the update does not depend on the weight);
stochastic rounding is unbiased, so the mean over 8192 weights is within 0.1 spacing of the fp32 run's mean
(its per-weight error is a random walk of a few spacings).
"""

from __future__ import annotations

import io
import logging
import math

import pytest
import torch

import hf_efficient as hfe
from cases import bare, c_kernel, names, specs
from hf_efficient.optim import _native

NAMES = names()  # every name: each writes bf16/fp16 weights compensated
C_KERNEL = names(c_kernel)  # the quantized families with a C kernel (for 8-bit and fp32 state alike)
# a family's state converted into another family's of its math: both keep Kahan's buffer, which carries over
CONVERSIONS = [pytest.param(a.name, b.name, id=f"{a.name}-{b.name}") for a in specs() for b in specs()
               if a.backends and b.backends and not a.fallback and not b.fallback and a.facts is not b.facts
               and a.facts.math == b.facts.math and "kahan_comp" in a.facts.state and "kahan_comp" in b.facts.state]
SPACING = 2.0**-7  # bf16 spacing in [1, 2)
LR = 1e-4


def _weights(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = 1.0 + 0.5 * torch.rand(64, 128, generator=g)  # in [1, 1.5): one spacing everywhere
    return torch.nn.Parameter(w.to(torch.bfloat16).to(dtype))


def _grads(shape, seed=0):
    """Constant-sign gradients, the same for the same seed: a fixed matrix of full rank (so that an orthogonalised
    update moves each weight the same way at every step, as AdamW's does) and a little noise."""
    g = torch.Generator().manual_seed(seed + 1)
    base = 1.0 + 0.5 * torch.rand(shape, generator=g)
    while True:
        yield base + 0.1 * torch.randn(shape, generator=g)


def _drive(opt, p, steps, seed=0):
    """``steps`` steps on :func:`_grads` (each update ~LR)."""
    for _, g in zip(range(steps), _grads(p.shape, seed)):
        p.grad = g.to(p.dtype)
        opt.step()


_LRS: dict = {}


def _lr(name) -> float:
    """The learning rate at which ``name``'s first fp32 step moves a weight by LR on average."""
    if name not in _LRS:
        p = _weights(torch.float32)
        start = p.detach().clone()
        _drive(hfe.create_optimizer(bare(name, [p]), name, lr=LR, weight_decay=0.0), p, 1)
        _LRS[name] = LR * LR / (p.detach() - start).abs().mean().item()
    return _LRS[name]


def _run(name, dtype, steps, seed=0, **options):
    """``steps`` steps of ``name`` on a (64, 128) weight (:func:`_drive`)."""
    p = _weights(dtype, seed)
    opt = hfe.create_optimizer(bare(name, [p]), name, lr=_lr(name), weight_decay=0.0, **options)
    _drive(opt, p, steps, seed)
    return p, opt


@pytest.mark.parametrize("name", NAMES)
def test_stale_weights_shown_and_fixed(name):
    start = _weights(torch.float32)
    ref, _ = _run(name, torch.float32, 60)
    moved = (start - ref).abs().mean().item()
    assert moved > 60 * LR * 0.5  # the fp32 run moves (~0.8 spacing: updates of ~LR a step, in one direction)
    stale, _ = _run(name, torch.bfloat16, 60, compensation="none")
    assert torch.equal(stale.float(), start)  # every update rounded away
    kahan, opt = _run(name, torch.bfloat16, 60, compensation="kahan")
    assert (kahan.float() - ref).abs().max().item() <= SPACING
    assert opt.state[kahan]["kahan_comp"].dtype == torch.bfloat16
    sr, opt = _run(name, torch.bfloat16, 60, compensation="stochastic")
    assert abs((sr.float() - ref).mean().item()) < 0.1 * SPACING
    assert "kahan_comp" not in opt.state[sr]


@pytest.mark.parametrize("name", NAMES)
def test_default_on_bf16_is_the_family_measured_choice(name):
    spec = hfe.registry.get_spec(name)
    p, opt = _run(name, torch.bfloat16, 2)
    assert opt.hf_efficient.options["compensation"] == spec.facts.compensation != "none"
    comp = opt.state[p].get("kahan_comp")
    assert (comp is not None and bool(comp.any())) == (spec.facts.compensation == "kahan")  # it holds the updates


@pytest.mark.parametrize("name", NAMES)
def test_fp16_weights_are_compensated_too(name):
    """fp16 weights take the torch paths (no C kernel): same guarantee, spacing 2**-10 near 1."""
    ref, _ = _run(name, torch.float32, 20)
    for mode in ("kahan", "stochastic"):
        p, _ = _run(name, torch.float16, 20, compensation=mode)
        assert abs((p.float() - ref).mean().item()) < 0.1 * 2.0**-10
    kahan, _ = _run(name, torch.float16, 20, compensation="kahan")
    stale, _ = _run(name, torch.float16, 20, compensation="none")
    # fp16 keeps some of the updates, not all (or rounds them up): further from the fp32 run than Kahan's weights
    assert (stale.float() - ref).abs().mean() > 2 * (kahan.float() - ref).abs().mean()


def test_on_fp32_weights_the_option_is_a_no_op_and_says_so_once(caplog, monkeypatch):
    monkeypatch.setattr(hfe.factory, "_SAID", set())  # once per process: an earlier test may have said it
    with caplog.at_level(logging.WARNING, logger="hf_efficient.factory"):
        a, _ = _run("adam8bit", torch.float32, 3, compensation="kahan")
        _run("adam8bit", torch.float32, 1, compensation="kahan")
    b, opt = _run("adam8bit", torch.float32, 3, compensation="none")
    assert torch.equal(a, b) and "kahan_comp" not in opt.state[b]
    assert caplog.text.count("compensation=kahan has no effect here") == 1


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_resume_is_exact_with_the_compensation(name, mode):
    """3 steps, state_dict through torch.save / torch.load(weights_only=True), 3 more == 6 uninterrupted."""
    full, _ = _run(name, torch.bfloat16, 6, compensation=mode)
    p, opt = _run(name, torch.bfloat16, 3, compensation=mode)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = hfe.create_optimizer(bare(name, [q]), name, lr=_lr(name), weight_decay=0.0, compensation=mode)
    opt2.load_state_dict(sd)
    grads = [g.to(torch.bfloat16) for _, g in zip(range(6), _grads(q.shape))]
    for grad in grads[3:]:  # _drive's gradients 4 to 6
        q.grad = grad
        opt2.step()
    assert torch.equal(q, full)


@pytest.mark.parametrize("src, dst", CONVERSIONS)
def test_cross_family_checkpoints_carry_the_buffer(src, dst):
    p, opt = _run(src, torch.bfloat16, 3, compensation="kahan")
    sd = opt.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = hfe.create_optimizer(bare(dst, [q]), dst, lr=LR, weight_decay=0.0, compensation="kahan")
    opt2.load_state_dict(sd)
    assert torch.equal(opt2.state[q]["kahan_comp"], opt.state[p]["kahan_comp"])
    q.grad = torch.ones_like(q)
    opt2.step()


def test_a_backend_without_compensation_is_refused_or_skipped(monkeypatch):
    """bitsandbytes rounds bf16 weights to nearest: forced, it is refused on bf16 weights unless compensation=none;
    never chosen automatically for them, not even on CUDA without Triton, where it is the only other backend."""
    import importlib.util

    pytest.importorskip("bitsandbytes")
    p = _weights(torch.bfloat16)
    with pytest.raises(ValueError, match="backend='bnb' writes bf16/fp16 weights rounded to nearest.*compensation=none"):
        hfe.create_optimizer([p], "adam8bit", backend="bnb")
    assert hfe.create_optimizer([p], "adam8bit", backend="bnb", compensation="none").hf_efficient.resolution.backend == "bnb"
    if importlib.util.find_spec("triton"):  # on CUDA our Triton kernel comes first
        assert hfe.registry.resolve("adam8bit", "cuda", compensated=True, log=False).backend == "torch"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert hfe.registry.resolve("adam8bit", "cuda", log=False).backend == "bnb"  # fp32 weights: bnb serves
    with pytest.raises(RuntimeError, match="bnb writes bf16/fp16 weights rounded to nearest"):
        hfe.registry.resolve("adam8bit", "cuda", compensated=True, log=False)


@pytest.mark.skipif(_native.c_compiler() is None, reason="no C compiler: no C kernel to compare")
@pytest.mark.parametrize("name", C_KERNEL)
@pytest.mark.parametrize("mode", ["kahan", "stochastic", "none"])
def test_c_kernel_equals_eager_under_each_mode(name, mode):
    """bf16 weights: state exact; weights within one bf16 spacing (the fp32 update may differ in its last bit:
    C's sqrt is correctly rounded, torch's is not), and under Kahan weight + buffer within 1e-4 relative."""
    runs = []
    for compile in (None, False):  # automatic: the C kernel; False: the eager one
        p = _weights(torch.bfloat16)
        opt = hfe.create_optimizer(bare(name, [p]), name, lr=LR, weight_decay=0.0, compensation=mode)
        opt.param_groups[0]["compile"] = compile
        _drive(opt, p, 4)
        uses_c = type(opt).choose(p, p.grad, compile) is type(opt)._op
        assert uses_c == (compile is None)
        runs.append((p, opt.state[p]))
    (pn, sn), (pe, se) = runs
    assert all(torch.equal(v, se[k]) for k, v in sn.items() if k != "kahan_comp")
    torch.testing.assert_close(pn.float(), pe.float(), rtol=SPACING, atol=0.0)
    if mode == "kahan":
        torch.testing.assert_close(pn.float() + sn["kahan_comp"].float(), pe.float() + se["kahan_comp"].float(),
                                   rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["kahan", "stochastic", "none"])
def test_write_all_equals_write_per_tensor(mode, dtype):
    """write_all's one set of operations over a flat buffer gives each tensor exactly what write gives it alone."""
    from hf_efficient.optim.compensation import fp32_copies, write, write_all

    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (300,), (1,), (33, 2, 4)]
    params = [(1.0 + torch.rand(s, generator=g)).to(dtype) for s in shapes]
    new32 = [p.float() + torch.randn(p.shape, generator=g) * 1e-3 for p in params]
    comps = [(torch.randn(p.shape, generator=g) * 1e-4).bfloat16() for p in params]
    keys = [11, -5, 2**31 - 1, 0]
    ref_p, ref_c = [p.clone() for p in params], [c.clone() for c in comps]
    for p, c, n, k in zip(ref_p, ref_c, new32, keys):
        old = p.float()
        if mode == "none":
            p.copy_(n)
        else:
            write(p, old, n - old, c, mode, torch.tensor(k, dtype=torch.int32), None)
    old, _ = fp32_copies(params)
    write_all(params, old, torch.cat([n.reshape(-1) for n in new32]), comps, mode, keys)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_p))
    assert all(torch.equal(a, b) for a, b in zip(comps, ref_c))


@pytest.mark.skipif(_native.c_compiler() is None, reason="no C compiler: no C kernel")
@pytest.mark.parametrize("mode", ["kahan", "stochastic", "none"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("beta1", [0.9, 0.3])
def test_fp32_state_c_kernel_gives_the_torch_paths_bits(mode, grad_dtype, beta1, monkeypatch):
    """adamw_cpu.c (bf16 weights with fp32 moments: hf_eff_adamw, and 8-bit AdamW's biases and norms) against the
    torch path it replaces on CPU (torch's fused AdamW on fp32 copies, then write_all): weights, moments, Kahan
    buffers and steps equal bit for bit, on tensors whose sizes leave every length of torch's scalar tail (numel % 8),
    its elements split over 3 threads, both sides of torch's lerp (1 - beta1 below and above 0.5). x86 torch 2.13:
    another build may round its multiply-adds otherwise (the kernel's probe then allows 1e-6)."""
    from hf_efficient.optim import adamw

    assert adamw._KERNEL.fn() is not None, "the C kernel was refused by its probe"
    shapes = [(7, 5), (300,), (1,), (33, 2, 4), (70_001,), (3072,), (10,), (13,), (22,), (15,), (2 * 64 * 1024 + 3,)]
    assert {math.prod(s) % 8 for s in shapes} == set(range(8))  # every length of torch's scalar tail
    runs = []
    for c_kernel in (True, False):
        g = torch.Generator().manual_seed(1)
        ps = [(torch.randn(s, generator=g) * 0.1).bfloat16() for s in shapes]
        ms = [torch.randn(s, generator=g) * 1e-3 for s in shapes]
        vs = [torch.rand(s, generator=g) * 1e-5 for s in shapes]
        cs = [(torch.randn(s, generator=g) * 1e-4).bfloat16() for s in shapes] if mode == "kahan" else None
        steps = [torch.tensor(float(i % 3)) for i in range(len(shapes))]  # unequal steps: scalars per tensor
        kw = dict(lr=1e-2, beta1=beta1, beta2=0.99, eps=1e-8, weight_decay=0.1, compensation=mode, comps=cs,
                  keys=[3, -4, 5, 2**31 - 1, 7, 8, 10, 11, 12, 13, 9])
        torch_path = adamw._torch_path
        if c_kernel:  # the torch path must not run: every tensor here is the C kernel's, over 3 threads
            monkeypatch.setattr(adamw, "_torch_path", lambda *a, **k: pytest.fail("torch path used"))
            monkeypatch.setattr(_native.torch, "get_num_threads", lambda: 3)
        for _ in range(3):
            gs = [(torch.randn(s, generator=g) * 0.01).to(grad_dtype) for s in shapes]
            if c_kernel:
                adamw.adamw_fp32_state(ps, gs, ms, vs, None, steps, **kw)
            else:
                torch_path(ps, gs, ms, vs, [], steps, amsgrad=False, maximize=False, **kw)
        monkeypatch.undo()
        runs.append([ps, ms, vs, cs or [], steps])
    for a, b in zip(*runs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.skipif(_native.c_compiler() is None, reason="no C compiler: no C kernel")
@pytest.mark.parametrize("mode", ["kahan", "stochastic", "none"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_lion_fp32_state_c_kernel_gives_the_torch_paths_bits(mode, grad_dtype, monkeypatch):
    """lion8bit_cpu.c's lion_step (bf16 weights with an fp32 momentum: Lion8bit's small tensors) against the torch
    path it replaces on CPU: weights, momenta and Kahan buffers equal bit for bit, zero gradients and momenta
    included (sign(0) = 0), split over 3 threads."""
    from hf_efficient.optim import lion8bit

    assert lion8bit._KERNEL.fn() is not None, "the C kernel was refused by its probe"
    shapes = [(7, 5), (300,), (1,), (2 * 64 * 1024 + 3,)]
    runs = []
    for c_kernel in (True, False):
        g = torch.Generator().manual_seed(2)
        ps = [(torch.randn(s, generator=g) * 0.1).bfloat16() for s in shapes]
        ms = [torch.randn(s, generator=g) * 1e-3 * (torch.rand(s, generator=g) > 0.1) for s in shapes]
        cs = [(torch.randn(s, generator=g) * 1e-4).bfloat16() for s in shapes] if mode == "kahan" else None
        kw = dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, compensation=mode, comps=cs, keys=[3, -4, 5, 6])
        torch_path = lion8bit._torch_path
        if c_kernel:
            monkeypatch.setattr(lion8bit, "_torch_path", lambda *a, **k: pytest.fail("torch path used"))
            monkeypatch.setattr(_native.torch, "get_num_threads", lambda: 3)
        for _ in range(3):
            gs = [(torch.randn(s, generator=g) * 0.01 * (torch.rand(s, generator=g) > 0.1)).to(grad_dtype)
                  for s in shapes]
            (lion8bit.lion if c_kernel else torch_path)(ps, gs, ms, **kw)
        monkeypatch.undo()
        runs.append([ps, ms, cs or []])
    for a, b in zip(*runs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.skipif(_native.c_compiler() is None, reason="no C compiler: no C kernel")
@pytest.mark.parametrize("name", C_KERNEL)
def test_fp32_state_tensors_follow_the_groups_compile_option(name, monkeypatch):
    """An 8-bit family's fp32-state tensors (here all: below min_8bit_size) on bf16 weights take the C kernel under
    compile=None only: compile=False means eager, and compile=True inductor's kernel for the 8-bit tensors, torch's
    operations for these."""
    from hf_efficient.optim import _dispatch

    calls = []
    real = _dispatch.Bf16WeightKernel.__call__
    monkeypatch.setattr(_dispatch.Bf16WeightKernel, "__call__", lambda self, *a: (calls.append(1), real(self, *a)))
    for compile, expected in ((None, True), (False, False), (True, False)):
        calls.clear()
        p = _weights(torch.bfloat16)
        opt = hfe.create_optimizer(bare(name, [p]), name, lr=LR, weight_decay=0.0, compensation="stochastic",
                                   min_8bit_size=p.numel() + 1)
        opt.param_groups[0]["compile"] = compile
        _drive(opt, p, 2)
        assert bool(calls) == expected, compile


@pytest.mark.skipif(_native.c_compiler() is None, reason="no C compiler: no C kernel")
@pytest.mark.parametrize("name", C_KERNEL)
def test_c_kernel_same_bits_in_every_build(name, rebuild_native):
    """The C kernel as built here (on an AVX-512 CPU quant8.h encodes and decodes a block with vector instructions,
    its byte-table lookups with VBMI) and in plain C (scalar codec) do the same operations: fp32 and bf16 weights,
    Kahan buffers and 8-bit state equal bit for bit under each compensation, over whole and partial blocks split
    over threads."""
    from hf_efficient.optim import _dispatch

    runs = []
    for flags in ([], ["-mno-avx512f"]):
        rebuild_native(_dispatch, _FLAGS=_native._FLAGS + flags)
        run = []
        for mode in ("kahan", "stochastic", "none"):
            g = torch.Generator().manual_seed(1)
            params = [torch.nn.Parameter((torch.randn(shape, generator=g) * 0.1).to(dtype))
                      for dtype in (torch.float32, torch.bfloat16) for shape in [(64, 80), (300, 23), (70_001,)]]
            opt = hfe.create_optimizer(params, name, lr=1e-2, weight_decay=0.1, compensation=mode, min_8bit_size=1,
                                       nonfinite="ignore")
            for _ in range(3):
                for q in params:
                    q.grad = (torch.randn(q.shape, generator=g) * 0.01).to(q.dtype)
                opt.step()
            if type(opt).native_fn() is None:  # as built here, a C compiler's kernel must pass its probe
                assert flags, "the C kernel was refused by its probe"
                pytest.skip("no plain C build here (not an x86 compiler for -mno-avx512f)")
            assert all(type(opt).choose(q, q.grad, None) is type(opt)._op for q in params)
            run.append([(q.detach().clone(), {k: v.clone() for k, v in opt.state[q].items()}) for q in params])
        runs.append(run)
    for a, b in zip(*runs):
        for (pa, sa), (pb, sb) in zip(a, b):
            assert torch.equal(pa, pb)
            assert sa.keys() == sb.keys() and all(torch.equal(v, sb[k]) for k, v in sa.items())


def test_compiled_kernel_past_dynamos_recompile_limit_falls_back_to_eager():
    """Each weight/gradient dtype pair is a graph of the compiled 8-bit kernel (compensated bf16/fp16 weights are
    stepped as fp32 copies beside their own gradients): past dynamo's recompile_limit, torch raises
    FailOnRecompileLimitHit, which must fall back to the eager kernel with a warning, not end the step. In a
    subprocess: the fallback drops the compiled kernel for the rest of its process."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import logging, torch
        import hf_efficient as hfe
        torch._dynamo.config.recompile_limit = 1
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            p = torch.nn.Parameter(torch.ones(64, 128, dtype=dtype))
            opt = hfe.create_optimizer([p], "adam8bit", lr=1e-3, compensation="kahan")
            opt.param_groups[0]["compile"] = True
            p.grad = torch.ones_like(p)
            opt.step()
            assert (p != 1).any() or "kahan_comp" in opt.state[p], dtype
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
    assert "the compiled kernel failed (FailOnRecompileLimitHit" in proc.stderr


def test_fp16_kahan_takes_foreach_without_compiling_in_vain(monkeypatch):
    """adamw_bf16's compiled kernel fails its probe for fp16 weights under Kahan (every run warned, after seconds of
    compiling): the automatic choice is foreach there; other modes and an explicit compile=True still compile."""
    from hf_efficient.optim import adamw_bf16

    tried = []
    monkeypatch.setattr(adamw_bf16, "_compiled_kernel", lambda *key: tried.append(key))  # None: as if it failed
    cpu = torch.device("cpu")
    assert adamw_bf16._choose("kahan", cpu, torch.float16, None, None)[0] == "foreach" and not tried
    adamw_bf16._choose("stochastic", cpu, torch.float16, None, None)
    adamw_bf16._choose("kahan", cpu, torch.float16, None, True)
    assert tried == [("stochastic", cpu, torch.float16), ("kahan", cpu, torch.float16)]


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_step_in_fp32_bounds_its_fp32_copies(mode, monkeypatch):
    """The torch path's fp32 copies (CUDA without Triton, fp16 weights on CPU) hold at most CHUNK elements (a larger
    tensor alone), so its temporaries do not grow with the model; the weights and Kahan buffers equal those of one
    copy of everything (each tensor's noise is numbered by its own elements)."""
    from hf_efficient.optim import compensation as C

    shapes = [(30,), (50,), (20, 3), (200,), (7,), (40,)]
    runs = []
    for chunk in (1 << 30, 100):
        monkeypatch.setattr(C, "CHUNK", chunk)
        g = torch.Generator().manual_seed(3)
        ps = [(torch.randn(s, generator=g) + 1).to(torch.float16) for s in shapes]
        deltas = [torch.randn(s, generator=g) * 1e-3 for s in shapes]
        comps = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes] if mode == "kahan" else None
        calls = []

        def step(idx, work):
            calls.append([i for i in idx])
            for i, w in zip(idx, work):
                w.add_(deltas[i])

        C.step_in_fp32(ps, step, mode, comps, list(range(len(ps))))
        runs.append((ps, comps or []))
        sizes = [sum(math.prod(shapes[i]) for i in idx) for idx in calls]
        assert sorted(i for idx in calls for i in idx) == list(range(len(shapes)))
        assert len(calls) == 1 if chunk > 1000 else all(n <= chunk or len(idx) == 1 for n, idx in zip(sizes, calls))
    assert len(calls) == 4  # [30, 50], [60], [200], [7, 40]
    for a, b in zip(*runs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
