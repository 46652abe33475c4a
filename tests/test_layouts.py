"""Weights that are not row-major step as row-major ones do (issue 30, item 9): every name and backend (tests/cases.py,
from the registry) on bf16, fp16 and fp32 weights under every compensation; a transposed view, a channels_last conv
weight and a slice of a larger tensor, each gradient in the layout autograd gives it (the weight's where the weight
is dense, row-major for a slice), beside a row-major bias in the same step; on the CPU paths and on the Triton paths
(under the interpreter: a tensor their kernels cannot take goes to a path that can).

Reference: the family's math (``Family.math``) on float64 copies of the same weights and gradients, rounded to the
tested dtype after every step where ours rounds to nearest (fp32 weights, compensation none). The tensors are small,
so the 8-bit names keep fp32 state for them (their blockwise state has no float64 counterpart).

Tolerances, per element, in spacings of the dtype at the largest value the reference took (``finfo.eps * |ref|``: a
rounding's error stays when the weight then shrinks): one where both round to nearest (either may take the other
neighbour) and under kahan (the weight is the value nearest what weight + buffer stand for); one per step under
stochastic rounding (each write lands on either neighbour). Plus what the moments' precision costs: 1e-3 of a step
for fp32 moments, 2 * eps per step for AdamWBF16's bf16 moments (each rounded within eps / 2 at every step). A weight
stepped with another element's gradient or moments is off by up to two steps per step: on weights of 0.5, ~1 to 4
bf16 spacings a step, ~10 to 40 fp16 ones (issue 30 found most elements beyond one spacing).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from torch import nn

import hf_efficient as hfe
from hf_efficient.optim import _triton
from hf_efficient.optim.compensation import COMPENSATIONS
from hf_efficient.registry import SPECS

from cases import cases
from helpers import muon_f64

# the interpreter computes in numpy, which warns where a probe's gradient squared overflows fp32
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
LR, STEPS = 1e-2, 3
LAYOUT_CASES = cases(dtypes=(torch.bfloat16, torch.float16, torch.float32), compensations=COMPENSATIONS)


def _transposed(t):
    return t.t().contiguous().t()


def _channels_last(t):
    return t.contiguous(memory_format=torch.channels_last)


def _sliced(t):
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]  # every other column: gaps in memory


LAYOUTS = {"transposed": ((40, 37), _transposed), "channels_last": ((8, 4, 6, 6), _channels_last),
           "sliced": ((40, 37), _sliced)}


def _lion(params, grads, states, group):
    """Lion (Chen et al. 2023, decoupled weight decay), as lion8bit's fp32-state step."""
    beta1, beta2 = group["betas"]
    for p, g in zip(params, grads):
        m = states.setdefault(p, torch.zeros_like(p))
        update = torch.sign(beta1 * m + (1 - beta1) * g)
        p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update, alpha=-group["lr"])
        m.mul_(beta2).add_(g, alpha=1 - beta2)


def _sgdm(params, grads, states, group):
    """SGD with momentum and decoupled weight decay (docs/contributing.md's example family, tests/example_family.py)."""
    for p, g in zip(params, grads):
        m = states.setdefault(p, torch.zeros_like(p))
        m.mul_(group["momentum"]).add_(g)
        p.mul_(1 - group["lr"] * group["weight_decay"]).add_(m, alpha=-group["lr"])


def _reference(math: str, params, group):
    """A float64 optimizer of ``math`` over ``params`` with ``group``'s hyperparameters; its ``step(grads)``."""
    if math == "adamw":
        opt = torch.optim.AdamW(params, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                weight_decay=group["weight_decay"], foreach=False)
    elif math == "adafactor":
        from transformers.optimization import Adafactor

        opt = Adafactor(params, lr=group["lr"], eps=(group["eps"], 1e-3), clip_threshold=group["clip_threshold"],
                        decay_rate=group["decay_rate"], beta1=group["beta1"], weight_decay=group["weight_decay"],
                        scale_parameter=False, relative_step=False, warmup_init=False)
    elif math in ("lion", "sgdm"):
        states, step = {}, {"lion": _lion, "sgdm": _sgdm}[math]
        return lambda grads: step(params, grads, states, group)
    elif math == "muon":  # a Muon name's groups: Muon's matrices, AdamW the rest
        if not group["muon"]:
            return _reference("adamw", params, group)
        bufs = [torch.zeros_like(p) for p in params]
        return lambda grads: muon_f64(params, grads, bufs, lr=group["lr"], weight_decay=group["weight_decay"],
                                      momentum=group["momentum"], nesterov=group["nesterov"],
                                      ns_steps=group["ns_steps"], adjust_lr=group["adjust_lr"])
    else:
        raise AssertionError(f"no float64 reference for the math {math!r}: add one to this test")

    def step(grads):
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()

    return step


@pytest.fixture(params=["cpu", "triton"])
def path(request):
    """The paths a step takes: the CPU ones (C kernels, torch), or the Triton kernels on CPU tensors (interpreter)."""
    if request.param == "triton":
        if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton paths run on CPU under TRITON_INTERPRET=1, with triton installed")
        _triton.interpret_on_cpu(True)
        yield request.param
        _triton.interpret_on_cpu(False)
    else:
        yield request.param


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name, backend, dtype, compensation", LAYOUT_CASES)
def test_a_weight_that_is_not_row_major_steps_as_the_math_says(name, backend, dtype, compensation, layout, path):
    shape, lay = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(0)
    values = [(torch.randn(shape, generator=gen) * 0.5).to(dtype), (torch.randn(37, generator=gen) * 0.5).to(dtype)]
    model = nn.Module()
    model.weight, model.bias = nn.Parameter(lay(values[0])), nn.Parameter(values[1])
    assert not model.weight.is_contiguous()
    # a Muon name: Muon takes the 2-D weight, with Newton-Schulz in fp32 (bf16's error is no layout's)
    muon = {"muon_include": "weight", "ns_dtype": "fp32"} if "muon_include" in SPECS[name].accepted and len(
        shape) == 2 else {}
    opt = hfe.create_optimizer(model, name, lr=LR, weight_decay=0.1, backend=backend, compensation=compensation,
                               **muon)
    facts = SPECS[name].facts
    ref_params = {p: v.double() for p, v in zip((model.weight, model.bias), values)}
    groups = [(g["params"], _reference(facts.math, [ref_params[p] for p in g["params"]], g))
              for g in opt.param_groups if g["params"]]  # the decay groups create_optimizer made
    rounds = dtype == torch.float32 or compensation == "none"
    peaks = {p: r.abs() for p, r in ref_params.items()}  # a rounding's error is a spacing where the weight then was
    for _ in range(STEPS):
        grads = {p: torch.randn(p.shape, generator=gen).to(dtype) for p in ref_params}
        for p, g in grads.items():
            p.grad = torch.empty_like(p).copy_(g)  # the layout autograd gives: the weight's where it is dense
        opt.step()
        with torch.no_grad():
            for ps, step in groups:
                step([grads[p].double() for p in ps])
            for p, r in ref_params.items():
                if rounds:
                    r.copy_(r.to(dtype).double())
                peaks[p] = torch.maximum(peaks[p], r.abs())
    spacings = 1 if rounds or compensation == "kahan" else STEPS
    for p, r in ref_params.items():
        moments = facts.moment_dtype(p) if facts.moment_dtype else torch.float32
        slack = 1e-3 if moments == torch.float32 else 2 * STEPS * torch.finfo(moments).eps  # of a step
        tol = spacings * torch.finfo(dtype).eps * peaks[p] + slack * LR
        off = (p.detach().double() - r).abs() > tol
        assert not off.any(), (f"{int(off.sum())} of {off.numel()} elements of the {tuple(p.shape)} weight beyond "
                               f"{spacings} spacing(s) of the float64 reference; worst "
                               f"{float((p.detach().double() - r).abs().max()):.3g}")
