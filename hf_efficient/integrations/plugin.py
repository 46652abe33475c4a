"""EfficientOptimPlugin: the optimizer, schedule and gradient accumulation of an Accelerate loop, set in config.

Where values come from and how they are checked: plugin_config.py. Distributed checks and the optimizer's
bookkeeping after ``accelerator.prepare``: accelerator_checks.py. Schedules: schedules.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

import torch

from ..factory import build_optimizer, optimizer_info
from ..options import parse_options
from ..registry import PREFIX, get_spec
from . import plugin_config as config
from .accelerator_checks import (check_processes_joined, choose_backend, drop_stale_param_names, fp32_state_flags,
                                 restore_fp32_state_ids)
from .distributed import choose_for_sharding
from .schedules import SCHEDULERS, build_scheduler

__all__ = ["EfficientOptimPlugin"]

logger = logging.getLogger(__name__)
_opt = config.option_field


@dataclass
class EfficientOptimPlugin:
    """The optimizer, its schedule and gradient accumulation of an Accelerate loop, set in config, not code.

    Each field can come from a YAML file (``HF_EFF_CONFIG=path`` or ``config_file=``), an environment variable
    ``HF_EFF_<FIELD>`` (``HF_EFF_OPTIM``, ``HF_EFF_LR``, ...), or a keyword; later sources win, and
    ``plugin.sources`` says where each value came from. Defaults match ``TrainingArguments``.

    Example:
        ```bash
        HF_EFF_OPTIM=adam8bit HF_EFF_GRADIENT_ACCUMULATION_STEPS=4 accelerate launch train.py
        ```
        ```python
        from hf_efficient.integrations.accelerate import EfficientOptimPlugin, accumulation_windows

        plugin = EfficientOptimPlugin(lr=3e-4)           # keywords override the file and the environment
        accelerator = plugin.create_accelerator()
        model, optimizer, train_dl, scheduler = plugin.prepare(accelerator, model, train_dl,
                                                               num_training_steps=1000)
        ```
    """

    optim: str = _opt("adamw", "optimizer name, short ('adam8bit') or Trainer ('hf_eff_adam8bit')", config.optim_name)
    lr: float = _opt(5e-5, "peak learning rate", config.hyper("lr"))
    weight_decay: float = _opt(0.0, "decoupled weight decay of the decay group (norms and biases get none)",
                               config.hyper("weight_decay"))
    betas: tuple = _opt((0.9, 0.999), "Adam betas; text 'beta1,beta2' in the environment", config.betas)
    eps: float = _opt(1e-8, "Adam epsilon", config.hyper("eps"))
    decay_embeddings: bool = _opt(True, "whether embedding matrices are decayed (transformers does)",
                                  config.core_option("decay_embeddings"))
    backend: str = _opt(None, "force 'bnb', 'torchao' or 'torch'; None or 'auto': the registry's choice",
                        config.core_option("backend"))
    gradient_release: bool = _opt(False, "step each tensor inside backward and free its gradient (no accumulation, "
                                  "no clip_grad_norm_, no fp16 scaler, one process)",
                                  config.core_option("gradient_release"))
    gradient_accumulation_steps: int = _opt(1, "micro-batches per optimizer step (per process)", config.at_least(1))
    lr_scheduler_type: str = _opt("linear", f"one of {', '.join(SCHEDULERS)}", config.scheduler)
    warmup_steps: int = _opt(0, "linear warm-up, in optimizer steps", config.at_least(0))
    warmup_ratio: float = _opt(0.0, "warm-up as a fraction of num_training_steps (instead of warmup_steps)",
                               config.ratio)
    optim_args: dict = _opt({}, "backend options, as optim_args text 'k=v,...' or a mapping "
                                "(embedding_state, min_8bit_size, ...)", config.optim_args)
    config_file: str = field(default=None, metadata={
        "help": "YAML file of these fields (default: $HF_EFF_CONFIG, else none)", "parse": config.config_path})

    def __post_init__(self):
        own = [f for f in fields(self) if f.name != "config_file"]
        known = [f.name for f in own]
        explicit = {k: getattr(self, k) for k in known if getattr(self, k) is not None}
        self.config_file, from_file = config.file_layer(self.config_file, known)
        values, self.sources, optim_args = config.merge_layers(
            own, [from_file, config.env_layer(known), config.keyword_layer(explicit)])
        for key, value in values.items():
            object.__setattr__(self, key, value)
        self.optim_args = {k: v for k, (v, _) in optim_args.items()}
        self._optim_args_sources = {k: s for k, (_, s) in optim_args.items()}
        self._check_combination()

    def _check_combination(self) -> None:
        spec = get_spec(self.optim)
        by_source: dict[str, dict] = {}
        for key, value in self.optim_args.items():
            by_source.setdefault(self._optim_args_sources[key], {})[key] = value
        for src, given in by_source.items():  # the core's parser, once per source so errors name it
            parse_options(spec.name, spec.accepted, given, source=f"{src} (optim_args)")
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError(f"warmup_steps={self.warmup_steps} ({self.sources['warmup_steps']}) and warmup_ratio="
                             f"{self.warmup_ratio} ({self.sources['warmup_ratio']}) are both set: keep one")
        if self.lr_scheduler_type == "constant" and (self.warmup_steps or self.warmup_ratio):
            raise ValueError(f"lr_scheduler_type='constant' ({self.sources['lr_scheduler_type']}) ignores warm-up: "
                             "use 'constant_with_warmup', or drop the warm-up")

    def describe(self) -> str:
        """One line per field with its value and source, for logs."""
        rows = [f"{k}={getattr(self, k)!r} ({s})" for k, s in self.sources.items() if k != "optim_args"]
        rows += [f"optim_args.{k}={v!r} ({self._optim_args_sources[k]})" for k, v in self.optim_args.items()]
        return "; ".join(rows)

    # -- set-up -------------------------------------------------------------------------------------------
    def create_accelerator(self, **kwargs):
        """An ``Accelerator`` accumulating ``gradient_accumulation_steps`` micro-batches per optimizer step.

        Accumulation is counted in :func:`accumulation_windows` (``sync_with_dataloader=False``), so a short
        last window still steps, at the right boundary. Other keywords go to ``Accelerator``. Unsupported
        distributed combinations are refused here, before a model is loaded.
        """
        from accelerate import Accelerator
        from accelerate.utils import GradientAccumulationPlugin

        for key in ("gradient_accumulation_steps", "gradient_accumulation_plugin"):
            if key in kwargs:
                raise ValueError(f"create_accelerator({key}=...): set gradient_accumulation_steps on the plugin "
                                 f"(or {config.ENV_PREFIX}GRADIENT_ACCUMULATION_STEPS) so the loss scaling agrees "
                                 "with it")
        ga = GradientAccumulationPlugin(num_steps=self.gradient_accumulation_steps, sync_with_dataloader=False)
        accelerator = Accelerator(gradient_accumulation_plugin=ga, **kwargs)
        self._check_accelerator(accelerator)
        if accelerator.is_main_process:
            logger.info("hf_efficient accelerate config: %s", self.describe())
        return accelerator

    def _check_accelerator(self, accelerator) -> tuple[str | None, str]:
        """Refuse an unsupported set-up; return the backend to force (None: the registry's) and why."""
        check_processes_joined(accelerator)
        plugin_ga = (self.gradient_accumulation_steps, self.sources["gradient_accumulation_steps"])
        # the distributed set-up first: under FSDP2 gradient release is refused there, with FSDP2's own reason
        chosen = choose_backend(self.optim, self.backend, self._core_options(), accelerator.state, accelerator.device,
                                plugin_ga=plugin_ga)
        if self._core_options().get("gradient_release"):
            from ..release import check_accelerate

            check_accelerate(accelerator)
        if accelerator.gradient_accumulation_steps != self.gradient_accumulation_steps:
            raise ValueError(
                f"the Accelerator accumulates {accelerator.gradient_accumulation_steps} micro-batches but the plugin "
                f"says gradient_accumulation_steps={self.gradient_accumulation_steps} "
                f"({self.sources['gradient_accumulation_steps']}): create it with plugin.create_accelerator()")
        if accelerator.gradient_state.sync_with_dataloader:
            raise ValueError("the Accelerator was made with sync_with_dataloader=True, which steps when the loader "
                             "is exhausted, before a prefetched window is done: use plugin.create_accelerator()")
        return chosen

    def _core_options(self) -> dict:
        # backend only when forced: hf_eff_auto has no backend option (the name it picks resolves its own)
        forced = {} if self.backend is None else {"backend": self.backend}
        release = {"gradient_release": True} if self.gradient_release else {}
        return {**self.optim_args, "decay_embeddings": self.decay_embeddings, **forced, **release}

    def create_optimizer(self, model, backend: str | None = None, *, world_size: int = 1,
                         sharding: str | None = None) -> torch.optim.Optimizer:
        """The optimizer alone (decay groups, backend by the registry), for a loop that prepares it itself.

        ``world_size``/``sharding`` (as :func:`~hf_efficient.estimate_memory` takes them): how the model will be
        sharded after this, so that ``hf_eff_auto`` chooses from the per-rank footprint (:meth:`prepare` passes
        them under FSDP2)."""
        options = self._core_options()
        if backend is not None:
            options["backend"] = backend
        sources = sorted(set(self._optim_args_sources.values()))
        source = "EfficientOptimPlugin" + (f" optim_args from {', '.join(sources)}" if sources else "")
        name, options = choose_for_sharding(model, self.optim, options, world_size=world_size, sharding=sharding,
                                            source=source)
        return build_optimizer(model, name, options, source=source, lr=self.lr, weight_decay=self.weight_decay,
                               betas=self.betas, eps=self.eps)

    def create_scheduler(self, optimizer, num_training_steps: int | None, steps_per_update: int = 1):
        """The LR schedule over ``num_training_steps`` optimizer steps (see :func:`schedules.build_scheduler`)."""
        if num_training_steps is not None:
            num_training_steps = config.at_least(1)(num_training_steps, "num_training_steps")
        scheduler, self.resolved_warmup_steps = build_scheduler(
            optimizer, self.lr_scheduler_type, num_training_steps=num_training_steps, warmup_steps=self.warmup_steps,
            warmup_ratio=self.warmup_ratio, steps_per_update=steps_per_update)
        return scheduler

    def prepare(self, accelerator, model, *dataloaders, num_training_steps: int | None = None):
        """Build optimizer and scheduler for ``model`` and pass everything through ``accelerator.prepare``.

        Returns:
            ``model, optimizer, *dataloaders, scheduler``, prepared (the order ``accelerator.prepare`` would
            give for ``prepare(model, optimizer, *dataloaders, scheduler)``).
        """
        backend, why = self._check_accelerator(accelerator)
        if getattr(accelerator.state, "fsdp_plugin", None) is None and accelerator.device_placement:
            model = model.to(accelerator.device)  # resolve the backend (and fused kernels) for the real device
        fsdp = getattr(accelerator.state, "fsdp_plugin", None) is not None
        optimizer = self.create_optimizer(model, backend=backend, world_size=accelerator.num_processes,
                                          sharding="fsdp2" if fsdp else None)
        split = accelerator.split_batches or not accelerator.step_scheduler_with_optimizer
        scheduler = self.create_scheduler(optimizer, num_training_steps,
                                          steps_per_update=1 if split else accelerator.num_processes)
        fp32_flags = fp32_state_flags(optimizer)
        prepared = accelerator.prepare(model, optimizer, *dataloaders, scheduler)
        restore_fp32_state_ids(prepared[1], fp32_flags)
        drop_stale_param_names(prepared[1])
        info = optimizer_info(prepared[1])
        if accelerator.is_main_process:
            logger.info("hf_efficient: %s%s -> backend %s (%s%s); schedule %s over %s steps, %d warm-up; "
                        "gradient accumulation %d x %d processes", PREFIX, info.resolution.name,
                        info.resolution.backend, info.resolution.reason, f"; {why}" if why else "",
                        self.lr_scheduler_type, num_training_steps, self.resolved_warmup_steps,
                        self.gradient_accumulation_steps, accelerator.num_processes)
        return prepared
