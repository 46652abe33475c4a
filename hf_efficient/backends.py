"""Builders: turn param groups + validated hyperparameters and options into an optimizer of one backend.

Each builder has the same keyword signature so the registry can call any of them, and an
``optimizer_cls()`` attribute that imports (lazily) and returns the class it builds.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Iterable

import torch

from .optional import require

__all__ = ["build_torch_adamw", "build_torch_adamw8bit", "build_bnb_adamw8bit", "build_bnb_paged_adamw8bit", "build_torchao_adamw8bit",
           "build_adafactor", "build_adamw_bf16"]


def _with_cls(load: Callable[[], type]):
    def deco(fn):
        fn.optimizer_cls = load
        return fn
    return deco


def fused_adamw_supported(device: torch.device, params: Iterable[torch.Tensor]) -> bool:
    """torch ships a fused AdamW kernel for this device type and these dtypes."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return device.type in _get_fused_kernels_supported_devices() and all(
        p.dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16) for p in params)


@_with_cls(lambda: torch.optim.AdamW)
def build_torch_adamw(groups, *, lr, betas, eps, weight_decay, options, fp32_state_params, device):
    fused = fused_adamw_supported(device, (p for g in groups for p in g["params"]))
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             fused=True if fused else None, foreach=None if fused else True)


@lru_cache(maxsize=None)
def _bnb_class(paged: bool) -> type:
    bnb = require("bitsandbytes", "hf_eff_adam8bit with backend=bnb")
    base = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit

    class AdamW8bit(base):
        """bitsandbytes' 8-bit AdamW keeping 32-bit state for the parameters in ``fp32_state_params``.

        Per-optimizer, unlike bnb's process-wide GlobalOptimManager, so two optimizers over the same
        model cannot leak each other's overrides.
        """

        def __init__(self, params, *, fp32_state_params=(), **kwargs):
            self._fp32_ids = {id(p) for p in fp32_state_params}
            super().__init__(params, **kwargs)

        def get_config(self, gindex, pindex, group):
            config = super().get_config(gindex, pindex, group)
            if id(self.param_groups[gindex]["params"][pindex]) in self._fp32_ids:
                config["optim_bits"] = 32
            return config

    AdamW8bit.__name__ = "PagedAdamW8bit" if paged else "AdamW8bit"
    AdamW8bit.__qualname__ = "BnbPagedAdamW8bit" if paged else "BnbAdamW8bit"  # found by pickle: __getattr__ below
    return AdamW8bit


def _build_bnb(groups, *, lr, betas, eps, weight_decay, options, fp32_state_params, paged):
    cls = _bnb_class(paged)
    return cls(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
               min_8bit_size=options["min_8bit_size"], fp32_state_params=fp32_state_params)


@_with_cls(lambda: _bnb_class(False))
def build_bnb_adamw8bit(groups, *, lr, betas, eps, weight_decay, options, fp32_state_params, device):
    return _build_bnb(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, options=options,
                      fp32_state_params=fp32_state_params, paged=False)


@_with_cls(lambda: _bnb_class(True))
def build_bnb_paged_adamw8bit(groups, *, lr, betas, eps, weight_decay, options, fp32_state_params, device):
    return _build_bnb(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, options=options,
                      fp32_state_params=fp32_state_params, paged=True)


TORCHAO_MIN_SIZE = 4096  # torchao quantizes only tensors of at least this many elements


@lru_cache(maxsize=None)
def _torchao_class() -> type:
    optim = require("torchao", "hf_eff_adam8bit with backend=torchao").optim

    class AdamW8bit(optim.AdamW8bit):
        """torchao's 8-bit AdamW keeping full-precision state for ``fp32_state_params`` and small tensors."""

        def __init__(self, params, *, fp32_state_params=(), min_8bit_size=TORCHAO_MIN_SIZE, **kwargs):
            self._fp32_ids = {id(p) for p in fp32_state_params}
            self._min_8bit_size = min_8bit_size
            super().__init__(params, **kwargs)

        def _new_buffer(self, p, signed):
            if id(p) in self._fp32_ids or p.numel() < self._min_8bit_size:
                return torch.zeros_like(p)
            return super()._new_buffer(p, signed)

    AdamW8bit.__qualname__ = "TorchaoAdamW8bit"
    return AdamW8bit


_LAZY_CLASSES = {"BnbAdamW8bit": lambda: _bnb_class(False), "BnbPagedAdamW8bit": lambda: _bnb_class(True),
                 "TorchaoAdamW8bit": _torchao_class}


def __getattr__(name: str):
    """The wrapper classes of optional backends, built on first use, by name: so that pickle (a saved optimizer
    object, ``copy.deepcopy``) finds them as ``hf_efficient.backends.<name>``."""
    if name in _LAZY_CLASSES:
        return _LAZY_CLASSES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@_with_cls(_torchao_class)
def build_torchao_adamw8bit(groups, *, lr, betas, eps, weight_decay, options, fp32_state_params, device):
    if options["min_8bit_size"] < TORCHAO_MIN_SIZE:
        raise ValueError(f"min_8bit_size={options['min_8bit_size']} is below torchao's fixed threshold of "
                         f"{TORCHAO_MIN_SIZE} elements: use backend=bnb for a lower threshold")
    return _torchao_class()(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                            fp32_state_params=fp32_state_params, min_8bit_size=options["min_8bit_size"])


def compiler_missing(device_type: str) -> str | None:
    """Why our 8-bit kernel cannot be built for ``device_type`` here (on CPU: no C compiler for its C kernel and no
    C++ compiler for torch.compile; on CUDA: no Triton), or None. Without it the kernel runs eagerly, slower
    than bitsandbytes: prefer that then."""
    import importlib.util
    import shutil

    from .optim._native import c_compiler

    if device_type == "cpu":
        found = c_compiler() or any(shutil.which(c) for c in ("g++", "c++", "clang++"))
        return None if found else "needs a C or C++ compiler to build its kernel (none found)"
    if device_type == "cuda":
        return None if importlib.util.find_spec("triton") else "needs Triton to compile its CUDA kernel (not installed)"
    return None


def _adamw8bit_cls():
    from .optim.adamw8bit import AdamW8bit
    return AdamW8bit


@_with_cls(_adamw8bit_cls)
def build_torch_adamw8bit(groups, *, lr, betas, eps, weight_decay, options, fp32_state_params, device):
    return _adamw8bit_cls()(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                            min_8bit_size=options["min_8bit_size"], fp32_state_params=fp32_state_params)


def _adafactor_cls():
    from .optim.adafactor import Adafactor
    return Adafactor


@_with_cls(_adafactor_cls)
def build_adafactor(groups, *, lr, betas, eps, weight_decay, options, fp32_state_params, device):
    return _adafactor_cls()(groups, lr=lr, weight_decay=weight_decay, beta1=options["beta1"],
                            decay_rate=options["decay_rate"], clip_threshold=options["clip_threshold"])


def _adamw_bf16_cls():
    from .optim.adamw_bf16 import AdamWBF16
    return AdamWBF16


@_with_cls(_adamw_bf16_cls)
def build_adamw_bf16(groups, *, lr, betas, eps, weight_decay, options, fp32_state_params, device):
    return _adamw_bf16_cls()(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             compensation=options["compensation"])
