"""The only place that touches transformers internals: registers the ``hf_eff_*`` names with Trainer.

Three patches, all idempotent and feature-checked rather than version-pinned (tested on 4.46 and 5.23):

1. ``OptimizerNames`` (an Enum) gets one member per name, so ``TrainingArguments(optim=...)``,
   ``set_optimizer``, ``HfArgumentParser``'s ``--optim`` choices, ``to_dict`` and pickling all accept them;
   an unknown ``hf_eff_*`` name raises our error listing the registered ones.
2. ``Trainer.get_optimizer_cls_and_kwargs`` answers for our names with :class:`TrainerOptimizer` and the
   model, so our weight-decay groups replace the Trainer's and ``optim_args`` goes through our parser.
3. ``Trainer.__init__`` adds :class:`MemoryCallback` for our names (and puts any MemoryCallback first), so
   measured optimizer state and peak memory reach the logs.
"""

from __future__ import annotations

import functools
import logging

import torch
from transformers import TrainerCallback

from ..factory import build_optimizer
from ..memory import MB, peak_memory, state_metrics
from ..options import parse_optim_args
from ..registry import PREFIX, SPECS, get_spec

__all__ = ["register", "TrainerOptimizer", "is_hf_eff_name", "MemoryCallback"]

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
    _add_memory_callback(Trainer)
    _allow_numpy_rng_on_resume(Trainer)


def _allow_numpy_rng_on_resume(trainer_cls) -> None:
    """Let transformers < 4.47 resume under torch >= 2.6.

    Those versions read ``rng_state.pth`` (numpy RNG arrays the Trainer itself wrote) with torch.load's
    default, which torch 2.6 turned into ``weights_only=True``: every resume then fails. Newer versions
    allowlist exactly these numpy types (``trainer_pt_utils.safe_globals``); do the same for older ones.
    """
    import numpy as np
    from transformers import trainer_pt_utils

    if hasattr(trainer_pt_utils, "safe_globals") or not hasattr(torch.serialization, "safe_globals"):
        return
    np_core = getattr(np, "_core", None) or np.core
    allow = [np_core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    original = trainer_cls._load_rng_state

    def _load_rng_state(self, checkpoint):
        with torch.serialization.safe_globals(allow):
            return original(self, checkpoint)

    trainer_cls._load_rng_state = _load_rng_state


class MemoryCallback(TrainerCallback):
    """Puts what the optimizer really costs into the Trainer's logs, so TensorBoard / W&B / log_history get it.

    After the first optimizer step: ``hf_eff/optimizer_state_mb`` (measured by
    :func:`hf_efficient.optimizer_state_bytes`), ``hf_eff/fp32_adamw_state_mb`` and
    ``hf_eff/optimizer_state_saving`` (the fraction saved against fp32 AdamW for the same parameters).
    At every log: ``hf_eff/peak_cuda_allocated_mb`` (``torch.cuda.max_memory_allocated``), or
    ``hf_eff/peak_rss_mb`` (the process' peak resident memory) on CPU. MB = 2**20 bytes.

    Added automatically, first in the list, for ``hf_eff_*`` names; for any other optimizer pass
    ``Trainer(..., callbacks=[MemoryCallback()])`` (it is moved first there too: the reporting callbacks
    only see values added before their turn).
    """

    def __init__(self):
        self._pending: dict[str, float] = {}
        self._measured = False

    def on_train_begin(self, args, state, control, **kwargs):
        self._measured = False

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if self._measured or optimizer is None:
            return
        metrics = state_metrics(optimizer)
        if metrics is None:  # the step was skipped (e.g. fp16 overflow): no state yet
            return
        self._measured = True
        self._pending = {f"hf_eff/{k}": v for k, v in metrics.items()}
        logger.info("hf_efficient: optimizer state %.1f MB measured at step %d; fp32 AdamW: %.1f MB (%.0f%% saved)",
                    metrics["optimizer_state_mb"], state.global_step, metrics["fp32_adamw_state_mb"],
                    100 * metrics["optimizer_state_saving"])
        if getattr(args.logging_strategy, "value", args.logging_strategy) != "no":
            control.should_log = True  # log at this step rather than at the next logging_steps

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if logs is None:
            return
        extra, self._pending = self._pending, {}
        if model is not None:
            param = next(model.parameters(), None)
            what, peak = peak_memory(param.device if param is not None else "cpu")
            extra[f"hf_eff/{what}_mb"] = peak / MB
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)  # Trainer.log appended its copy of logs before calling us


def _add_memory_callback(trainer_cls) -> None:
    """Wrap ``Trainer.__init__``: add a :class:`MemoryCallback` for hf_eff_* names, and put it first."""
    if getattr(trainer_cls.__init__, "_hf_eff_memory", False):
        return
    original = trainer_cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        callbacks = self.callback_handler.callbacks
        mine = [cb for cb in callbacks if isinstance(cb, MemoryCallback)]
        if not mine and is_hf_eff_name(self.args.optim):
            mine = [MemoryCallback()]
        callbacks[:] = mine + [cb for cb in callbacks if not isinstance(cb, MemoryCallback)]

    __init__._hf_eff_memory = True
    trainer_cls.__init__ = __init__
