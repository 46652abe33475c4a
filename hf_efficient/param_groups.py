"""Weight-decay groups decided per parameter, by the module that owns it.

Decay shrinks weights toward zero; that regularises matrices but only harms normalisation gains and
biases, which set a scale or an offset. So: no decay for every parameter of a normalisation layer
(torch's, transformers' ``LlamaRMSNorm`` / ``T5LayerNorm`` / ..., a user's ``MyNorm``) and for biases;
embeddings are decayed unless ``decay_embeddings=False``. Frozen parameters are left out, and a tied
weight appears once.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["DecaySplit", "split_parameters", "build_param_groups", "is_norm_module", "group_names", "named_params"]

logger = logging.getLogger(__name__)

_TORCH_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase, nn.RMSNorm)
# Class names of norm layers: "LayerNorm", "RMSNorm", "T5LayerNorm", "LlamaRMSNorm", "ScaleNorm", "BatchNorm1d".
_NORM_NAME = re.compile(r"norm(\d+d)?$", re.IGNORECASE)
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def is_norm_module(module: nn.Module) -> bool:
    """True for torch's norm layers and any class whose name ends in "Norm" (transformers', a user's)."""
    return isinstance(module, _TORCH_NORMS) or any(_NORM_NAME.search(c.__name__) for c in type(module).__mro__[:-2])


@dataclass
class DecaySplit:
    """Which trainable parameters get weight decay, by name, with the reason for each exclusion."""

    decay: list[str] = field(default_factory=list)
    no_decay: list[str] = field(default_factory=list)
    embeddings: list[str] = field(default_factory=list)  # embedding matrices, decayed or not
    reasons: dict[str, str] = field(default_factory=dict)  # no-decay name -> "norm" | "bias" | "embedding"
    params: dict[str, nn.Parameter] = field(default_factory=dict, repr=False)

    def numel(self, names: list[str]) -> int:
        return sum(self.params[n].numel() for n in names)

    def summary(self) -> str:
        return (f"decay: {len(self.decay)} tensors / {self.numel(self.decay):,} params; "
                f"no decay: {len(self.no_decay)} tensors / {self.numel(self.no_decay):,} params")


def split_parameters(model: nn.Module, decay_embeddings: bool = True) -> DecaySplit:
    """Classify every trainable parameter of ``model`` once (tied weights by their first name)."""
    owners: dict[int, list[tuple[str, str, nn.Module]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod_name, attr, module))
    split = DecaySplit()
    for name, p in model.named_parameters():  # remove_duplicate=True: a tied weight once
        if not p.requires_grad:
            continue
        split.params[name] = p
        uses = owners.get(id(p), [])
        if any(isinstance(m, _EMBEDDINGS) for _, _, m in uses):
            split.embeddings.append(name)
            reason = None if decay_embeddings else "embedding"
        elif any(is_norm_module(m) for _, _, m in uses):
            reason = "norm"
        elif any(attr == "bias" or attr.endswith("_bias") for _, attr, _ in uses) or name.endswith("bias"):
            reason = "bias"
        else:
            reason = None
        if reason is None:
            split.decay.append(name)
        else:
            split.no_decay.append(name)
            split.reasons[name] = reason
    return split


def build_param_groups(model: nn.Module, weight_decay: float = 0.0, decay_embeddings: bool = True,
                       split: DecaySplit | None = None) -> list[dict]:
    """Two param groups, decay and no-decay, for any torch optimizer.

    Args:
        model: the model whose trainable parameters are grouped.
        weight_decay: decay of the first group (the second has 0.0).
        decay_embeddings: whether embedding matrices are decayed (transformers: yes).
        split: a precomputed :func:`split_parameters` result, to avoid walking the model twice.

    Returns:
        ``[{"params", "param_names", "weight_decay"}, ...]``, empty groups dropped. ``param_names`` lets
        torch (>= 2.6) and our error messages name parameters.
    """
    split = split or split_parameters(model, decay_embeddings)
    logger.info("hf_efficient weight decay %s: %s", weight_decay, split.summary())
    groups = []
    for names, wd in ((split.decay, weight_decay), (split.no_decay, 0.0)):
        if names:
            groups.append({"params": [split.params[n] for n in names], "param_names": list(names), "weight_decay": wd})
    if not groups:
        raise ValueError(f"{type(model).__name__} has no trainable parameters (all are frozen or it has none)")
    return groups


def param_device(params) -> torch.device:
    """The one device of ``params``; parameters on several devices are refused (one step cannot span them)."""
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"parameters are on several devices {sorted(map(str, devices))}: move the model to one "
                         "device before creating the optimizer (or create one optimizer per device)")
    return devices.pop()


def group_names(group: dict, gi: int, count: int | None = None) -> list[str]:
    """The names of param group ``gi``'s parameters, for messages and matching: its ``param_names`` (torch >= 2.6
    records them; ours always set them), else ``group{gi}.param{i}`` (``count`` of them: default, its params)."""
    return list(group.get("param_names") or
                [f"group{gi}.param{i}" for i in range(len(group["params"]) if count is None else count)])


def named_params(groups) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of every parameter of ``groups`` (an optimizer's ``param_groups``), in order."""
    return [pair for gi, g in enumerate(groups) for pair in zip(group_names(g, gi), g["params"])]
