"""``estimate_memory``: the predicted bytes of any name, ``hf_eff_auto`` included.

The prediction itself is :mod:`hf_efficient.memory`'s (each name's per-tensor rules); ``hf_eff_auto`` picks a name per
model from those predictions (:mod:`hf_efficient.auto`), so its estimate is that of the name it picks. This module
sits above both, so that neither needs the other to answer for every name.
"""

from __future__ import annotations

import torch

from .auto import choose_from
from .memory import MemoryEstimate, describe_params, predict
from .registry import get_spec

__all__ = ["estimate_memory"]


def estimate_memory(model, name: str, *, param_dtype: torch.dtype | str | None = None,
                    device: torch.device | str | None = None, backend: str | None = None,
                    world_size: int | None = None, sharding: str | None = None, **options) -> MemoryEstimate:
    """Predict the bytes of parameters, gradients and optimizer state of ``name`` for ``model``.

    Args:
        model: an ``nn.Module`` (any device, ``meta`` included: nothing is allocated; a transformers config
            becomes one by ``hf_efficient.integrations.transformers.model_from_config``), parameters, or a parameter
            count (shapes then assumed, see :mod:`hf_efficient.memory`).
        name: short or Trainer name; ``"auto"`` predicts what ``hf_eff_auto`` would choose.
        param_dtype: the dtype parameters will have in training (default: as they are; float32 for a count).
        device: where training runs, deciding the backend (default: the model's device; for a count, a config
            or a meta model: ``cuda`` when available, else ``cpu``).
        backend: force a backend, as ``create_optimizer(backend=...)``.
        world_size: predict the bytes of one of ``world_size`` processes, sharding the model as ``sharding``
            says. Default: the model's own (its mesh, where its parameters are FSDP2 DTensors), else one process.
        sharding: how the processes split the model (:data:`~hf_efficient.memory.SHARDINGS`; see
            :mod:`hf_efficient.memory`; None: each holds everything). A name that cannot train under it raises
            :class:`~hf_efficient.memory.UnsupportedSharding` with the reason.
        **options: the options ``create_optimizer`` / ``optim_args`` take (``embedding_state``, ...).

    Example:
        >>> est = estimate_memory(model, "adam8bit")
        >>> print(f"{format_bytes(est.state_bytes)}; this saves {est.saving:.0%} against fp32 AdamW")
    """
    described = describe_params(model, param_dtype, device)
    if world_size is not None or sharding is not None:
        described = described._replace(world_size=1 if world_size is None else world_size, sharding=sharding)
    if not get_spec(name).backends:  # hf_eff_auto picks a name per model: the estimate of the one it picks
        return choose_from(described, dict(options, **({"backend": backend} if backend else {})),
                           "estimate_memory").chosen
    return predict(described.tensors, name, described.device, backend=backend, options=options,
                   assumption=described.assumption, world_size=described.world_size, sharding=described.sharding)
