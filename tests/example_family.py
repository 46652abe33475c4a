"""SGD with momentum, its momentum in 8-bit blocks: the complete minimal family of docs/contributing.md.

Its module (math, hyperparameters, Family) and its registry entry; tests/test_example_family.py is its test file.
Registered by the tests that run it (tests/conftest.py), unregistered after: it is no name of the package.
"""

from __future__ import annotations

from hf_efficient import registry
from hf_efficient.optim import quant8
from hf_efficient.optim._blockwise import Blockwise8bit
from hf_efficient.optim.facts import KAHAN, STEP, Family, codes
from hf_efficient.options import Option

MOMENTUM = Option("momentum", float, 0.9, "SGD momentum: m = momentum * m + grad", check=lambda m: 0 <= m < 1,
                  check_text="must be in [0, 1)")
SGDM8BIT = Family("sgdm8bit", {"step": STEP, "momentum_buffer": codes(quant8, signed=True), "kahan_comp": KAHAN},
                  "sgdm", options=(MOMENTUM,), uses_eps=False)


class SGDM8bit(Blockwise8bit):
    """SGD with momentum and decoupled weight decay, the momentum in 8-bit blocks (1.02 bytes per parameter)."""

    FACTS = SGDM8BIT

    def __init__(self, params, *, lr: float = 1e-3, momentum: float = MOMENTUM.default, weight_decay: float = 0.0,
                 min_8bit_size: int = 4096, fp32_state_params=None, compile: bool | None = None,
                 compensation: str = SGDM8BIT.compensation):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, min_8bit_size=min_8bit_size,
                        compile=compile, compensation=compensation)
        super().__init__(params, defaults, fp32_state_params)

    @staticmethod
    def coefficients(group: dict, step: int) -> list[float]:
        return [group["momentum"], 1.0 - group["lr"] * group["weight_decay"], group["lr"]]

    @staticmethod
    def update(p, g, moments, coef):
        m = moments[0] * coef[0] + g
        return p * coef[1] - m * coef[2], [m]


SPEC = registry.family_spec(SGDM8bit, "SGD with momentum, blockwise 8-bit momentum (docs/contributing.md's example)")
