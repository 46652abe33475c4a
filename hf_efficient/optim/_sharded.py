"""The one place that knows DTensor: what every family needs to step FSDP2's sharded parameters.

torch's ``fully_shard`` (FSDP2) swaps each parameter for a DTensor whose local tensor is this rank's shard; its
gradient arrives reduce-scattered, placed the same way. A family steps the local tensors (:func:`local`) with its
ordinary kernels, keeps its state as DTensors placed like the parameter (:func:`zeros`), so that
``torch.distributed.checkpoint`` saves, loads and reshards it, and sums across the shard group (:func:`sum_across`)
whatever its math needs of the whole tensor (Adafactor's column statistics and RMS clip). Decisions that must not
change with the mesh (8-bit or not, block layout, rounding noise) read :func:`global_shape` and
:func:`global_offset`, never the local shard.

Supported placements: ``Shard(0)`` on a 1-D mesh (what ``fully_shard`` makes), even or uneven (torch's chunking:
the last ranks may hold fewer rows, or none). The local shard is then a contiguous range of whole rows (of dim 0)
of the row-major global tensor. Any other placement (a 2-D HSDP or tensor-parallel mesh, ``Shard(1)``,
``Replicate``, ``Partial``) is refused by :func:`check` with a message saying what is served.

A step of sharded tensors is collective: every rank must step the same parameters in the same order, as FSDP2's
reduce-scatter gives every rank a gradient for the same parameters (:func:`check_grads_agree` refuses a gradient set
on some ranks only, before anything steps).
"""

from __future__ import annotations

import itertools
import math
import sys

import torch
from torch import Tensor

__all__ = ["SUPPORTED", "is_sharded", "check", "check_placements", "check_grads_agree", "sharded_by_rows", "local", "global_shape",
           "global_numel", "global_offset", "zeros", "like", "whole", "shard_like", "replicate_like", "to_local_state",
           "sum_across"]

SUPPORTED = "Shard(0) on a 1-D device mesh (torch's fully_shard)"


def is_sharded(t) -> bool:
    """Whether ``t`` is a DTensor (no DTensor can exist before torch's module defining it is imported: a cheap
    check that does not import it)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def check(p, owner: str, name: str = "a parameter") -> None:
    """Raise ValueError unless ``p`` is a plain tensor or a DTensor placed as this module supports (its gradient,
    where it has one, placed like it), saying what is served; called before anything changes."""
    if not is_sharded(p):
        return
    from torch.distributed.tensor import Shard

    mesh, placements = p.device_mesh, tuple(p.placements)
    if mesh.ndim != 1 or placements != (Shard(0),):
        raise ValueError(f"{owner}: {name} of shape {tuple(p.shape)} is a DTensor placed {list(placements)} on a "
                         f"{mesh.ndim}-D mesh of shape {tuple(mesh.shape)}; sharded parameters are served only as "
                         f"{SUPPORTED}. Shard the model with fully_shard on a 1-D mesh (no HSDP or tensor "
                         "parallelism), or use hf_eff_adamw, which steps any placement")
    grad = p.grad
    if grad is not None and (not is_sharded(grad) or tuple(grad.placements) != placements):
        where = list(grad.placements) if is_sharded(grad) else "a plain tensor"
        raise ValueError(f"{owner}: the gradient of {name} is {where}, its parameter {list(placements)}: FSDP2 "
                         "gives a gradient placed like its parameter; one set otherwise cannot be stepped shard by "
                         "shard")


def check_placements(param_groups, owner: str) -> None:
    """:func:`check` on every parameter with a gradient, before a step makes any state: FSDP2 swaps parameters in
    after the optimizer is built, so a step sees their placements first."""
    for gi, group in enumerate(param_groups):
        for i, p in enumerate(group["params"]):
            if p.grad is not None:
                check(p, owner, f"parameter {i} of param group {gi}")


def sharded_by_rows(t) -> bool:
    """Whether ``t`` is a DTensor sharded along dim 0 (each rank a range of its rows)."""
    if not is_sharded(t):
        return False
    from torch.distributed.tensor import Shard

    return all(pl == Shard(0) for pl in t.placements)


def check_grads_agree(groups: list[dict], owner: str) -> None:
    """Raise ValueError, on every rank alike, unless each sharded parameter of ``groups`` (an optimizer's param
    groups, alike on every rank) has a gradient on all ranks of its shard group or on none. A step of shards is
    collective (the module docstring): a shard stepped on some ranks only would leave the ranks' states apart, and a
    family that sums across ranks would enter a collective the others do not. FSDP2 gives every rank a gradient for
    the same parameters; only a gradient set or dropped by hand on some ranks differs. Called before anything
    changes: one all-reduce of an int32 per sharded parameter, read on the host, per mesh; nothing without shards."""
    module = sys.modules.get("torch.distributed.tensor")
    types = set(map(type, itertools.chain.from_iterable(g["params"] for g in groups))) if module else ()
    if not any(issubclass(t, module.DTensor) for t in types):
        return  # no shards: the parameters' distinct types (mostly one) tell it, not an isinstance per parameter
    meshes: dict = {}
    for gi, g in enumerate(groups):
        for i, p in enumerate(g["params"]):
            if is_sharded(p):
                meshes.setdefault(p.device_mesh, []).append((gi, i, p))
    import torch.distributed as dist

    for mesh, items in meshes.items():
        group = mesh.get_group()
        world = dist.get_world_size(group)
        if world <= 1:
            continue
        device = local(items[0][2]).device  # the mesh's: a CUDA tensor for NCCL
        counts = torch.tensor([p.grad is not None for *_, p in items], dtype=torch.int32, device=device)
        dist.all_reduce(counts, group=group)
        for (gi, i, _), count in zip(items, counts.tolist()):
            if 0 < count < world:
                from ..param_groups import group_names

                name = group_names(groups[gi], gi)[i]
                raise ValueError(f"{owner}: parameter {name!r} (an FSDP2 shard) has a gradient on {count} of the "
                                 f"{world} ranks and None on the others, and a step of shards must step the same "
                                 "tensors on every rank (FSDP2 gives each rank a gradient for every parameter that "
                                 "had one). Set its gradient on every rank (zeros where a rank has none) or on none. "
                                 "Nothing was stepped")


def local(t):
    """This rank's shard of ``t`` (a view: writing it writes the DTensor), or ``t`` itself if it is plain."""
    return t.to_local() if is_sharded(t) else t


def global_shape(t) -> torch.Size:
    """The shape of the whole tensor (a DTensor's ``shape`` is already global; named so that callers say so)."""
    return t.shape


def global_numel(t) -> int:
    return math.prod(global_shape(t))


def global_offset(p) -> int:
    """Row-major index, in the whole tensor, of the first element of this rank's shard (0 for a plain tensor): what
    numbers each element's stochastic-rounding noise, so that 1, 2 and 4 ranks round alike."""
    if not is_sharded(p):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return offset[0] * math.prod(p.shape[1:])  # Shard(0): whole rows, contiguous (see check)


def zeros(p, shape, dtype: torch.dtype, *, replicate: bool = False):
    """A zero state tensor of global ``shape`` for parameter ``p``: plain where ``p`` is plain, else a DTensor on
    ``p``'s mesh, sharded like ``p`` along dim 0 (``shape`` must share ``p``'s dim 0: row statistics, moments) or,
    with ``replicate``, whole on every rank (statistics every shard needs, such as Adafactor's column means)."""
    device = local(p).device
    if not is_sharded(p):
        return torch.zeros(shape, dtype=dtype, device=device)
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = torch.Size(shape)
    placements = (Replicate(),) if replicate else tuple(p.placements)
    local_shape, _ = compute_local_shape_and_global_offset(shape, p.device_mesh, placements)
    # shape and stride given: from_local would otherwise take the shards as even and get an uneven tensor's shape wrong
    return DTensor.from_local(torch.zeros(local_shape, dtype=dtype, device=device), p.device_mesh, placements,
                              run_check=False, shape=shape, stride=_contiguous_strides(shape))


def like(t, local_tensor: Tensor):
    """A DTensor of ``t``'s shape, mesh and placements whose shard on this rank is ``local_tensor`` (of ``t``'s
    local shape): a state tensor converted shard by shard (a layout change within each shard)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local_tensor, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                              stride=t.stride())


def whole(t):
    """The whole tensor of a DTensor (a collective: every rank of its mesh calls it, in the same order), or ``t``
    itself if it is plain."""
    return t.full_tensor() if is_sharded(t) else t


def shard_like(p, t: Tensor):
    """``t``, a whole tensor whose dim 0 is ``p``'s rows, as a DTensor placed like ``p`` (this rank's rows of it, a
    copy); ``t`` itself where ``p`` is plain. What a state converted whole (re-quantized) is put back as."""
    if not is_sharded(p):
        return t
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(t.shape, p.device_mesh, p.placements)
    rows = t[offset[0]:offset[0] + local_shape[0]].to(local(p).device).contiguous().clone()
    return DTensor.from_local(rows, p.device_mesh, p.placements, run_check=False, shape=t.shape,
                              stride=_contiguous_strides(t.shape))


def replicate_like(p, t: Tensor):
    """``t``, a whole tensor, as a DTensor on ``p``'s mesh, whole on every rank (a copy); ``t`` itself where ``p`` is
    plain. What a whole statistic every shard needs (a matrix's column statistics) is put back as."""
    if not is_sharded(p):
        return t
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(t.to(local(p).device).contiguous().clone(), p.device_mesh, (Replicate(),),
                              run_check=False, shape=t.shape, stride=_contiguous_strides(t.shape))


def to_local_state(state: dict) -> dict:
    """``state`` with every DTensor replaced by its local tensor (views: kernels that write them write the state)."""
    return {k: local(v) for k, v in state.items()}


def sum_across(tensors: list[Tensor], p) -> None:
    """Sum each of ``tensors`` (local partial sums, any float dtypes) over ``p``'s shard group, in place, in one
    all-reduce (in float64, so that the order of ranks costs no precision). Every rank must call it with tensors of
    the same sizes, in the same order; nothing happens for a plain ``p``."""
    if not is_sharded(p) or not tensors:
        return
    import torch.distributed as dist

    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=p.device_mesh.get_group())
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view(t.shape))


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
