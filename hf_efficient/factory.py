"""``create_optimizer``: name + model -> a ready optimizer, with decay groups, options and backend decided here.

Everything is validated before anything is built, so a mistake leaves no half-made optimizer behind.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from .auto import choose_auto
from .guard import check_params, protect
# re-exported: the package and its integrations read them from here, and optimizers pickled by earlier versions name
# hf_efficient.factory.OptimizerInfo
from .info import OptimizerInfo, optimizer_info
from .optim import _native
from .options import check_flags, check_hyperparams, check_unique, parse_options
from .param_groups import build_param_groups, named_params, param_device, split_parameters
from .optim.compensation import LOW_PRECISION
from .registry import compensation_of, get_spec, resolve
from .release import attach

__all__ = ["create_optimizer", "OptimizerInfo", "optimizer_info"]

logger = logging.getLogger(__name__)


def create_optimizer(model: nn.Module | Iterable, name: str, *, lr: float = 1e-3, weight_decay: float = 0.0,
                     betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, backend: str | None = None,
                     **options) -> torch.optim.Optimizer:
    """Build the optimizer ``name`` for ``model``, in plain PyTorch (no transformers needed).

    Args:
        model: a module (decay groups and the embedding policy come from its structure), or parameters /
            param groups (used as given).
        name: short (``"adam8bit"``) or Trainer (``"hf_eff_adam8bit"``) name.
        lr: the learning rate (Adafactor's step size).
        weight_decay: decoupled weight decay of the decay group (norm layers and biases get none).
        betas: the moments' decay rates, AdamW's (Lion's interpolation and momentum; Adafactor ignores them).
        eps: AdamW's denominator term (Lion and Adafactor ignore it).
        backend: force ``"bnb"``, ``"torchao"`` or ``"torch"`` instead of the registry's choice (``"auto"`` or
            None: the registry's choice).
        **options: the same keys ``optim_args`` accepts (``decay_embeddings``, ``embedding_state``, ...).

    Example:
        >>> opt = create_optimizer(model, "adam8bit", lr=2e-5, weight_decay=0.01)
    """
    if backend is not None:
        options["backend"] = backend
    return build_optimizer(model, name, options, source="create_optimizer", lr=lr, weight_decay=weight_decay,
                           betas=betas, eps=eps)


def build_optimizer(model, name: str, raw_options: Mapping[str, Any], *, source: str, lr: float,
                    weight_decay: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    """:func:`create_optimizer` with options as given by ``source`` (text or values), named in errors."""
    spec = get_spec(name)
    if spec.name == "auto":  # the name comes from the model's predicted footprint; see auto.choose_auto
        model = model if isinstance(model, nn.Module) else list(model)
        choice = choose_auto(model, raw_options, source=source)
        spec, raw_options = get_spec(choice.name), choice.options
    check_hyperparams(lr=lr, betas=betas if spec.uses_betas else None,
                      eps=eps if spec.uses_betas and spec.facts.uses_eps else None, weight_decay=weight_decay)
    options = parse_options(spec.name, spec.accepted, raw_options, source=source)
    if isinstance(model, nn.Module):
        split = split_parameters(model, decay_embeddings=options["decay_embeddings"])
        grouping = spec.facts.param_groups  # the family's own grouping (Muon's split), else the decay groups
        groups = (grouping(model, weight_decay, split, options) if grouping
                  else build_param_groups(model, weight_decay, split=split))
        keep_fp32 = [split.params[n] for n in split.embeddings] if options.get("embedding_state") == "32bit" else []
    else:
        split, groups, keep_fp32 = None, _as_groups(model), []
    named = named_params(groups)
    check_params(named, spec)
    check_unique(((f"parameter {n!r}", p) for n, p in named), owner=spec.trainer_name)
    for g in groups:
        check_flags(g, spec.facts.flags, spec.trainer_name)
    device = param_device(p for _, p in named)
    if device.type == "cpu":
        _native.check_thread_limit()
    low = any(p.dtype in LOW_PRECISION for _, p in named)
    options["compensation"] = _compensation(spec, options["compensation"], low)
    res = resolve(spec.name, device, options["backend"], compensated=low and options["compensation"] != "none")
    optimizer = res.spec.backends[res.backend].build(
        groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, options=options,
        fp32_state_params=keep_fp32, device=device)
    optimizer.hf_efficient = OptimizerInfo(res, options, split)
    protect(optimizer, optimizer.hf_efficient)
    if options.get("gradient_release"):  # before any LR scheduler wraps step(): the Trainer and the plugin agree
        attach(optimizer)
    return optimizer


_SAID: set = set()


def _compensation(spec, asked: str, low: bool) -> str:
    """The compensation the optimizer runs with (``auto``: the family's); says once that an explicit one does
    nothing where every weight is fp32 (it compensates rounding to bf16/fp16 only)."""
    if not low and asked in ("kahan", "stochastic") and (spec.name, asked) not in _SAID:
        _SAID.add((spec.name, asked))
        logger.warning("%s: compensation=%s has no effect here: every parameter is fp32 or wider, and compensation "
                       "only concerns updates rounded to bf16/fp16 weights", spec.trainer_name, asked)
    return compensation_of(spec, asked)


def _as_groups(params) -> list[dict]:
    if isinstance(params, torch.Tensor):
        params = [params]
    items = list(params)
    if not items:
        raise ValueError("create_optimizer got an empty parameter list: pass a module, model.parameters() or "
                         "param groups")
    if isinstance(items[0], dict):
        groups = []
        for gi, g in enumerate(items):
            if not isinstance(g, dict) or "params" not in g:
                raise TypeError(f"create_optimizer: param group {gi} is {g!r}; every group must be a dict with a "
                                "'params' list")
            ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            if not ps:
                raise ValueError(f"create_optimizer: param group {gi} has no parameters (its 'params' is empty)")
            groups.append(dict(g, params=ps))
        return groups
    if isinstance(items[0], tuple):  # named_parameters()
        return [{"params": [p for _, p in items], "param_names": [n for n, _ in items]}]
    return [{"params": items}]
