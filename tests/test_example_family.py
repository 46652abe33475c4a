"""docs/contributing.md's example family (tests/example_family.py): its own test file, as a new family's would be.

Its math against an fp32 reference (SGD with momentum and decoupled weight decay, in torch ops): the 8-bit momentum
is within the codec's rounding of it, the fp32-state path (small tensors) equal to it. The cross-cutting tests run it
through tests/cases.py (registered by tests/conftest.py's fixture while they do); the last test here checks they did,
and that the guide shows this very code.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import hf_efficient as hfe
from example_family import SGDM8bit
from hf_efficient.optim import quant8
from hf_efficient.optim._blockwise import Blockwise8bit

registered = pytest.mark.example_family  # the family in the registry while the test runs (tests/conftest.py)
ROOT = Path(__file__).resolve().parents[1]


def _reference(params, grads, *, lr, momentum, weight_decay):
    """fp32 SGD with momentum: m = momentum * m + g; p = p * (1 - lr * wd) - lr * m."""
    out, ms = [p.detach().clone() for p in params], [torch.zeros_like(p) for p in params]
    for step in grads:
        for p, m, g in zip(out, ms, step):
            m.mul_(momentum).add_(g)
            p.mul_(1 - lr * weight_decay).sub_(lr * m)
    return out


def _grads(params, steps=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(steps)]


@pytest.mark.parametrize("compile", [None, False], ids=["compiled", "eager"])
def test_sgdm8bit_follows_fp32_sgd_with_momentum(compile):
    """A small fp32-state tensor equals the reference; an 8-bit one follows it within the codec's rounding. Each
    encoding is within half a code step of its value, at most 0.7% of its block's absmax (the top decade's 64 signed
    codes span 0.9 of it); the momentum carries each step's error into the next, so after 5 steps we allow 4% of the
    absmax for the momentum and 2% of the largest distance moved for the weights (measured: 2.3% and 1.0%)."""
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(64, 128, generator=gen)), torch.nn.Parameter(torch.randn(7, generator=gen))]
    start = params[0].detach().clone()
    hyper = dict(lr=1e-2, momentum=0.9, weight_decay=0.1)
    ref = _reference(params, grads := _grads(params), **hyper)
    opt = SGDM8bit(params, compile=compile, **hyper)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    st = opt.state[params[0]]
    assert st["momentum_buffer"].dtype == torch.uint8 and opt.state[params[1]]["momentum_buffer"].dtype == torch.float32
    torch.testing.assert_close(params[1].detach(), ref[1], rtol=1e-6, atol=1e-6)
    m = sum(g[0] * hyper["momentum"] ** (len(grads) - 1 - t) for t, g in enumerate(grads))
    decoded = quant8.dequantize_blockwise(opt.state_dict()["state"][0]["momentum_buffer"], st["momentum_buffer_absmax"],
                                          True)
    assert ((decoded - m).abs().view(-1, 256).amax(1) <= 0.04 * st["momentum_buffer_absmax"]).all()
    err = (params[0].detach() - ref[0]).abs().max()
    assert 0 < err < 0.02 * (ref[0] - start).abs().max()  # 0: it did quantize


def test_sgdm8bit_is_a_family_with_only_its_torch_step():
    """No C or Triton kernel: its CPU tensors take the compiled kernel made from its update()."""
    assert not SGDM8bit.C_KERNEL and not SGDM8bit.TRITON_KERNEL and SGDM8bit._op is None
    p = torch.zeros(4096)
    assert SGDM8bit.choose(p, p, None) is not SGDM8bit._op
    assert SGDM8bit.choose(p, p, False) == SGDM8bit.eager_kernel
    assert SGDM8bit.probe_group()["momentum"] == 0.9  # its probe group is its own, options included
    assert issubclass(SGDM8bit, Blockwise8bit) and SGDM8bit.NAME == "sgdm8bit" and SGDM8bit.FAMILY == "SGDM8bit"


@registered
def test_its_option_comes_from_optim_args_and_is_checked():
    model = torch.nn.Linear(64, 64)
    opt = hfe.create_optimizer(model, "hf_eff_sgdm8bit", lr=1e-2, momentum=0.5)
    assert opt.param_groups[0]["momentum"] == 0.5
    from hf_efficient.options import parse_optim_args

    assert hfe.registry.get_spec("sgdm8bit").accepted["momentum"].coerce(
        parse_optim_args("momentum=0.7")["momentum"], "optim_args") == 0.7
    with pytest.raises(ValueError, match=r"momentum.*must be in \[0, 1\)"):
        hfe.create_optimizer(model, "sgdm8bit", momentum=1.5)
    with pytest.raises(ValueError, match=r"invalid momentum=2\.0"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "momentum": 2.0})


@registered
def test_its_registry_entry_is_derived_from_its_family():
    spec = hfe.registry.get_spec("sgdm8bit")
    assert spec.state_bytes == 1.02 and spec.bytes_label == "~1.02" and not spec.uses_betas
    assert set(spec.options) >= {"momentum", "min_8bit_size", "embedding_state", "compensation"}
    assert list(spec.backends) == ["torch"] and spec.backends["torch"].build.optimizer_cls() is SGDM8bit


@registered
def test_it_is_registered_while_a_test_takes_it():
    assert "hf_eff_sgdm8bit" in hfe.available_optimizers()


def test_and_unregistered_after():
    """(After the marked tests above, in this process: pytest runs a file's tests in order.)"""
    assert "hf_eff_sgdm8bit" not in hfe.available_optimizers() and "sgdm8bit" not in hfe.registry.families()


def test_the_guide_shows_this_family_and_the_cross_cutting_tests_take_it():
    """docs/contributing.md's "Adding a family" code is tests/example_family.py's (past its docstring), and the
    cross-cutting cases (tests/cases.py) include it."""
    from cases import CASES, names

    def code(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.strip()]

    guide = (ROOT / "docs" / "contributing.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", guide.split("## Adding a family", 1)[1].split("\n## ", 1)[0], re.S)
    source = (ROOT / "tests" / "example_family.py").read_text(encoding="utf-8")
    assert code("".join(blocks)) == code(source.split('"""', 2)[2])  # the code past its docstring, line for line
    assert f"It is {len(source.splitlines())} lines ({len(code(source.split(chr(34) * 3, 2)[2]))} of code" in guide
    assert "sgdm8bit" in {c.values[0] for c in CASES} and "sgdm8bit" in {p.values[0] for p in names()}
