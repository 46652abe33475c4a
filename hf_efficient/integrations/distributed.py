"""Which optimizer name runs under which distributed set-up (FSDP2, DeepSpeed ZeRO), checked before a model loads.

Both integrations ask here: the Accelerate plugin from ``create_accelerator`` (through
``accelerate.check_distributed_support``) and the Trainer from its ``TrainingArguments``
(:func:`check_training_arguments`). The checks take plain values and config dicts, so this module imports
neither accelerate nor transformers.

Every entry below was observed, not derived: FSDP2 by running each optimizer on torch's ``fully_shard``
DTensor parameters (tests/test_accelerate_distributed.py), DeepSpeed by training each name under ZeRO 1, 2
and 3 in two gloo processes, through the plugin and through the Trainer (tests/test_deepspeed.py).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from ..options import parse_optim_args, parse_options
from ..registry import PREFIX, get_spec, resolve

__all__ = ["FSDP2_UNSUPPORTED", "DEEPSPEED_UNSUPPORTED", "check_fsdp", "check_deepspeed", "check_training_arguments"]

FSDP2_UNSUPPORTED = {
    ("adam8bit", "bnb"): "bitsandbytes' 8-bit kernels have no DTensor sharding rule",
    ("paged_adam8bit", "bnb"): "bitsandbytes' 8-bit kernels have no DTensor sharding rule",
    ("adam8bit", "torch"): "our 8-bit kernels reshape each tensor into 256-element blocks, which a DTensor shard "
                           "does not allow (not run on shards)",
    ("adafactor", "torch"): "its factored row/column statistics are plain tensors that cannot mix with DTensor shards",
    ("adamw_bf16", "torch"): "its step uses ops with no DTensor sharding rule (aten._foreach_copy_)",
}
# torchao's AdamW8bit runs on shards, but is never chosen for a user (see registry.TORCHAO_FLAW).
FSDP2_INSTEAD = (f"use {PREFIX}adamw, or this optimizer with DDP; backend=torchao runs 8-bit state on FSDP2 shards, "
                 "but only when forced, because its AdamW8bit stores small second moments as exactly 0 (a later "
                 "zero gradient then moves a weight by lr * exp_avg / eps, thousands of times too far)")

# ZeRO (stages 1, 2 and 3 alike) hands the optimizer one flat fp32 1-D partition per param group in place of
# the model's parameters: shapes, names and which tensor is an embedding are gone.
DEEPSPEED_UNSUPPORTED = {
    "adafactor": "ZeRO flattens each param group into one 1-D partition, so nothing is left to factor: it trains, "
                 "but keeps a full fp32 second moment (4 bytes per parameter instead of << 1)",
    "adamw_bf16": "ZeRO keeps fp32 master partitions and steps those (with bf16 enabled too), so there are no bf16 "
                  "weights for its compensated update: it trains as plain fp32 AdamW (the same weights as "
                  f"{PREFIX}adamw), without the memory it exists to save",
}
DEEPSPEED_INSTEAD = f"{PREFIX}adamw or {PREFIX}adam8bit (embedding_state=8bit) with DeepSpeed, or this optimizer " \
                    "with DDP / FSDP2"


def _label(name: str, backend: str | None, device) -> str:
    if get_spec(name).name == "auto":
        return f"{PREFIX}auto"
    res = resolve(name, device, backend, log=False)
    return f"{PREFIX}{res.name} (backend={res.backend})"


def _refuse_auto(name: str, where: str) -> None:
    if get_spec(name).name == "auto":
        raise ValueError(f"{PREFIX}auto is not supported with {where}: it sizes unsharded optimizer state, and the "
                         f"names it falls back to after {PREFIX}adamw do not run there as they are. Name the "
                         f"optimizer: {PREFIX}adamw" + (f", or {PREFIX}adam8bit with optim_args embedding_state=8bit"
                                                        if where == "DeepSpeed" else "") + ".")


def check_fsdp(name: str, backend: str | None, *, version: int, device="cpu") -> None:
    """Raise ValueError, saying what to use instead, if ``name``/``backend`` cannot train under FSDP ``version``.

    ``backend=None`` is the registry's automatic choice, which never picks torchao: under FSDP2 that leaves
    no 8-bit backend, so ``adam8bit`` is refused unless ``backend="torchao"`` is forced (which logs why not).
    """
    label = _label(name, backend, device)
    if version != 2:
        raise ValueError(f"{label} with FSDP version {version} is not supported: FSDP1 hands the optimizer "
                         "flattened parameters (no shapes, names or decay groups). Set fsdp_version: 2 in the "
                         "accelerate config (or --fsdp_version 2).")
    _refuse_auto(name, "FSDP2")
    res = resolve(name, device, backend, log=False)
    why = FSDP2_UNSUPPORTED.get((res.name, res.backend))
    if why:
        raise ValueError(f"{label} is not supported with FSDP2: {why}. Instead: {FSDP2_INSTEAD}.")


def check_deepspeed(name: str, backend: str | None, options: Mapping, config: Mapping | None, *, device="cpu",
                    offload: str | None = None, plugin_ga: tuple[int, str] | None = None,
                    config_ga: Any = "auto") -> None:
    """Raise ValueError, saying what to use instead, if ``name`` cannot train under this DeepSpeed config.

    Args:
        name, backend: the optimizer name and forced backend (None: the registry's choice on ``device``).
        options: the name's parsed options (``embedding_state`` decides for 8-bit names).
        config: the DeepSpeed config dict (``optimizer`` and ``zero_optimization.offload_optimizer`` are read).
        offload: accelerate's ``offload_optimizer_device``, when set outside the config.
        plugin_ga, config_ga: the plugin's (gradient_accumulation_steps, its source) and the config's count,
            which must agree when both are numbers.
    """
    config = config or {}
    label = _label(name, backend, device)
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
    _refuse_auto(name, "DeepSpeed")
    res = resolve(name, device, backend, log=False)
    why = DEEPSPEED_UNSUPPORTED.get(res.name)
    if why:
        raise ValueError(f"{label} is not supported with DeepSpeed: {why}. Instead: {DEEPSPEED_INSTEAD}.")
    if res.spec.family == "adamw8bit" and options.get("embedding_state", "32bit") != "8bit":
        raise ValueError(f"{label} with DeepSpeed cannot keep 32-bit state for embeddings and small tensors, as it "
                         "does by default (embedding_state=32bit): ZeRO hands the optimizer one flat partition per "
                         "param group. Set optim_args embedding_state=8bit to accept 8-bit state everywhere (trains "
                         "under ZeRO 1, 2 and 3), or use DDP / FSDP2.")


def check_training_arguments(args) -> None:
    """Refuse ``TrainingArguments`` whose ``hf_eff_*`` optimizer cannot train under their ``deepspeed`` config.

    Meant for the end of ``TrainingArguments.__post_init__``, so the refusal comes before a model is loaded
    (the Trainer builds the optimizer only after). A no-op for other optimizers or without DeepSpeed.
    """
    optim = getattr(args.optim, "value", args.optim)
    if not (isinstance(optim, str) and optim.startswith(PREFIX)) or not getattr(args, "deepspeed", None):
        return
    spec = get_spec(optim)
    source = "TrainingArguments.optim_args"
    raw = parse_optim_args(args.optim_args) if isinstance(args.optim_args, str) else dict(args.optim_args or {})
    options = parse_options(spec.name, spec.options, raw, source=source)
    device = "cpu" if getattr(args, "use_cpu", False) else _default_device()
    check_deepspeed(spec.name, options.get("backend"), options, _deepspeed_config(args.deepspeed), device=device)


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
