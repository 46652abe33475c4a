"""AdamW's Triton kernels (optim/adamw_triton.py) run under Triton's interpreter on CPU tensors, against their eager
references, and compile for sm_90.

References and tolerances:
- fp32 moments (hf_eff_adamw on bf16/fp16 weights, 8-bit AdamW's fp32-state tensors): the torch path (torch's AdamW
  on fp32 copies, then compensation.write_all). The kernel does torch's operations in torch's order without
  multiply-add contraction; torch's CPU kernels contract some (lerp, addcmul), so the moments agree within 1e-6 of
  each tensor's largest value (a moment near zero is a difference of larger numbers), weights within one spacing of
  their dtype (fp32: 1e-6 relative), and where a weight and its Kahan buffer differ, their sum agrees to 1e-6.
- bf16 moments (hf_eff_adamw_bf16): its eager kernel. Moments equal bit for bit (the same operations, noise and
  rounding), weights too under stochastic and none. Under kahan the kernel writes through the shared
  ``compensated(old, new)``, whose buffer takes ``(new - old) + comp`` where eager's takes ``update + comp``: they
  differ by the fp32 rounding of ``old + update``, so a buffer may differ in its last bf16 bits (and rarely the weight
  by one spacing): weight + buffer agree to 1e-6, the weights within one spacing.
"""

from __future__ import annotations

import io
import logging

import pytest
import torch

from triton_helpers import compile_for_hopper, needs_interpreter, on_cpu, signature_adamw, triton  # noqa: F401
from hf_efficient.optim import _dispatch, _triton, adamw, adamw_bf16, adamw_triton
from hf_efficient.optim.adamw import AdamW
from hf_efficient.optim.adamw_bf16 import AdamWBF16

# the interpreter computes in numpy, which warns where a gradient's square overflows fp32 (probes and one test)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
SHAPES = [(3000,), (37,), (5, 7), (0,), (2048,)]  # not multiples of the block, empty, exactly one block
# how they are launched: "shared": one launch over a pointer table, 3000 = a program of a whole block and a partial
# one; "alone": programs of one block, and a tensor of more than one program (3000) gets a launch of its own
LAYOUTS = {"shared": {}, "alone": {"BLOCKS": 1, "MAX_PROGRAMS": 1}}


def _layout(monkeypatch, layout):
    for name, value in LAYOUTS[layout].items():
        monkeypatch.setattr(_triton if name == "MAX_PROGRAMS" else adamw_triton, name, value)


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5 + 1).to(dtype)) for s in SHAPES]


def _grads(params, seed, dtype=None):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g).to(dtype or p.dtype) for p in params]


def _train(cls, params, steps, *, triton_on: bool, opt=None, start=0, **kw):
    """``steps`` steps (gradients seeded by the step number), on the Triton path or not; returns the optimizer."""
    _triton.interpret_on_cpu(triton_on)
    try:
        opt = opt or cls([{"params": params[:4]}, {"params": params[4:]}, {"params": []}], lr=1e-2,
                         weight_decay=0.1, **kw)
        for k in range(start, start + steps):
            for p, g in zip(params, _grads(params, k)):
                p.grad = g
            opt.step()
    finally:
        _triton.interpret_on_cpu(True)
    return opt


def _states(opt, params):
    return [{k: v.clone() for k, v in opt.state[p].items()} for p in params if p in opt.state]


def _close_weights(a, b, dtype):
    if dtype == torch.float32:
        return torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    return bool(((a.float() - b.float()).abs() <= torch.finfo(dtype).eps * b.float().abs().clamp_min(1)).all())


def _scale(t):
    return float(t.abs().max()) if t.numel() else 0.0


def _kahan_sums_close(pa, ca, pb, cb, dtype):
    """Weight + Kahan buffer: within 2**-6 of the buffers' and of the weight's spacing (a buffer's last bf16 bit may
    round otherwise, and the difference is carried to later steps); a lost compensation is off by the buffer."""
    err = (pa.float() + ca.float() - pb.float() - cb.float()).abs()
    scale = torch.finfo(dtype).eps * pb.float().abs() + ca.float().abs() + cb.float().abs()
    return bool((err <= 2.0**-6 * scale + 1e-7).all())


def _copy(state_dict):
    """What a checkpoint holds: a copy (torch's load_state_dict keeps the tensors it is given)."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.fixture(autouse=True)
def _fresh_logs():
    """Each test sees its own once-only log lines."""
    logged = set(_dispatch._LOGGED)
    yield
    _dispatch._LOGGED.clear()
    _dispatch._LOGGED.update(logged)


# ----------------------------------------------------------------------------------------------------
# fp32 moments: AdamW (hf_eff_adamw) and adamw_fp32_state
# ----------------------------------------------------------------------------------------------------

@needs_interpreter
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["kahan", "stochastic", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp32_state_kernel_matches_the_torch_path(on_cpu, monkeypatch, mode, dtype, layout):
    _layout(monkeypatch, layout)
    assert adamw._triton_kernel(torch.device("cpu")) is not None  # probed before counting
    launched = []
    monkeypatch.setattr(_triton, "launch", _counting(_triton.launch, launched))
    ref_p, tri_p = _params(dtype), _params(dtype)
    ref = _train(AdamW, ref_p, 3, triton_on=False, compensation=mode)
    tri = _train(AdamW, tri_p, 3, triton_on=True, compensation=mode)
    assert launched == [adamw_triton.fp32_state_kernel] * (3 * 2)  # per step: one call per group with tensors
    for a, b, sa, sb in zip(tri_p, ref_p, _states(tri, tri_p), _states(ref, ref_p)):
        assert torch.equal(sa["step"], sb["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(sa[key], sb[key], rtol=0, atol=1e-6 * _scale(sb[key]))
        assert _close_weights(a, b, dtype)
        if "kahan_comp" in sb:
            assert _kahan_sums_close(a, sa["kahan_comp"], b, sb["kahan_comp"], dtype)
    assert (mode == "kahan" and dtype != torch.float32) == ("kahan_comp" in tri.state[tri_p[0]])


@needs_interpreter
@pytest.mark.parametrize("beta1", [0.5, 0.3])  # lerp weights 0.5 and 0.7: torch's lerp from the gradient's side
def test_fp32_state_kernel_lerps_from_the_gradient_side_too(on_cpu, beta1):
    ref_p, tri_p = _params(torch.float32), _params(torch.float32)
    ref = _train(AdamW, ref_p, 3, triton_on=False, compensation="none", betas=(beta1, 0.999))
    tri = _train(AdamW, tri_p, 3, triton_on=True, compensation="none", betas=(beta1, 0.999))
    for a, b, sa, sb in zip(tri_p, ref_p, _states(tri, tri_p), _states(ref, ref_p)):
        assert torch.allclose(sa["exp_avg"], sb["exp_avg"], rtol=0, atol=1e-6 * _scale(sb["exp_avg"]))
        assert _close_weights(a, b, torch.float32)


def _counting(fn, calls):
    def wrapped(*args, **kwargs):
        calls.append(args[0])  # the kernel
        return fn(*args, **kwargs)
    return wrapped


_FP32_STATE_KERNEL = adamw_triton.fp32_state_kernel


class _Counting:
    """A kernel whose launches are recorded: (grid, ALIGNED)."""

    def __init__(self, kernel, launched):
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launched.append((grid, kwargs["ALIGNED"]))
            return self.kernel[grid](*args, **kwargs)
        return run


def _fp32_state_launches(monkeypatch, params, grads):
    """The launches of one ``adamw_fp32_state`` call on these tensors (fresh state); asserts every element stepped."""
    assert adamw._triton_kernel(torch.device("cpu")) is not None  # probed before counting
    launched = []
    monkeypatch.setattr(adamw_triton, "fp32_state_kernel", _Counting(_FP32_STATE_KERNEL, launched))
    ms, vs = [torch.zeros(p.shape) for p in params], [torch.zeros(p.shape) for p in params]
    adamw.adamw_fp32_state(params, grads, ms, vs, None, [torch.tensor(0.0) for _ in params], lr=1e-3, beta1=0.9,
                           beta2=0.999, eps=1e-8, weight_decay=0.0, compensation="stochastic",
                           positions=list(range(len(params))))
    assert all(bool((m != 0).all()) for m in ms if m.numel())  # every element of every tensor stepped
    return launched


@needs_interpreter
@pytest.mark.parametrize("layout,grids", [
    ("shared", [((3, 1, 1), True), ((1, 1, 1), True)]),  # (tensors, programs, 1): 3000, 35, 2048; 37 (fp32 grad)
    ("alone", [((1, 1, 2), True), ((2, 1, 1), True), ((1, 1, 1), True)]),  # 3000 alone: programs on axes 1 and 2
])
def test_fp32_state_kernel_launches(on_cpu, monkeypatch, layout, grids):
    """One launch per (weight, gradient) dtype pair (tensors on the grid's first dimension, the only one with room for
    more than 65535), except a tensor of more than MAX_PROGRAMS programs: one of its own, its programs on axes 1 and
    2; empty tensors none. Launches of 16-byte aligned tensors say so (ALIGNED)."""
    _layout(monkeypatch, layout)
    params = _params(torch.bfloat16)
    grads = _grads(params, 0)
    grads[1] = grads[1].float()  # another dtype pair: a launch of its own
    assert sorted(_fp32_state_launches(monkeypatch, params, grads)) == sorted(grids)


@needs_interpreter
def test_misaligned_tensors_take_no_alignment_hint(on_cpu, monkeypatch):
    """Weights at an address that is not a multiple of 16 bytes (a view 2 bytes into a buffer): the table launch
    promises no alignment (a misaligned vector load is a CUDA error), and steps them as it steps aligned ones."""
    aligned = _params(torch.bfloat16)
    misaligned = []
    for p in _params(torch.bfloat16):
        buf = torch.empty(p.numel() + 1, dtype=p.dtype)
        buf[1:] = p.reshape(-1)
        misaligned.append(buf[1:].view(p.shape))
    runs = []
    for params in (aligned, misaligned):
        assert [l[1:] for l in _fp32_state_launches(monkeypatch, params, _grads(params, 0))] == [
            (params is aligned,)]
        runs.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_llama_1b_shapes_take_two_launches_per_step():
    """The shapes of Llama-1B (24 layers of 7 matrices and 2 norms; embeddings apart), in two param groups (decay:
    the matrices; none: the norms): each group's bf16 tensors share one launch, none is too large for the table."""
    d, ff = 2048, 5632
    layer = [(d, d)] * 4 + [(ff, d)] * 2 + [(d, ff)]
    groups = [[torch.empty(s, dtype=torch.bfloat16, device="meta") for _ in range(24) for s in layer],
              [torch.empty(d, dtype=torch.bfloat16, device="meta") for _ in range(48)]]
    span = adamw_triton.BLOCK * adamw_triton.BLOCKS  # elements per program
    plans = [_triton.plan(ps, ps, span) for ps in groups]
    assert plans == [([], [list(range(168))]), ([], [list(range(48))])]
    big = [torch.empty((128256, d), dtype=torch.bfloat16, device="meta")]  # the embedding: still shared
    assert _triton.plan(big, big, span) == ([], [[0]])
    huge = [torch.empty(_triton.MAX_PROGRAMS * span + 1, device="meta")]
    assert _triton.plan(huge, huge, span) == ([0], [])


@needs_interpreter
@pytest.mark.parametrize("keyed", [True, False])
def test_fp32_state_noise_keys_as_the_torch_path(on_cpu, keyed):
    """8-bit AdamW passes each tensor's key (``weight_key(position, step)``, computed on the host), AdamW its
    position: either way the kernel rounds with the torch path's noise (weights of stochastic rounding equal)."""
    runs = []
    for triton_on in (True, False):
        _triton.interpret_on_cpu(triton_on)
        params = _params(torch.bfloat16)
        steps = [torch.tensor(4.0) for _ in params]
        kw = dict(keys=[adamw.weight_key(i + 3, 5) for i in range(len(params))]) if keyed else dict(
            positions=[i + 3 for i in range(len(params))])
        adamw.adamw_fp32_state(params, _grads(params, 0), [torch.zeros(p.shape) for p in params],
                               [torch.zeros(p.shape) for p in params], None, steps, lr=1e-3, beta1=0.9, beta2=0.999,
                               eps=1e-8, weight_decay=0.0, compensation="stochastic", **kw)
        runs.append(params)
    _triton.interpret_on_cpu(True)
    assert sum(int((a != b).sum()) for a, b in zip(*runs)) <= 2  # a rounding boundary at most, not another stream


# ----------------------------------------------------------------------------------------------------
# bf16 moments: AdamWBF16 (hf_eff_adamw_bf16) against its eager kernel
# ----------------------------------------------------------------------------------------------------

@needs_interpreter
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["kahan", "stochastic", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bf16_state_kernel_matches_eager(on_cpu, monkeypatch, mode, dtype, layout):
    _layout(monkeypatch, layout)
    ref_p, tri_p = _params(dtype), _params(dtype)
    ref = _train(AdamWBF16, ref_p, 3, triton_on=False, compensation=mode, foreach=False)
    tri = _train(AdamWBF16, tri_p, 3, triton_on=True, compensation=mode)
    assert tri.state[tri_p[0]]["step"].device == tri_p[0].device
    for a, b, sa, sb in zip(tri_p, ref_p, _states(tri, tri_p), _states(ref, ref_p)):
        assert torch.equal(sa["step"], sb["step"])
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        if mode == "kahan":
            assert _close_weights(a, b, dtype) and _kahan_sums_close(a, sa["kahan_comp"], b, sb["kahan_comp"], dtype)
        else:
            assert torch.equal(a, b)


@needs_interpreter
def test_bf16_state_kernel_keeps_overflowing_moments_finite(on_cpu):
    """A finite gradient whose square overflows fp32: exp_avg_sq is clamped to bf16's largest value, as eager."""
    runs = []
    for triton_on in (True, False):
        p = [torch.nn.Parameter(torch.ones(40, dtype=torch.bfloat16))]
        _triton.interpret_on_cpu(triton_on)
        opt = AdamWBF16(p, lr=1e-3, compensation="none", **({} if triton_on else {"foreach": False}))
        p[0].grad = torch.full((40,), 2e19, dtype=torch.bfloat16)
        opt.step()
        runs.append(opt.state[p[0]]["exp_avg_sq"])
    _triton.interpret_on_cpu(True)
    assert torch.equal(runs[0], runs[1]) and bool(runs[0].isfinite().all())


@needs_interpreter
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", ["fp32_state", "bf16_state"])
def test_kernels_write_only_their_elements(on_cpu, monkeypatch, family, layout):
    """Each tensor is a view at the start of a larger buffer whose tail holds a sentinel: launched alone or shared
    (3000 elements, a whole block and a partial one; 37) they leave every tail as it was (masks bound every load and
    store of a partial block, and nothing reads or writes past the tensor's last block)."""
    _layout(monkeypatch, layout)
    sizes, tail = (3000, 37), 2100  # past the last block of either

    def views(dtype):
        bufs = [torch.full((n + tail,), 0.5, dtype=dtype) for n in sizes]
        return bufs, [b[:n] for b, n in zip(bufs, sizes)]

    state = torch.float32 if family == "fp32_state" else torch.bfloat16
    (pb, ps), (gb, gs), (mb, ms), (vb, vs), (cb, cs) = (views(d) for d in (
        torch.bfloat16, torch.bfloat16, state, state, torch.bfloat16))
    steps = [torch.tensor(0.0) for _ in sizes]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, compensation="kahan")
    if family == "fp32_state":
        adamw.adamw_fp32_state(ps, gs, ms, vs, None, steps, comps=cs, positions=[0, 1], **kw)
    else:
        adamw_bf16.adamw_bf16(ps, gs, ms, vs, cs, steps, noise_ids=[0, 1], **kw)
    assert all(float(s) == 1.0 for s in steps) and not torch.equal(ps[0], torch.full_like(ps[0], 0.5))
    for bufs in (pb, gb, mb, vb, cb):
        assert all(bool((b[n:] == 0.5).all()) for b, n in zip(bufs, sizes))


# ----------------------------------------------------------------------------------------------------
# Both: the void flag, no host sync, resume, checkpoints across paths, the fallback
# ----------------------------------------------------------------------------------------------------

FAMILIES = [(AdamW, {}), (AdamWBF16, {})]


@needs_interpreter
@pytest.mark.parametrize("cls,kw", FAMILIES, ids=["adamw", "adamw_bf16"])
@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_flag_set_changes_nothing(on_cpu, cls, kw, mode):
    params = _params(torch.bfloat16)
    opt = _train(cls, params, 1, triton_on=True, compensation=mode)
    weights, states = [p.detach().clone() for p in params], _states(opt, params)
    opt.found_inf = torch.ones(())  # as the guard sets it: the step is void, step counts included
    _train(cls, params, 1, triton_on=True, opt=opt, start=1)
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(_states(opt, params), states) for k in a)
    opt.found_inf = torch.zeros(())
    _train(cls, params, 1, triton_on=True, opt=opt, start=1)
    assert not torch.equal(params[0], weights[0]) and float(opt.state[params[0]]["step"]) == 2.0


@needs_interpreter
@pytest.mark.parametrize("cls,kw", FAMILIES, ids=["adamw", "adamw_bf16"])
def test_each_group_keeps_its_pointer_tables(on_cpu, monkeypatch, cls, kw):
    """More param groups than the process-wide cache of recent tables holds: each group's tables live in the
    optimizer, so a step after the first builds none (a model of many groups would otherwise rebuild, and copy to
    the device, every table every step)."""
    groups = 70  # > _triton._MAX_RECENT (64)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(37).to(torch.bfloat16)) for _ in range(groups)]
    opt = cls([{"params": [p]} for p in params], lr=1e-3, compensation="stochastic")
    built = []
    real = torch.tensor

    def counting(data, *a, **k):  # the tables' host-to-device copies go through torch.tensor
        built.append(1)
        return real(data, *a, **k)

    for p in params:
        p.grad = torch.randn(37).to(torch.bfloat16)
    for step in range(2):  # the same gradient tensors each step (as the caching allocator mostly gives them)
        if step == 1:
            monkeypatch.setattr(torch, "tensor", counting)
        opt.step()
    monkeypatch.undo()
    assert len(opt._tables) == groups and all(opt._tables.values())
    assert built == []


@needs_interpreter
@pytest.mark.parametrize("cls,kw", FAMILIES, ids=["adamw", "adamw_bf16"])
def test_no_host_sync_in_step(on_cpu, monkeypatch, cls, kw):
    """Nothing is read on the host once the kernel is probed: Tensor.item / __bool__ raise during step()."""
    params = _params(torch.bfloat16)
    opt = _train(cls, params, 1, triton_on=True, compensation="stochastic")  # probe and state creation
    opt.found_inf = torch.zeros(())

    def refuse(*a, **k):
        raise AssertionError("host synchronisation in step()")

    for name in ("item", "__bool__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for p, g in zip(params, _grads(params, 5)):
        p.grad = g
    opt.step()
    monkeypatch.undo()
    assert float(opt.state[params[0]]["step"]) == 2.0


@needs_interpreter
@pytest.mark.parametrize("name", ["adamw", "adamw_bf16"])
def test_the_guard_checks_on_the_device_for_bf16_weights(name, on_cpu, monkeypatch):
    """takes_found_inf(): True where every tensor with a gradient goes to the Triton kernel (bf16 weights, state made);
    the guard then leaves its check on the device, and an inf gradient under nonfinite=skip voids the step through
    the flag with nothing read on the host in step() (the guard read its check there before: a sync per step)."""
    import hf_efficient as hfe
    from hf_efficient import guard, nonfinite
    from helpers import no_host_read

    monkeypatch.setattr(nonfinite, "_DEVICE_FLAG_ON_CPU", True)
    # the scan probed here, not first inside no_host_read (its probe reads results: it would fail, and stay off for
    # every later test of this process)
    assert nonfinite._triton_scan([torch.zeros(1)]) is not None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).to(torch.bfloat16)
    opt = hfe.create_optimizer(model, name, lr=0.1, weight_decay=0.01, nonfinite="skip")

    def grads(bad=None):
        for p in model.parameters():
            p.grad = torch.randn(p.shape).to(p.dtype)
        if bad is not None:
            model[1].weight.grad[2, 3] = bad

    grads()
    assert not opt.takes_found_inf()  # no state yet: the first step is checked on the host
    opt.step()
    assert opt.takes_found_inf() and nonfinite.checks_on_device(opt, guard.backend_class(opt), scaled=False)
    before = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in model.parameters()]
    grads(bad=float("inf"))
    with no_host_read(monkeypatch):
        opt.step()
    for p, (w, st) in zip(model.parameters(), before):
        assert torch.equal(w, p) and all(torch.equal(v, opt.state[p][k]) for k, v in st.items())
    grads()
    with no_host_read(monkeypatch):
        opt.step()
    assert not torch.equal(before[0][0], model[0].weight)
    assert hfe.optimizer_info(opt).skipped_steps == 1
    model[0].to(torch.float32)  # an fp32 tensor takes a host path (AdamWBF16: torch's AdamW; AdamW: the same kernel)
    grads()
    assert opt.takes_found_inf() == (name == "adamw")


@needs_interpreter
@pytest.mark.parametrize("cls,kw", FAMILIES, ids=["adamw", "adamw_bf16"])
@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_resume_is_exact_on_the_triton_path(on_cpu, cls, kw, mode):
    whole = _params(torch.bfloat16)
    _train(cls, whole, 4, triton_on=True, compensation=mode)
    first = _params(torch.bfloat16)
    opt = _train(cls, first, 2, triton_on=True, compensation=mode)
    saved = _copy(opt.state_dict())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = cls([{"params": resumed[:4]}, {"params": resumed[4:]}, {"params": []}], lr=1e-2, weight_decay=0.1,
               compensation=mode)
    opt2.load_state_dict(saved)
    _train(cls, resumed, 2, triton_on=True, opt=opt2, start=2)
    assert all(torch.equal(a, b) for a, b in zip(resumed, whole))


@needs_interpreter
@pytest.mark.parametrize("cls,kw", FAMILIES, ids=["adamw", "adamw_bf16"])
@pytest.mark.parametrize("direction", ["triton_to_cpu", "cpu_to_triton"])
def test_checkpoints_move_between_triton_and_cpu(on_cpu, cls, kw, direction):
    """A state_dict made on one path loads into an optimizer on the other and continues as that path continues
    from the same state (within the tolerances above); the saved format is the same (float32 scalar steps)."""
    mode = "kahan"
    saved_on, continued_on = (True, False) if direction == "triton_to_cpu" else (False, True)
    params = _params(torch.bfloat16)
    opt = _train(cls, params, 2, triton_on=saved_on, compensation=mode, **({} if saved_on else _eager(cls)))
    sd = opt.state_dict()
    assert all(s["step"].dtype == torch.float32 and s["step"].dim() == 0 for s in sd["state"].values())
    runs = []
    for on in (continued_on, saved_on):  # the other path from this state, and (reference) the same path
        ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
        o = cls([{"params": ps[:4]}, {"params": ps[4:]}, {"params": []}], lr=1e-2, weight_decay=0.1,
                compensation=mode, **({} if on else _eager(cls)))
        o.load_state_dict(_copy(sd))
        _train(cls, ps, 2, triton_on=on, opt=o, start=2)
        runs.append((ps, _states(o, ps)))
    (pa, sa), (pb, sb) = runs
    for a, b, x, y in zip(pa, pb, sa, sb):
        assert _close_weights(a, b, torch.bfloat16) and _kahan_sums_close(a, x["kahan_comp"], b, y["kahan_comp"],
                                                                               torch.bfloat16)
        assert torch.equal(x["step"], y["step"])


def _eager(cls):
    return {"foreach": False} if cls is AdamWBF16 else {}


@needs_interpreter
@pytest.mark.parametrize("cls,kw", FAMILIES, ids=["adamw", "adamw_bf16"])
def test_probe_failure_falls_back_with_one_warning(on_cpu, monkeypatch, caplog, cls, kw):
    mod = adamw if cls is AdamW else adamw_bf16
    probe = "_triton_probe" if cls is AdamW else "_triton_agrees"
    monkeypatch.setattr(mod, probe, lambda *a: False)
    monkeypatch.setattr(_dispatch, "_COMPILED", {k: v for k, v in _dispatch._COMPILED.items() if k[0] != "triton"})
    monkeypatch.setattr(_triton, "launch", lambda *a, **k: pytest.fail("Triton kernel launched"))
    params = _params(torch.bfloat16)
    with caplog.at_level(logging.WARNING):
        _train(cls, params, 2, triton_on=True, compensation="stochastic")
    assert len([r for r in caplog.records if "disagrees" in r.getMessage()]) == 1
    ref = _params(torch.bfloat16)
    _train(cls, ref, 2, triton_on=False, compensation="stochastic")
    assert all(torch.equal(a, b) for a, b in zip(params, ref))


# ----------------------------------------------------------------------------------------------------
# Compiled for the GPU (the interpreter accepts what the compiler may refuse)
# ----------------------------------------------------------------------------------------------------

def _constexprs(kernel: str, p: str, g: str, mode: int, keyed: bool | None, aligned: bool) -> dict:
    names = {"fp32": "tl.float32", "bf16": "tl.bfloat16", "fp16": "tl.float16"}
    return {"MODE": mode, "OUT": names[p], "GRAD": names[g], "ALIGNED": aligned,
            **({} if keyed is None else {"KEYED": keyed}), "BLOCK": adamw_triton.BLOCK, "BLOCKS": adamw_triton.BLOCKS}


# every constexpr value and weight dtype of each kernel at least once (each compile takes seconds)
VARIANTS = [("fp32_state_kernel", "bf16", "fp32", 0, False, False),
            ("fp32_state_kernel", "fp16", "fp16", 1, True, True),
            ("fp32_state_kernel", "fp32", "bf16", 2, False, False),
            ("bf16_state_kernel", "bf16", "fp32", 0, None, False),
            ("bf16_state_kernel", "fp16", "bf16", 1, None, False),
            ("bf16_state_kernel", "bf16", "bf16", 2, None, True)]


@pytest.mark.parametrize("kernel,p,g,mode,keyed,aligned", VARIANTS)
def test_kernels_compile_for_hopper(kernel, p, g, mode, keyed, aligned):
    assert compile_for_hopper("hf_efficient.optim.adamw_triton", kernel, signature_adamw(kernel),
                              _constexprs(kernel, p, g, mode, keyed, aligned),
                              num_warps=adamw_triton.NUM_WARPS)["cubin"] > 0


def test_missing_triton_on_cuda_warns_once(monkeypatch, caplog):
    """A CUDA tensor and no Triton (both families ask the same function): one warning, naming the package to
    install; the torch paths then run."""
    from types import SimpleNamespace

    monkeypatch.setattr(_triton, "available", lambda: False)
    with caplog.at_level(logging.WARNING):
        for device in ("cuda", "cuda", "cpu"):
            _dispatch.note_missing_triton(SimpleNamespace(device=torch.device(device)))
    assert [r.getMessage().count("pip install triton") for r in caplog.records] == [1]


@needs_interpreter
def test_fp32_state_c_kernel_false_keeps_the_torch_path(on_cpu, monkeypatch):
    """8-bit AdamW's compile=False (``c_kernel=False``) means eager torch operations: no Triton kernel either."""
    monkeypatch.setattr(_triton, "launch", lambda *a, **k: pytest.fail("Triton kernel launched"))
    params = _params(torch.bfloat16)
    steps = [torch.tensor(0.0) for _ in params]
    adamw.adamw_fp32_state(params, _grads(params, 0), [torch.zeros(p.shape) for p in params],
                           [torch.zeros(p.shape) for p in params], None, steps, lr=1e-3, beta1=0.9, beta2=0.999,
                           eps=1e-8, weight_decay=0.0, compensation="none", c_kernel=False)
    assert all(float(s) == 1.0 for s in steps)


# sm_90 instructions of fp32_state_kernel on bf16 weights under Kahan (the most per element: two bf16 roundings and
# the buffer), static count over a thread's elements per block, and its registers (they bound the warps an SM holds):
# issue 24's measure when written (233 and 99), 207 and 99 once the float64 bias corrections moved to
# _triton.adam_scalars (issue 31), plus a margin. A GPU step of these kernels is bound by their instructions, not by
# memory: a regression shows here before anyone runs one.
MAX_PER_ELEMENT, MAX_REGS = 217, 104


def test_instructions_per_element_do_not_regress():
    info = compile_for_hopper("hf_efficient.optim.adamw_triton", "fp32_state_kernel",
                              signature_adamw("fp32_state_kernel"),
                              _constexprs("fp32_state_kernel", "bf16", "bf16", 0, False, True), sass=True,
                              num_warps=adamw_triton.NUM_WARPS)
    per_element = sum(info["sass"].values()) / (adamw_triton.BLOCK / (32 * adamw_triton.NUM_WARPS))
    assert per_element <= MAX_PER_ELEMENT, info["sass"]
    assert info["regs"] <= MAX_REGS
    # no float64 in a program: the bias corrections come from _triton.adam_scalars, once per tensor
    assert not {"DFMA", "DMUL", "DADD"} & set(info["sass"]), info["sass"]
