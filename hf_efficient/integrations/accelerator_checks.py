"""What an Accelerator's set-up allows, read from its state, and the optimizer kept true after ``prepare``.

The support tables and checks live in integrations/distributed.py (the Trainer asks them too); here they read
an ``accelerator.state``. ``accelerator.prepare`` may wrap the optimizer and replace its parameters (FSDP2:
DTensors in place; DeepSpeed ZeRO: one flat partition per group): the ``fp32`` helpers and
:func:`drop_stale_param_names` keep the optimizer's own bookkeeping consistent with that.
"""

from __future__ import annotations

import os
from typing import Mapping

from ..info import unwrap
from .distributed import check_deepspeed, check_fsdp, warn_if_processes_missing

__all__ = ["check_processes_joined", "check_distributed_support", "choose_backend", "fp32_state_flags",
           "restore_fp32_state_ids", "drop_stale_param_names"]


def check_processes_joined(accelerator) -> None:
    """Raise RuntimeError if the launcher started more processes than Accelerate joined (they would train alone);
    warn if it was asked for more than it started."""
    warn_if_processes_missing()
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and accelerator.num_processes != world:
        # Accelerate joins processes only through a backend it knows for the device: without a GPU, gloo.
        fix = ("under DeepSpeed without a GPU, name the backend: create_accelerator(kwargs_handlers=["
               "InitProcessGroupKwargs(backend='gloo')]) (and DS_ACCELERATOR=cpu)"
               if accelerator.distributed_type.value == "DEEPSPEED" else
               "without a GPU set ACCELERATE_USE_CPU=true (or create_accelerator(cpu=True))")
        raise RuntimeError(
            f"launched as {world} processes (WORLD_SIZE={world}) but Accelerate runs this one as "
            f"{accelerator.num_processes} of {accelerator.distributed_type.value}: the processes would train "
            f"independently. Fix: {fix}.")


def choose_backend(name: str, backend: str | None, options: Mapping, state, device,
                   plugin_ga: tuple[int, str] | None = None) -> tuple[str | None, str]:
    """The backend to force for this distributed set-up (None: leave it to the registry), and why.

    No set-up needs another backend than the registry's: under FSDP2 the only 8-bit backend that runs on
    DTensor shards is torchao, which is never chosen for a user (see ``distributed.FSDP2_INSTEAD``), so
    :func:`check_distributed_support` refuses there instead of switching.
    """
    check_distributed_support(name, backend, options, state, plugin_ga, device=device)
    return backend, ""


def _dist_type(state) -> str:
    t = getattr(state, "distributed_type", "NO")
    return getattr(t, "value", str(t)).upper()


def check_distributed_support(name: str, backend: str | None, options: Mapping, state,
                              plugin_ga: tuple[int, str] | None = None, device="cpu") -> None:
    """Raise ValueError, saying what to use instead, if ``name``/``backend`` cannot run under ``state``.

    Args:
        name: optimizer name; backend: the forced backend, or None for the registry's choice on ``device``.
        options: core options (``embedding_state``, ...); state: ``accelerator.state`` or anything with
            ``distributed_type`` and ``fsdp_plugin`` / ``deepspeed_plugin``.
        plugin_ga: (gradient_accumulation_steps, its source), compared with a DeepSpeed config's.
    """
    dist = _dist_type(state)
    if dist == "FSDP":
        check_fsdp(name, backend, version=getattr(getattr(state, "fsdp_plugin", None), "fsdp_version", 1),
                   device=device, gradient_release=bool(options.get("gradient_release")))
    elif dist == "DEEPSPEED":
        ds = getattr(state, "deepspeed_plugin", None)
        check_deepspeed(name, backend, options, getattr(ds, "deepspeed_config", None), device=device,
                        offload=getattr(ds, "offload_optimizer_device", None), plugin_ga=plugin_ga,
                        config_ga=getattr(ds, "gradient_accumulation_steps", "auto"))


# The optimizer wrappers that keep 32-bit state for chosen parameters know them by id(); FSDP2 preparation
# swaps every parameter for a DTensor in place (same group, same position), so the ids are re-taken after it.
def fp32_state_flags(optimizer) -> list[list[bool]] | None:
    """Per group, per position: does this parameter keep 32-bit state (None: the optimizer does not choose)."""
    ids = getattr(optimizer, "_fp32_ids", None)
    if not ids:
        return None
    return [[id(p) in ids for p in g["params"]] for g in optimizer.param_groups]


def restore_fp32_state_ids(optimizer, flags) -> None:
    """Re-take the 32-bit-state ids from :func:`fp32_state_flags` (taken before ``prepare``) by position."""
    if flags is None:
        return
    inner = unwrap(optimizer, until="_fp32_ids")
    inner._fp32_ids = {id(p) for g, fl in zip(inner.param_groups, flags) for p, keep in zip(g["params"], fl) if keep}


def drop_stale_param_names(optimizer) -> None:
    """Forget ``param_names`` of groups whose parameters a wrapper replaced (DeepSpeed ZeRO: one flat partition
    per group). They no longer name the group's tensors, and a checkpoint matched by them would be refused as
    corrupt; without them it is matched by position, as torch does."""
    inner = unwrap(optimizer, until=None)
    for g in inner.param_groups:
        if len(g.get("param_names", g["params"])) != len(g["params"]):
            del g["param_names"]
