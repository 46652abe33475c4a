"""Which optimizer name runs under which distributed set-up (FSDP2, DeepSpeed ZeRO), checked before a model loads.

Both integrations ask here: the Accelerate plugin from ``create_accelerator`` (through
``accelerate.check_distributed_support``) and the Trainer from its ``TrainingArguments``
(:func:`check_training_arguments`). The checks take plain values and config dicts, so this module imports
neither accelerate nor transformers.

What each name supports is written on its registry entry (``Backend.fsdp2``, ``Family.deepspeed``,
``Family.deepspeed_options``); every entry was observed, not derived: FSDP2 by running each optimizer on
torch's ``fully_shard`` DTensor parameters (tests/test_accelerate_distributed.py), DeepSpeed by training each name under ZeRO 1, 2
and 3 in two gloo processes, through the plugin and through the Trainer (tests/test_deepspeed.py).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from ..options import OPTIONS, parse_optim_args, parse_options
from ..registry import PREFIX, SPECS, Resolution, get_spec, resolve

__all__ = ["FSDP2_UNSUPPORTED", "DEEPSPEED_UNSUPPORTED", "FSDP2_NO_RELEASE", "check_fsdp", "check_deepspeed",
           "check_training_arguments", "trainer_fsdp_version", "choose_for_sharding", "warn_if_processes_missing"]

logger = logging.getLogger(__name__)
_warned_missing: list = []  # the one warning of this process, once given

# What the registry says, as tables: (name, backend) -> why not under FSDP2; name -> why not under DeepSpeed
FSDP2_UNSUPPORTED = {(s.name, b): impl.fsdp2 for s in SPECS.values() for b, impl in s.backends.items() if impl.fsdp2}
DEEPSPEED_UNSUPPORTED = {s.name: s.facts.deepspeed for s in SPECS.values() if s.facts.deepspeed}
# torchao's AdamW8bit runs on shards, but is never chosen for a user (see registry.TORCHAO_FLAW).
FSDP2_INSTEAD = (f"use {PREFIX}adamw, or this optimizer with DDP; backend=torchao runs 8-bit state on FSDP2 shards, "
                 "but only when forced, because its AdamW8bit stores small second moments as exactly 0 (a later "
                 "zero gradient then moves a weight by lr * exp_avg / eps, thousands of times too far)")
# Read in torch 2.13's FSDP2 (_fsdp_collectives.foreach_reduce): autograd accumulates into the *unsharded*
# parameters, and FSDP2 calls the sharded parameter's post-accumulate-grad hooks itself, after the reduce-scatter,
# inside its reduce stream, once per backward (so once per micro-batch). Release's hooks would then step there: a
# step that is itself collective (Adafactor's column all-reduce, the guard's agreement across ranks) issued from
# inside FSDP2's reduction, on its stream, while later layers' reduce-scatters are in flight. Not shown equal to the
# ordinary FSDP2 step, so refused.
FSDP2_NO_RELEASE = ("gradient release is not supported with FSDP2: torch's FSDP2 runs a sharded parameter's "
                    "post-accumulate-grad hooks itself, after its reduce-scatter, inside its reduction stream; a "
                    "release step there would issue the optimizer's own collectives (Adafactor's column statistics, "
                    "the inf/NaN agreement across ranks) from inside FSDP2's reduction, which is not shown equal to "
                    "the ordinary step. Train without gradient_release (FSDP2 already frees the unsharded gradients "
                    "after each reduce-scatter)")
DEEPSPEED_INSTEAD = f"{PREFIX}adamw or {PREFIX}adam8bit (embedding_state=8bit) with DeepSpeed, or this optimizer " \
                    "with DDP / FSDP2"


def _resolution(name, backend: str | None, device) -> Resolution | None:
    """What ``name`` runs as on ``device`` (None for a name that picks another per model): a Resolution given by
    the caller is used as it is, so a check never resolves twice."""
    if isinstance(name, Resolution):
        return name
    return resolve(name, device, backend, log=False) if get_spec(name).backends else None


def _label(res: Resolution | None) -> str:
    return f"{PREFIX}auto" if res is None else f"{PREFIX}{res.name} (backend={res.backend})"


def _refuse_auto(res: Resolution | None) -> None:
    if res is None:
        raise ValueError(f"{PREFIX}auto is not supported with DeepSpeed: it sizes per-parameter optimizer state, and "
                         f"ZeRO steps flat partitions. Name the optimizer: {PREFIX}adamw, or {PREFIX}adam8bit with "
                         "optim_args embedding_state=8bit.")


def check_fsdp(name: str | Resolution, backend: str | None, *, version: int, device="cpu",
               gradient_release: bool = False) -> None:
    """Raise ValueError, saying what to use instead, if ``name``/``backend`` cannot train under FSDP ``version``.

    ``name`` may be the :class:`Resolution` already made for it (``backend`` and ``device`` then unused). A name
    runs under FSDP2 when the registry says its backend steps DTensor shards (``Backend.fsdp2`` is None).
    ``hf_eff_auto`` is accepted: it sizes its candidates per rank and picks only names that step shards
    (:func:`choose_for_sharding`). ``backend=None`` is the registry's automatic choice, which never picks torchao.
    Gradient release is refused (:data:`FSDP2_NO_RELEASE`).
    """
    res = _resolution(name, backend, device)
    label = _label(res)
    if version != 2:
        raise ValueError(f"{label} with FSDP version {version} is not supported: FSDP1 hands the optimizer "
                         "flattened parameters (no shapes, names or decay groups). Set fsdp_version: 2 in the "
                         "accelerate config (or --fsdp_version 2; the Trainer: fsdp_config={'version': 2}).")
    if gradient_release:
        raise ValueError(f"{label}: {FSDP2_NO_RELEASE}.")
    if res is None:
        return
    why = res.implementation.fsdp2
    if why:
        raise ValueError(f"{label} is not supported with FSDP2: {why}. Instead: {FSDP2_INSTEAD}.")


def check_deepspeed(name: str | Resolution, backend: str | None, options: Mapping, config: Mapping | None, *,
                    device="cpu", offload: str | None = None, plugin_ga: tuple[int, str] | None = None,
                    config_ga: Any = "auto") -> None:
    """Raise ValueError, saying what to use instead, if ``name`` cannot train under this DeepSpeed config.

    Args:
        name, backend: the optimizer name and forced backend (None: the registry's choice on ``device``), or
            the :class:`Resolution` already made for them.
        options: the name's parsed options (a family's ``deepspeed_options`` are read).
        config: the DeepSpeed config dict (``optimizer`` and ``zero_optimization.offload_optimizer`` are read).
        offload: accelerate's ``offload_optimizer_device``, when set outside the config.
        plugin_ga, config_ga: the plugin's (gradient_accumulation_steps, its source) and the config's count,
            which must agree when both are numbers.
    """
    config = config or {}
    res = _resolution(name, backend, device)
    label = _label(res)
    if "optimizer" in config:
        raise ValueError(f"the DeepSpeed config has an 'optimizer' section, which would replace {label}: remove it "
                         "and let hf_efficient build the optimizer")
    offload = offload or (config.get("zero_optimization") or {}).get("offload_optimizer", {}).get("device")
    if offload not in (None, "none"):
        raise ValueError(f"{label} with DeepSpeed optimizer offload ({offload}) is not supported: offload runs "
                         "DeepSpeed's own CPU Adam. Drop offload_optimizer, or use DDP / FSDP2.")
    if plugin_ga is not None and isinstance(config_ga, int) and config_ga != plugin_ga[0]:
        raise ValueError(f"the DeepSpeed config accumulates {config_ga} micro-batches but gradient_accumulation_steps"
                         f"={plugin_ga[0]} ({plugin_ga[1]}): set one of them (DeepSpeed accepts 'auto')")
    _refuse_auto(res)
    facts = res.spec.facts
    if facts.deepspeed:
        raise ValueError(f"{label} is not supported with DeepSpeed: {facts.deepspeed}. Instead: {DEEPSPEED_INSTEAD}.")
    for key, (needed, why) in facts.deepspeed_options.items():
        if options.get(key, OPTIONS[key].default) != needed:
            raise ValueError(f"{label} with DeepSpeed {why} (trains under ZeRO 1, 2 and 3), or use DDP / FSDP2.")


def check_training_arguments(args) -> None:
    """Refuse ``TrainingArguments`` whose ``hf_eff_*`` optimizer cannot train under their ``deepspeed`` config or
    their ``fsdp`` set-up, and warn if ``accelerate launch`` started fewer processes than asked
    (:func:`warn_if_processes_missing`).

    Meant for the end of ``TrainingArguments.__post_init__``, so the refusal comes before a model is loaded
    (the Trainer builds the optimizer only after). A no-op for other optimizers or without DeepSpeed / FSDP.
    """
    optim = getattr(args.optim, "value", args.optim)
    if not (isinstance(optim, str) and optim.startswith(PREFIX)):
        return
    warn_if_processes_missing()
    fsdp = trainer_fsdp_version(args)
    if not getattr(args, "deepspeed", None) and fsdp is None:
        return
    spec = get_spec(optim)
    source = "TrainingArguments.optim_args"
    raw = parse_optim_args(args.optim_args) if isinstance(args.optim_args, str) else dict(args.optim_args or {})
    options = parse_options(spec.name, spec.accepted, raw, source=source)
    device = "cpu" if getattr(args, "use_cpu", False) else _default_device()
    if fsdp is not None:
        check_fsdp(spec.name, options.get("backend"), version=fsdp, device=device,
                   gradient_release=bool(options.get("gradient_release")))
    else:
        check_deepspeed(spec.name, options.get("backend"), options, _deepspeed_config(args.deepspeed), device=device)


def trainer_fsdp_version(args) -> int | None:
    """The FSDP version ``TrainingArguments`` train under (transformers reads ``fsdp_config['version']``, after
    dropping an ``fsdp_`` prefix, default 2), or None without FSDP."""
    if not getattr(args, "fsdp", None):
        return None
    config = getattr(args, "fsdp_config", None) or {}
    return int(config.get("version", config.get("fsdp_version", 2)))


def choose_for_sharding(model, name: str, options: Mapping, *, world_size: int, sharding: str | None, source: str):
    """(name, options) to build: ``name`` itself, or, for ``hf_eff_auto`` on a model that will be sharded after
    the optimizer is built (the Trainer and ``accelerate.prepare`` both build it first), the name auto picks from
    the per-rank footprint among names that train under ``sharding``."""
    if get_spec(name).name != "auto" or world_size <= 1 or sharding is None:
        return name, dict(options)
    from ..auto import choose_auto

    choice = choose_auto(model, options, source=source, world_size=world_size, sharding=sharding)
    return choice.name, choice.options


def launched_processes() -> int | None:
    """How many processes ``accelerate launch`` was asked for, where it started this one alone; None if unknown.

    ``accelerate launch --cpu --num_processes N`` takes accelerate's single-process launcher, which sets
    ``ACCELERATE_USE_CPU`` but neither ``WORLD_SIZE`` nor any count: the count is read from the launcher's own
    command line (the parent process, on systems with ``/proc``). Launchers that start N processes set
    ``WORLD_SIZE``, which :func:`~hf_efficient.integrations.accelerator_checks.check_processes_joined` compares.
    """
    if os.environ.get("WORLD_SIZE") or "ACCELERATE_USE_CPU" not in os.environ:
        return None
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if "launch" not in argv and not any(a.endswith(("accelerate.commands.launch", "accelerate-launch")) for a in argv):
        return None
    for i, arg in enumerate(argv):
        key, _, value = arg.partition("=")
        if key in ("--num_processes", "--num-processes"):
            value = value or (argv[i + 1] if i + 1 < len(argv) else "")
            return int(value) if value.isdigit() else None
    return None


def warn_if_processes_missing() -> None:
    """Warn once if ``accelerate launch`` was asked for more processes than the one it started (see
    :func:`launched_processes`): each would otherwise train alone, silently, on all the data."""
    asked = launched_processes()
    if asked is None or asked <= 1 or _warned_missing:
        return
    _warned_missing.append(asked)
    logger.warning("hf_efficient: accelerate launch was asked for %d processes (--num_processes %d) but started only "
                   "this one: with --cpu it runs a single process. For %d CPU processes: ACCELERATE_USE_CPU=true "
                   "accelerate launch --multi_gpu --num_processes %d ...", asked, asked, asked, asked)


def _deepspeed_config(value) -> dict:
    """The DeepSpeed config given to TrainingArguments: a dict, or a JSON file's path."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, str) and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return json.load(f)
    return {}  # transformers itself refuses anything else


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
