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

__all__ = ["FSDP2_UNSUPPORTED", "DEEPSPEED_UNSUPPORTED", "check_fsdp", "check_deepspeed", "check_training_arguments",
           "warn_if_processes_missing"]

logger = logging.getLogger(__name__)
_warned_missing: list = []  # the one warning of this process, once given

# What the registry says, as tables: (name, backend) -> why not under FSDP2; name -> why not under DeepSpeed
FSDP2_UNSUPPORTED = {(s.name, b): impl.fsdp2 for s in SPECS.values() for b, impl in s.backends.items() if impl.fsdp2}
DEEPSPEED_UNSUPPORTED = {s.name: s.facts.deepspeed for s in SPECS.values() if s.facts.deepspeed}
# torchao's AdamW8bit runs on shards, but is never chosen for a user (see registry.TORCHAO_FLAW).
FSDP2_INSTEAD = (f"use {PREFIX}adamw, or this optimizer with DDP; backend=torchao runs 8-bit state on FSDP2 shards, "
                 "but only when forced, because its AdamW8bit stores small second moments as exactly 0 (a later "
                 "zero gradient then moves a weight by lr * exp_avg / eps, thousands of times too far)")
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


def _refuse_auto(res: Resolution | None, where: str) -> None:
    if res is None:
        raise ValueError(f"{PREFIX}auto is not supported with {where}: it sizes unsharded optimizer state, and the "
                         f"names it falls back to after {PREFIX}adamw do not run there as they are. Name the "
                         f"optimizer: {PREFIX}adamw" + (f", or {PREFIX}adam8bit with optim_args embedding_state=8bit"
                                                        if where == "DeepSpeed" else "") + ".")


def check_fsdp(name: str | Resolution, backend: str | None, *, version: int, device="cpu") -> None:
    """Raise ValueError, saying what to use instead, if ``name``/``backend`` cannot train under FSDP ``version``.

    ``name`` may be the :class:`Resolution` already made for it (``backend`` and ``device`` then unused).
    ``backend=None`` is the registry's automatic choice, which never picks torchao: under FSDP2 that leaves
    no 8-bit backend, so ``adam8bit`` is refused unless ``backend="torchao"`` is forced (which logs why not).
    """
    res = _resolution(name, backend, device)
    label = _label(res)
    if version != 2:
        raise ValueError(f"{label} with FSDP version {version} is not supported: FSDP1 hands the optimizer "
                         "flattened parameters (no shapes, names or decay groups). Set fsdp_version: 2 in the "
                         "accelerate config (or --fsdp_version 2).")
    _refuse_auto(res, "FSDP2")
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
    _refuse_auto(res, "DeepSpeed")
    facts = res.spec.facts
    if facts.deepspeed:
        raise ValueError(f"{label} is not supported with DeepSpeed: {facts.deepspeed}. Instead: {DEEPSPEED_INSTEAD}.")
    for key, (needed, why) in facts.deepspeed_options.items():
        if options.get(key, OPTIONS[key].default) != needed:
            raise ValueError(f"{label} with DeepSpeed {why} (trains under ZeRO 1, 2 and 3), or use DDP / FSDP2.")


def check_training_arguments(args) -> None:
    """Refuse ``TrainingArguments`` whose ``hf_eff_*`` optimizer cannot train under their ``deepspeed`` config,
    and warn if ``accelerate launch`` started fewer processes than asked (:func:`warn_if_processes_missing`).

    Meant for the end of ``TrainingArguments.__post_init__``, so the refusal comes before a model is loaded
    (the Trainer builds the optimizer only after). A no-op for other optimizers or without DeepSpeed.
    """
    optim = getattr(args.optim, "value", args.optim)
    if not (isinstance(optim, str) and optim.startswith(PREFIX)):
        return
    warn_if_processes_missing()
    if not getattr(args, "deepspeed", None):
        return
    spec = get_spec(optim)
    source = "TrainingArguments.optim_args"
    raw = parse_optim_args(args.optim_args) if isinstance(args.optim_args, str) else dict(args.optim_args or {})
    options = parse_options(spec.name, spec.options, raw, source=source)
    device = "cpu" if getattr(args, "use_cpu", False) else _default_device()
    check_deepspeed(spec.name, options.get("backend"), options, _deepspeed_config(args.deepspeed), device=device)


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
