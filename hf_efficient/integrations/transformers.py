"""The only place that touches transformers internals: makes the ``hf_eff_*`` names transformers optimizers.

Applied lazily, module by module, by the start-up hook (``_hf_efficient_autoload``) or ``import hf_efficient``,
right after transformers imports the module patched; this file imports no transformers module itself, since
it runs while transformers is still importing. Every patch is idempotent and feature-checked rather than
version-pinned (tested on 4.46 and 5.23):

1. :func:`patch_training_args`: ``OptimizerNames`` (an Enum) gets one member per name, so
   ``TrainingArguments(optim=...)``, ``set_optimizer``, ``HfArgumentParser``'s ``--optim`` choices, ``to_dict``
   and pickling all accept them; an unknown ``hf_eff_*`` name raises our error listing the registered ones,
   and ``optim_args`` is checked when the arguments are made, before any model or data is loaded.
2. :func:`patch_trainer`: ``Trainer.get_optimizer_cls_and_kwargs`` answers for our names with
   :class:`TrainerOptimizer` and the model, so our weight-decay groups replace the Trainer's and ``optim_args``
   goes through our parser; ``Trainer.__init__`` adds :class:`MemoryCallback` for our names (and puts any
   MemoryCallback first), so measured optimizer state and peak memory reach the logs.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch

from .. import guard
from ..auto import choose_auto
from ..factory import build_optimizer, optimizer_info
from ..estimate import estimate_memory
from ..memory import MB, format_bytes, peak_memory, state_metrics
from ..options import OPTIONS, parse_optim_args, parse_options
from ..registry import PREFIX, SPECS, get_spec
from .distributed import trainer_fsdp_version

__all__ = ["register", "patch_training_args", "patch_trainer", "check_optim_args", "TrainerOptimizer",
           "is_hf_eff_name", "MemoryCallback", "model_from_config"]

logger = logging.getLogger(__name__)


def model_from_config(config, auto_class: str | None = None, device: torch.device | str = "meta") -> torch.nn.Module:
    """A transformers model for ``config``, by default on the meta device: shapes and dtypes, no memory (for
    :func:`hf_efficient.estimate_memory` and ``hf-efficient estimate``).

    The class is ``auto_class`` (e.g. ``"AutoModelForSequenceClassification"``), else the config's first
    ``architectures`` entry, else ``AutoModel``. Here, not in the core: the core never imports transformers.
    """
    import transformers

    cls_name = auto_class or (getattr(config, "architectures", None) or ["AutoModel"])[0]
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        raise ValueError(f"transformers has no class {cls_name!r}: pass auto_class= (e.g. 'AutoModelForCausalLM')")
    with torch.device(device):
        return cls.from_config(config) if hasattr(cls, "from_config") else cls._from_config(config)


def is_hf_eff_name(optim) -> bool:
    value = getattr(optim, "value", optim)
    return isinstance(value, str) and value.startswith(PREFIX)


def check_optim_args(optim, optim_args: str | None) -> None:
    """Raise for an unknown ``hf_eff_*`` name or a bad ``optim_args`` now, not when the optimizer is built.

    The same parser the optimizer uses at build time, so whatever passes here is what the optimizer gets.
    """
    spec = get_spec(optim)
    try:
        parse_options(spec.name, spec.accepted, parse_optim_args(optim_args), source="optim_args")
    except ValueError as exc:
        raise ValueError(f"TrainingArguments(optim={PREFIX + spec.name!r}, optim_args={optim_args!r}): {exc}") from None


class TrainerOptimizer(torch.optim.Optimizer):
    """What Trainer instantiates for an ``hf_eff_*`` name; constructing it returns the real optimizer.

    Trainer calls ``optimizer_cls(model, **kwargs)`` when the kwargs carry ``"model"`` (in 4.46 and 5.x
    alike) and treats anything but an Optimizer subclass differently across versions; a subclass whose
    ``__new__`` hands back the built optimizer is the one shape both accept.
    """

    def __new__(cls, model, *, hf_eff_name, optim_args, lr, betas, eps, weight_decay, world_size=1, sharding=None):
        given = parse_optim_args(optim_args)
        choice = None
        if get_spec(hf_eff_name).name == "auto":  # chosen here, not in build_optimizer, so the line below says why
            # under FSDP2 the Trainer builds the optimizer before it shards the model: auto sizes it per rank
            choice = choose_auto(model, given, source="optim_args", world_size=world_size, sharding=sharding)
        name, options = (PREFIX + choice.name, choice.options) if choice else (hf_eff_name, given)
        optimizer = build_optimizer(model, name, options, source="optim_args", lr=lr, betas=betas, eps=eps,
                                    weight_decay=weight_decay)
        res = optimizer_info(optimizer).resolution
        chose = f"chose {PREFIX}{res.name}, which " if choice else ""
        why = f". Why: {choice.why()}" if choice else ""
        hint = _embedding_state_hint(optimizer, model, given, world_size=world_size, sharding=sharding)
        # through transformers' own Trainer logger, beside its lines: a choice made for the user (auto's, or a
        # default that forgoes much of the saving) at WARNING, shown at the Trainer's default verbosity; else INFO
        logging.getLogger("transformers.trainer").log(
            logging.WARNING if choice or hint else logging.INFO, "hf_efficient: optim=%s %sruns on backend %s on %s "
            "(%s)%s%s", hf_eff_name, chose, res.backend, res.device, res.reason, why, hint)
        return optimizer


def _get_optimizer_cls_and_kwargs(args, model=None):
    if model is None:
        raise ValueError(f"{args.optim.value} needs the model to build weight-decay groups")
    return TrainerOptimizer, {
        "model": model, "hf_eff_name": args.optim.value, "optim_args": args.optim_args, "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon, "weight_decay": args.weight_decay,
        "world_size": args.world_size, "sharding": "fsdp2" if trainer_fsdp_version(args) == 2 else None,
    }


def optimizer_name(value: str):
    """The ``OptimizerNames`` member ``value``: what a pickled ``hf_eff_*`` member (``training_args.bin``) is
    rebuilt by. Part of the pickle format: this module path and name stay. Unpickling imports hf_efficient, which
    registers the names even where the start-up hook is off; where hf_efficient is missing, it fails with "No
    module named 'hf_efficient'" rather than transformers' "is not a valid OptimizerNames"."""
    from transformers.training_args import OptimizerNames

    patch_training_args(importlib.import_module("transformers.training_args"))
    return OptimizerNames(value)


def _add_enum_member(enum_cls, value: str) -> None:
    if value in enum_cls._value2member_map_:
        return
    member = str.__new__(enum_cls, value)
    member._name_, member._value_, member.__objclass__ = value.upper(), value, enum_cls
    # pickled through optimizer_name, not as OptimizerNames(value): see there why
    member.__reduce_ex__ = functools.partial(_reduce_name, value)
    member._sort_order_ = len(enum_cls._member_names_)
    if hasattr(enum_cls, "_add_member_"):  # Python >= 3.13
        enum_cls._add_member_(member._name_, member)
    else:
        enum_cls._member_map_[member._name_] = member
        enum_cls._member_names_.append(member._name_)
        type.__setattr__(enum_cls, member._name_, member)
    enum_cls._value2member_map_[value] = member


def _reduce_name(value: str, protocol: int):
    return optimizer_name, (value,)


def register() -> None:
    """Patch transformers now (imports its Trainer); the start-up hook or ``import hf_efficient`` does this lazily."""
    patch_training_args(importlib.import_module("transformers.training_args"))
    patch_trainer(importlib.import_module("transformers.trainer"))


def patch_training_args(module) -> None:
    """Make every ``hf_eff_*`` name an ``OptimizerNames`` member and check ``optim_args`` early (idempotent).

    Args:
        module: ``transformers.training_args``, just imported.
    """
    names, args_cls = module.OptimizerNames, module.TrainingArguments
    for spec in SPECS.values():
        _add_enum_member(names, spec.trainer_name)
    if getattr(names, "_hf_eff_patched", False):
        return
    original_missing = names._missing_

    def _missing_(cls, value):
        if is_hf_eff_name(value):
            # a name registered after transformers was patched (a family of the user's own, added to SPECS at run
            # time) becomes a member now; an unknown one raises the ValueError that lists our names
            _add_enum_member(cls, get_spec(value).trainer_name)
            return cls._value2member_map_[value]
        if isinstance(value, str) and value in SPECS:  # our short name, which transformers does not know
            raise ValueError(f"optim={value!r} is not a transformers optimizer name; hf_efficient's is "
                             f"{PREFIX + value!r} (TrainingArguments takes the full name)")
        return original_missing(value)

    names._missing_ = classmethod(_missing_)
    original_post_init, original_set_optimizer = args_cls.__post_init__, args_cls.set_optimizer

    @functools.wraps(original_post_init)
    def __post_init__(self, *args, **kwargs):
        if is_hf_eff_name(self.optim):
            check_optim_args(self.optim, self.optim_args)
        out = original_post_init(self, *args, **kwargs)
        if is_hf_eff_name(self.optim):  # a distributed set-up the name cannot train under: refused before the model
            from .distributed import check_training_arguments

            check_training_arguments(self)
            if OPTIONS["gradient_release"].coerce(parse_optim_args(self.optim_args).get("gradient_release", False),
                                                  "optim_args"):
                from ..release import check_trainer_args

                check_trainer_args(self)  # accumulation, clipping, fp16 scaler, distributed: refused here
        return out

    @functools.wraps(original_set_optimizer)
    def set_optimizer(self, name="adamw_torch", *args, **kwargs):
        if is_hf_eff_name(name):  # validate before the original changes any field
            check_optim_args(name, kwargs.get("args", args[5] if len(args) > 5 else None))
        return original_set_optimizer(self, name, *args, **kwargs)

    args_cls.__post_init__, args_cls.set_optimizer = __post_init__, set_optimizer
    names._hf_eff_patched = True


def patch_trainer(module) -> None:
    """Route ``hf_eff_*`` names to :class:`TrainerOptimizer` and add :class:`MemoryCallback` (idempotent).

    Args:
        module: ``transformers.trainer``, just imported (``training_args`` is patched by then: it imports it).
    """
    trainer_cls = module.Trainer
    if getattr(trainer_cls, "_hf_eff_patched", False):
        return
    original = trainer_cls.get_optimizer_cls_and_kwargs

    def get_optimizer_cls_and_kwargs(args, model=None):
        if is_hf_eff_name(args.optim):
            return _get_optimizer_cls_and_kwargs(args, model)
        return original(args, model)

    trainer_cls.get_optimizer_cls_and_kwargs = staticmethod(get_optimizer_cls_and_kwargs)
    _add_memory_callback(trainer_cls)
    _allow_numpy_rng_on_resume(trainer_cls)
    trainer_cls._hf_eff_patched = True


def _allow_numpy_rng_on_resume(trainer_cls) -> None:
    """Let transformers < 4.47 resume under torch >= 2.6.

    Those versions read ``rng_state.pth`` (numpy RNG arrays the Trainer itself wrote) with torch.load's
    default, which torch 2.6 turned into ``weights_only=True``: every resume then fails. Newer versions
    allowlist exactly these numpy types (``trainer_pt_utils.safe_globals``); do the same for older ones.
    Not an optimizer concern, so it is opt-out (``HF_EFF_PATCH_RNG_RESUME=0``) and goes with 4.46's support.
    """
    import os

    import numpy as np

    trainer_pt_utils = importlib.import_module("transformers.trainer_pt_utils")

    if hasattr(trainer_pt_utils, "safe_globals") or not hasattr(torch.serialization, "safe_globals"):
        return
    if os.environ.get("HF_EFF_PATCH_RNG_RESUME", "1").strip().lower() in ("0", "false", "no", "off"):
        return
    logger.info("hf_efficient: transformers < 4.47 under torch >= 2.6: Trainer._load_rng_state allowlists the numpy "
                "types of its own rng_state.pth (HF_EFF_PATCH_RNG_RESUME=0 to leave it alone)")
    np_core = getattr(np, "_core", None) or np.core
    allow = [np_core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    original = trainer_cls._load_rng_state

    def _load_rng_state(self, checkpoint):
        with torch.serialization.safe_globals(allow):
            return original(self, checkpoint)

    trainer_cls._load_rng_state = _load_rng_state


class _MemoryCallback:
    """Puts what the optimizer really costs into the Trainer's logs, so TensorBoard / W&B / log_history get it.

    After the first optimizer step: ``hf_eff/optimizer_state_mb`` (measured by
    :func:`hf_efficient.optimizer_state_bytes`), ``hf_eff/fp32_adamw_state_mb`` and
    ``hf_eff/optimizer_state_saving`` (the fraction saved against fp32 AdamW for the same parameters).
    At every log: ``hf_eff/peak_cuda_allocated_mb`` (``torch.cuda.max_memory_allocated``), or
    ``hf_eff/peak_rss_mb`` (the process' peak resident memory) on CPU. MB = 2**20 bytes (MiB).

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
        logger.info("hf_efficient: optimizer state %s measured at step %d; fp32 AdamW: %s; this saves %.0f%%",
                    format_bytes(metrics["optimizer_state_mb"] * MB), state.global_step,
                    format_bytes(metrics["fp32_adamw_state_mb"] * MB), 100 * metrics["optimizer_state_saving"])
        if getattr(args.logging_strategy, "value", args.logging_strategy) != "no":
            control.should_log = True  # log at this step rather than at the next logging_steps

    def on_log(self, args, state, control, logs=None, model=None, optimizer=None, **kwargs):
        if optimizer is not None:  # a value is logged: a step voided on the device under nonfinite=raise says so now
            guard.raise_if_voided(optimizer)
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


_HINT_MIN_GAIN = 0.10  # of fp32 AdamW's state: below this, 8-bit embeddings are not worth a line


def _embedding_state_hint(optimizer, model, given: dict, **sharded) -> str:
    """A sentence for the optimizer's log line when the embeddings keep 32-bit state by default (the user did not
    choose it) and ``embedding_state=8bit`` would save a good deal more (a large vocabulary); else "". Both settings
    are predicted by :func:`estimate_memory`, per rank where the model will be sharded."""
    info = optimizer_info(optimizer)
    if info.options.get("embedding_state") != "32bit" or "embedding_state" in given:
        return ""
    options = {k: v for k, v in info.options.items() if k in get_spec(info.resolution.name).options}
    now = estimate_memory(model, info.resolution.name, **sharded, **options)
    options["embedding_state"] = "8bit"
    all8 = estimate_memory(model, info.resolution.name, **sharded, **options)
    gain = now.state_bytes - all8.state_bytes
    if not now.fp32_adamw_state_bytes or gain / now.fp32_adamw_state_bytes < _HINT_MIN_GAIN:
        return ""
    return (f". The embeddings keep 32-bit state (the default, for accuracy): optim_args=\"embedding_state=8bit\" "
            f"would save about {format_bytes(gain)} more ({all8.saving:.0%} of fp32 AdamW's state in all, instead "
            f"of {now.saving:.0%})")


def _add_memory_callback(trainer_cls) -> None:
    """Wrap ``Trainer.__init__``: add a :class:`MemoryCallback` for hf_eff_* names, and put it first."""
    if getattr(trainer_cls.__init__, "_hf_eff_memory", False):
        return
    original = trainer_cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        callbacks = self.callback_handler.callbacks
        cls = _memory_callback_cls()
        mine = [cb for cb in callbacks if isinstance(cb, cls)]
        if not mine and is_hf_eff_name(self.args.optim):
            mine = [cls()]
        callbacks[:] = mine + [cb for cb in callbacks if not isinstance(cb, cls)]

    __init__._hf_eff_memory = True
    trainer_cls.__init__ = __init__


@functools.cache
def _memory_callback_cls() -> type:
    """:class:`MemoryCallback`, made on first use: its base, ``TrainerCallback``, is not importable while
    transformers is still importing the modules this file patches."""
    from transformers.trainer_callback import TrainerCallback

    return type("MemoryCallback", (_MemoryCallback, TrainerCallback),
                {"__doc__": _MemoryCallback.__doc__, "__module__": __name__, "__qualname__": "MemoryCallback"})


def __getattr__(name: str):
    if name == "MemoryCallback":
        return _memory_callback_cls()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
