"""Learning-rate schedules of the Accelerate plugin: transformers' ``get_scheduler`` where installed, else the
same formulas for the schedules that need nothing beyond warm-up and total steps."""

from __future__ import annotations

import importlib.util
import math
from typing import Callable

import torch

__all__ = ["SCHEDULERS", "NEED_TOTAL", "build_scheduler", "lambda_schedule"]

# Schedules that need nothing beyond warm-up and total steps (transformers' names; the fallback has fewer).
_HF_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                  "inverse_sqrt")
_TORCH_SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")


def _have_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


SCHEDULERS = _HF_SCHEDULERS if _have_transformers() else _TORCH_SCHEDULERS
NEED_TOTAL = {"linear", "cosine", "cosine_with_restarts", "polynomial"}


def build_scheduler(optimizer, kind: str, *, num_training_steps: int | None, warmup_steps: int = 0,
                    warmup_ratio: float = 0.0, steps_per_update: int = 1):
    """The ``kind`` schedule over ``num_training_steps`` optimizer steps, and its warm-up in optimizer steps.

    Args:
        kind: one of :data:`SCHEDULERS`; warmup_steps, warmup_ratio: at most one of them non-zero.
        num_training_steps: optimizer steps (a validated integer >= 1), or None where ``kind`` needs no total.
        steps_per_update: how often the scheduler is stepped per optimizer step (Accelerate's prepared scheduler
            steps ``num_processes`` times unless ``split_batches``): lengths are stretched by it, so the learning
            rate after k optimizer steps is the same for any number of processes.

    Returns:
        ``(scheduler, warmup)``, ``warmup`` in optimizer steps (for the log line).
    """
    if num_training_steps is None and (kind in NEED_TOTAL or warmup_ratio):
        raise ValueError(f"lr_scheduler_type={kind!r}{' with warmup_ratio' if warmup_ratio else ''} needs "
                         "num_training_steps (optimizer steps): pass it to plugin.prepare()")
    warmup = warmup_steps or math.ceil(warmup_ratio * (num_training_steps or 0))
    total = None if num_training_steps is None else num_training_steps * steps_per_update
    if _have_transformers():
        from transformers import get_scheduler

        return get_scheduler(kind, optimizer, num_warmup_steps=warmup * steps_per_update,
                             num_training_steps=total), warmup
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda_schedule(kind, warmup * steps_per_update, total)), warmup


def lambda_schedule(kind: str, warmup: int, total: int | None) -> Callable[[int], float]:
    """transformers' schedules that the plugin offers without it (same formulas)."""
    def f(step: int) -> float:
        if step < warmup and kind != "constant":
            return step / max(1, warmup)
        if kind.startswith("constant"):
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))  # cosine, half a cycle
    return f
