"""Accelerate integration: the optimizer chosen in config, exact gradient accumulation, checked distributed set-ups.

A custom loop run with ``accelerate launch train.py`` needs three calls::

    plugin = EfficientOptimPlugin()                   # HF_EFF_* variables, a YAML file, keywords
    accelerator = plugin.create_accelerator()         # gradient accumulation wired in
    model, optimizer, train_dl, scheduler = plugin.prepare(accelerator, model, train_dl, num_training_steps=1000)
    for window in accumulation_windows(accelerator, train_dl):   # one window = one optimizer step
        for batch in window:
            with accelerator.accumulate(model):
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                accelerator.backward(window.scale(summed_token_loss(logits, batch["labels"])))
                optimizer.step(); scheduler.step(); optimizer.zero_grad()

This module is the public import path; each concern has its own module beside it:

- plugin.py: :class:`EfficientOptimPlugin` (fields, ``create_accelerator``, ``prepare``);
- plugin_config.py: where its values come from (defaults < YAML < ``HF_EFF_*`` variables < keywords) and how
  each is checked;
- accumulation.py: :func:`accumulation_windows`, :class:`AccumulationWindow`, :func:`summed_token_loss` (why
  windows: the token mean of a big batch is not the mean of its micro-batches' means);
- schedules.py: :data:`SCHEDULERS` and the learning-rate schedules;
- accelerator_checks.py: :func:`check_distributed_support` / :func:`choose_backend` read an Accelerator's state
  against the tables in distributed.py.
"""

from .accelerator_checks import check_distributed_support, choose_backend
from .accumulation import AccumulationWindow, accumulation_windows, summed_token_loss
from .plugin import EfficientOptimPlugin
from .schedules import SCHEDULERS

__all__ = ["EfficientOptimPlugin", "AccumulationWindow", "accumulation_windows", "summed_token_loss",
           "check_distributed_support", "choose_backend", "SCHEDULERS"]
