"""Exact gradient accumulation in an Accelerate loop: windows of micro-batches counted before any backward.

With token-level losses, micro-batches hold different numbers of target tokens, so the mean of per-micro-batch
means is not the big batch's mean. A window counts the target tokens of all its micro-batches on all processes
first; each micro-batch's *summed* loss is then divided by that count (as transformers' Trainer does with
``num_items_in_batch``), which makes the accumulated gradient equal the big batch's.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

__all__ = ["AccumulationWindow", "accumulation_windows", "summed_token_loss"]


@dataclass
class AccumulationWindow:
    """The micro-batches of one optimizer step, with the target-token count of the whole step.

    Attributes:
        batches: this process's micro-batches.
        num_items: target tokens in the window, summed over every micro-batch on every process.
        factor: what :meth:`scale` multiplies a summed loss by.
    """

    batches: list
    num_items: int
    factor: float

    def __iter__(self) -> Iterator:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)

    def scale(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The loss to give ``accelerator.backward`` for a micro-batch whose loss, summed over tokens, is ``loss_sum``.

        Accelerate divides by the accumulation steps and DDP/FSDP/DeepSpeed average over processes; this
        undoes both and divides by the window's token count, so the update uses the big batch's token mean.
        """
        return loss_sum * self.factor


def _count_labels(labels_key: str, ignore_index: int) -> Callable[[Any], torch.Tensor]:
    def count(batch):
        return (batch[labels_key] != ignore_index).sum()
    return count


def accumulation_windows(accelerator, dataloader: Iterable, *, labels_key: str = "labels", ignore_index: int = -100,
                         count: Callable[[Any], int | torch.Tensor] | None = None) -> Iterator[AccumulationWindow]:
    """Group ``dataloader`` into windows of ``gradient_accumulation_steps`` micro-batches, one per optimizer step.

    Each window's target tokens are counted over all its micro-batches on all processes (one all-reduce per
    window) before the first backward, and ``accelerator.accumulate`` is told to synchronise on the window's
    last micro-batch, so a short last window still makes a correct step.

    Args:
        accelerator: from :meth:`EfficientOptimPlugin.create_accelerator` (``sync_with_dataloader=False``).
        dataloader: the prepared training loader (all processes must yield the same number of batches,
            Accelerate's default ``even_batches``).
        labels_key: the batch's labels; targets are ``batch[labels_key] != ignore_index``.
        ignore_index: the label of tokens that are no target.
        count: a different count per batch, e.g. ``lambda b: (b["labels"][:, 1:] != -100).sum()`` for a causal
            LM that shifts labels inside the model.
    """
    if accelerator.gradient_state.sync_with_dataloader:
        raise ValueError("accumulation_windows prefetches a window, so the Accelerator must not sync on the end of "
                         "the dataloader: create it with EfficientOptimPlugin.create_accelerator() (or "
                         "GradientAccumulationPlugin(num_steps=N, sync_with_dataloader=False))")
    count = count or _count_labels(labels_key, ignore_index)
    steps = accelerator.gradient_accumulation_steps
    it = iter(dataloader)
    while batches := list(islice(it, steps)):
        local = sum(torch.as_tensor(count(b), dtype=torch.long, device=accelerator.device) for b in batches)
        total = int(accelerator.reduce(local, reduction="sum")) if accelerator.num_processes > 1 else int(local)
        # accumulate() syncs when its counter reaches a multiple of `steps`: start it so that happens on our last.
        accelerator.step = steps - len(batches)
        yield AccumulationWindow(batches, total, accelerator.num_processes * steps / max(total, 1))


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy summed (not averaged) over a batch's target tokens, in fp32, for ``window.scale``."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=ignore_index,
                           reduction="sum")
