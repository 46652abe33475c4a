"""What :func:`~hf_efficient.create_optimizer` decided for an optimizer, and how to find that optimizer inside wrappers.

A module of its own, importing no other part of the package that builds or steps optimizers: the factory, the guard,
gradient release, memory and the integrations all read it, so none of them needs another for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from .param_groups import DecaySplit
from .registry import Resolution

__all__ = ["OptimizerInfo", "optimizer_info", "unwrap"]

logger = logging.getLogger(__name__)


@dataclass
class OptimizerInfo:
    """What was decided for an optimizer made here; attached to it as ``optimizer.hf_efficient``.

    ``steps`` and ``skipped_steps`` are exact whenever read: where the guard checks gradients on the device (CUDA,
    see :mod:`hf_efficient.guard`), whether a step was voided is known there only, and reading either of them reads
    it (one device read), never the step itself.
    """

    resolution: Resolution
    options: dict[str, Any]
    split: DecaySplit | None  # None when plain parameters (not a model) were given
    counted_steps: int = 0  # step() calls applied, or voided on the device and not read yet (see steps)
    counted_skips: int = 0  # steps skipped, as read so far (see skipped_steps)
    unread_voids: torch.Tensor | None = field(default=None, repr=False)  # the guard's device count, not read yet

    @property
    def steps(self) -> int:
        """Steps taken (saved in state_dict, so it survives a resume)."""
        self.read_voided()
        return self.counted_steps

    @steps.setter
    def steps(self, n: int) -> None:
        self.read_voided()
        self.counted_steps = n

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient under nonfinite="skip"."""
        self.read_voided()
        return self.counted_skips

    @skipped_steps.setter
    def skipped_steps(self, n: int) -> None:
        self.read_voided()
        self.counted_skips = n

    def count_voids(self, found: torch.Tensor) -> None:
        """Add a step's device-side void flag (0 or 1, not read) to the count :meth:`read_voided` folds in later."""
        if self.unread_voids is None or self.unread_voids.device != found.device:
            self.read_voided()
            self.unread_voids = torch.zeros((), dtype=torch.float32, device=found.device)
        self.unread_voids.add_(found)

    def read_voided(self) -> None:
        """Fold the steps voided on the device since the last read into the counts (one device read, made when a
        count is read); under ``nonfinite="skip"`` they are skipped steps, said once per read."""
        unread = self.unread_voids
        if unread is None:
            return
        n = int(unread.item())
        if not n:
            return
        unread.sub_(n)
        self.counted_steps -= n
        if self.options.get("nonfinite") == "skip":
            self.counted_skips += n
            logger.warning("%s: %d step(s) skipped for a non-finite gradient, found on the device (%d skipped so far)",
                           self.resolution.spec.trainer_name, n, self.counted_skips)


def unwrap(optimizer, until: str | None = "hf_efficient"):
    """The optimizer inside wrappers that hold it as ``.optimizer`` (Accelerate's, DeepSpeed's, the Trainer's).

    Args:
        optimizer: an optimizer, or a wrapper of one (of any depth).
        until: stop at the first object that has this attribute (default: the optimizer :func:`create_optimizer`
            made); None: the innermost.
    """
    while (until is None or not hasattr(optimizer, until)) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def optimizer_info(optimizer: torch.optim.Optimizer) -> OptimizerInfo | None:
    """The :class:`OptimizerInfo` of an optimizer made by :func:`create_optimizer` (unwraps Accelerate's)."""
    return getattr(unwrap(optimizer), "hf_efficient", None)
