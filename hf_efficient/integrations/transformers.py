"""The only place that touches transformers internals: registers the ``hf_eff_*`` names with Trainer.

Two patches, both idempotent and feature-checked rather than version-pinned (tested on 4.46 and 5.23):

1. ``OptimizerNames`` (an Enum) gets one member per name, so ``TrainingArguments(optim=...)``,
   ``set_optimizer``, ``HfArgumentParser``'s ``--optim`` choices, ``to_dict`` and pickling all accept them;
   an unknown ``hf_eff_*`` name raises our error listing the registered ones.
2. ``Trainer.get_optimizer_cls_and_kwargs`` answers for our names with :class:`TrainerOptimizer` and the
   model, so our weight-decay groups replace the Trainer's and ``optim_args`` goes through our parser.
"""

from __future__ import annotations

import logging

import torch

from ..factory import build_optimizer
from ..options import parse_optim_args
from ..registry import PREFIX, SPECS, get_spec

__all__ = ["register", "TrainerOptimizer", "is_hf_eff_name"]

logger = logging.getLogger(__name__)


def is_hf_eff_name(optim) -> bool:
    value = getattr(optim, "value", optim)
    return isinstance(value, str) and value.startswith(PREFIX)


class TrainerOptimizer(torch.optim.Optimizer):
    """What Trainer instantiates for an ``hf_eff_*`` name; constructing it returns the real optimizer.

    Trainer calls ``optimizer_cls(model, **kwargs)`` when the kwargs carry ``"model"`` (in 4.46 and 5.x
    alike) and treats anything but an Optimizer subclass differently across versions; a subclass whose
    ``__new__`` hands back the built optimizer is the one shape both accept.
    """

    def __new__(cls, model, *, hf_eff_name, optim_args, lr, betas, eps, weight_decay):
        return build_optimizer(model, hf_eff_name, parse_optim_args(optim_args), source="optim_args", lr=lr,
                               betas=betas, eps=eps, weight_decay=weight_decay)


def _get_optimizer_cls_and_kwargs(args, model=None):
    if model is None:
        raise ValueError(f"{args.optim.value} needs the model to build weight-decay groups")
    return TrainerOptimizer, {
        "model": model, "hf_eff_name": args.optim.value, "optim_args": args.optim_args, "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon, "weight_decay": args.weight_decay,
    }


def _add_enum_member(enum_cls, value: str) -> None:
    if value in enum_cls._value2member_map_:
        return
    member = str.__new__(enum_cls, value)
    member._name_, member._value_, member.__objclass__ = value.upper(), value, enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    if hasattr(enum_cls, "_add_member_"):  # Python >= 3.13
        enum_cls._add_member_(member._name_, member)
    else:
        enum_cls._member_map_[member._name_] = member
        enum_cls._member_names_.append(member._name_)
        type.__setattr__(enum_cls, member._name_, member)
    enum_cls._value2member_map_[value] = member


def register() -> None:
    """Make every ``hf_eff_*`` name a transformers optimizer name (safe to call twice)."""
    from transformers import Trainer
    from transformers.training_args import OptimizerNames

    for spec in SPECS.values():
        _add_enum_member(OptimizerNames, spec.trainer_name)
    if getattr(OptimizerNames, "_hf_eff_patched", False):
        return
    original_missing = OptimizerNames._missing_

    def _missing_(cls, value):
        if is_hf_eff_name(value):
            get_spec(value)  # raises the ValueError that lists our names
        return original_missing(value)

    OptimizerNames._missing_ = classmethod(_missing_)
    OptimizerNames._hf_eff_patched = True
    original = Trainer.get_optimizer_cls_and_kwargs

    def get_optimizer_cls_and_kwargs(args, model=None):
        if is_hf_eff_name(args.optim):
            return _get_optimizer_cls_and_kwargs(args, model)
        return original(args, model)

    Trainer.get_optimizer_cls_and_kwargs = staticmethod(get_optimizer_cls_and_kwargs)
