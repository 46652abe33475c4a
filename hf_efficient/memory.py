"""Optimizer memory: bytes measured in a live optimizer, and bytes predicted before one exists.

Measured (:func:`optimizer_state_bytes`): every tensor reachable from ``optimizer.state`` -- quantization
maps and block scales included, the inner tensors of tensor subclasses (torchao's ``OptimState8bit``,
DTensor) included, a storage shared by several entries (bitsandbytes' ``qmap1``/``qmap2``) counted once.

Predicted (:func:`predict`, behind :func:`hf_efficient.estimate_memory`): the same count done on paper, tensor by
tensor, by the rule of the backend the registry picks for the device (``Backend.memory``, written in backends.py) -- so 8-bit keeps
32-bit state for embeddings and tensors below
``min_8bit_size`` exactly where the optimizer will, Adafactor stores row + column statistics of each
matrix, and ``adamw_bf16`` keeps bf16 buffers. Sizes are binary: ``MB`` here is 2**20 bytes, one MiB (the
unit torch and nvidia-smi report in), and every message says MiB or GiB (:func:`format_bytes`).

Without tensor shapes (``estimate_memory(65_783_042, ...)``) the count assumes the parameters are
2-D matrices of :data:`ASSUMED_COLUMNS` columns cut into tensors of at most 2**20 elements, none an
embedding and none below ``min_8bit_size``; the result says so in ``assumption``.

Per rank (``world_size=N``, ``sharding=``): what one of N processes holds. ``"fsdp2"`` (torch's ``fully_shard``)
shards every parameter, its gradient and its state by rows (``Shard(0)``): a rank holds at most ``ceil(rows / N)``
rows of each, so the per-rank bytes are those of the largest shard, by the same rule (Adafactor's column statistics
of a matrix stay whole on every rank). ``"zero1"`` / ``"zero2"`` / ``"zero3"`` (DeepSpeed) partition the optimizer
state flat: the optimizer steps one fp32 vector of ``ceil(trainable elements / N)`` elements per rank, so a factored
or per-tensor rule sees one 1-D tensor (DeepSpeed's per-group partitions and alignment padding are not counted);
ZeRO-2 also partitions gradients, ZeRO-3 parameters too. ``sharding=None`` with N ranks is DDP: every rank holds
everything. A parameter that is already a DTensor (a model sharded by ``fully_shard``) is described by its global
shape, and its mesh sets ``world_size`` and ``"fsdp2"``.

To compare several names on one model (``hf_eff_auto`` does), describe it once (:func:`describe_params`) and
:func:`predict` each name. ``hf_eff_auto``, which picks another name per model, is estimated by
:mod:`hf_efficient.estimate`, above this module and :mod:`hf_efficient.auto`.
"""

from __future__ import annotations

import logging
import dataclasses
import math
import resource
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple

import torch
from torch import nn

from .backends import adamw_memory
from .info import unwrap
from .optim.compensation import LOW_PRECISION
from .options import parse_options
from .param_groups import split_muon, split_parameters
from .registry import PREFIX, compensation_of, get_spec, resolve
from .release import BUCKET_BYTES

__all__ = ["MB", "format_bytes", "optimizer_state_bytes", "state_metrics", "MemoryEstimate",
           "peak_memory", "ASSUMED_COLUMNS", "MAX_PARAMS", "ParamShape", "Described",
           "describe_params", "predict", "SHARDINGS", "UnsupportedSharding"]

logger = logging.getLogger(__name__)

MB = 2**20  # one MiB: the name is kept for the keys that carry it (state_mb, hf_eff/optimizer_state_mb)
ASSUMED_COLUMNS = 1024  # --params N: N elements as matrices of this many columns, 2**20 elements per tensor
_ASSUMED_TENSOR = ASSUMED_COLUMNS**2
MAX_PARAMS = 10**15  # a bare count above this is a typo (500x the largest models), refused before any arithmetic
SHARDINGS = (None, "fsdp2", "zero1", "zero2", "zero3")  # what estimate_memory(sharding=...) counts per rank


class UnsupportedSharding(ValueError):
    """A name asked for per rank under a sharding it cannot train under (the reason is the registry's)."""


def format_bytes(n: float) -> str:
    """``n`` bytes for a message: GiB from one GiB up, else MiB (binary units, as torch and nvidia-smi count)."""
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / MB:,.1f} MiB"


# ---------------------------------------------------------------------------------------------- measured

def optimizer_state_bytes(optimizer, by: str | None = None) -> int | dict[str, int]:
    """Bytes held by the tensors in ``optimizer.state``; each storage once. A DTensor state (FSDP2) counts its
    local tensor: the bytes this rank holds.

    Args:
        optimizer: any torch optimizer (also Accelerate's or Trainer's wrapper of one).
        by: None for the total; ``"key"`` (state key, e.g. ``exp_avg``), ``"dtype"`` (``"uint8"``, ...) or
            ``"device"`` for a breakdown. A storage shared by two keys is attributed to the first one seen.

    Returns:
        The total in bytes, or a dict of bytes per key / dtype / device.
    """
    if by not in (None, "key", "dtype", "device"):
        raise ValueError(f"by={by!r}: use None (total), 'key', 'dtype' or 'device'")
    optimizer = unwrap(optimizer, until="state")
    seen: set = set()
    out: dict[str, int] = {}
    for per_param in optimizer.state.values():
        items = per_param.items() if isinstance(per_param, Mapping) else [("", per_param)]
        for key, value in items:
            for t in _leaf_tensors(value):
                storage = t.untyped_storage()
                ident = (t.device, storage.data_ptr()) if storage.data_ptr() else ("id", id(storage))
                if ident in seen:
                    continue
                seen.add(ident)
                label = {None: "total", "key": str(key), "dtype": _dtype_name(t.dtype), "device": str(t.device)}[by]
                out[label] = out.get(label, 0) + storage.nbytes()
    return out.get("total", 0) if by is None else out


def state_metrics(optimizer) -> dict[str, float] | None:
    """Measured state MB, fp32 AdamW's MB for the same parameters, and the saving; None while state is empty.

    Only parameters that have state are compared, so a step that skipped some parameters compares like
    with like. Under FSDP2 both are this rank's (its shards).
    """
    measured = optimizer_state_bytes(optimizer)
    if not measured:
        return None
    with_state = {id(p): p for g in optimizer.param_groups for p in g["params"] if optimizer.state.get(p)}
    local = [p.to_local() if hasattr(p, "to_local") else p for p in with_state.values()]  # per rank, as measured
    baseline = adamw_memory([ParamShape(p.numel(), tuple(p.shape), torch.float32) for p in local], {})
    return {"optimizer_state_mb": measured / MB, "fp32_adamw_state_mb": baseline / MB,
            "optimizer_state_saving": 1.0 - measured / baseline if baseline else 0.0}


def _leaf_tensors(value) -> Iterable[torch.Tensor]:
    """Plain tensors inside ``value``: through containers and tensor subclasses' ``__tensor_flatten__``."""
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            for name in names:
                yield from _leaf_tensors(getattr(value, name))
        else:
            yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _leaf_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaf_tensors(v)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def peak_memory(device: torch.device | str) -> tuple[str, int]:
    """(what, bytes): the peak allocated memory of an accelerator, or this process' peak RSS on CPU."""
    device = torch.device(device)
    backend = getattr(torch, device.type, None)
    if device.type != "cpu" and hasattr(backend, "max_memory_allocated") and backend.is_available():
        return f"peak_{device.type}_allocated", int(backend.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return "peak_rss", int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB, macOS bytes


# --------------------------------------------------------------------------------------------- predicted

@dataclass(frozen=True)
class ParamShape:
    """What the memory rules need of one parameter: size, shape, dtype, whether it is an embedding matrix, whether
    it trains, and how many parameters are alike (``count``: a bare count's identical matrices are one entry, not
    millions); its name and whether Muon's split gives it to Muon by default (the Muon names' rule applies
    ``muon_include`` / ``muon_exclude`` to them)."""

    numel: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    embedding: bool = False
    trainable: bool = True
    count: int = 1
    shard_of: tuple[int, ...] | None = None  # an FSDP2 row shard of a tensor of this global shape (None: whole)
    name: str = ""
    muon: bool = False  # param_groups.split_muon's rule gives it to Muon

    @property
    def elements(self) -> int:
        return self.numel * self.count


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes of one optimizer name for one model, before any step."""

    name: str  # Trainer name that runs (paged_adam8bit off CUDA runs as hf_eff_adam8bit)
    backend: str
    device: str
    num_params: int  # trainable parameters (the ones the optimizer holds)
    param_dtype: str
    param_bytes: int  # all parameters, frozen ones included; buffers not counted
    grad_bytes: int
    state_bytes: int
    fp32_adamw_state_bytes: int  # the baseline: torch AdamW with fp32 state for the same parameters
    options: dict[str, Any] = field(default_factory=dict)
    assumption: str | None = None  # set when shapes were assumed (a bare parameter count)
    reason: str = ""  # why this backend (the registry's resolution)
    world_size: int = 1  # the bytes are those of one of world_size processes
    sharding: str | None = None  # how they split the model (SHARDINGS; None: each holds everything)

    @property
    def state_bytes_per_param(self) -> float:
        return self.state_bytes / max(self.num_params, 1)

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.state_bytes

    @property
    def total_bytes_per_param(self) -> float:
        """Weights + gradients + optimizer state per trainable parameter (fp32 AdamW: 16; bf16 weights with 8-bit
        state and stochastic rounding: ~6)."""
        return self.total_bytes / max(self.num_params, 1)

    @property
    def saving(self) -> float:
        """Fraction of fp32 AdamW's state bytes saved (0.75: a quarter of its memory)."""
        return 1.0 - self.state_bytes / self.fp32_adamw_state_bytes if self.fp32_adamw_state_bytes else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(state_bytes_per_param=self.state_bytes_per_param, total_bytes=self.total_bytes, saving=self.saving,
                 state_mb=self.state_bytes / MB, total_bytes_per_param=self.total_bytes_per_param)
        return d


def predict(tensors: list[ParamShape], name: str, device: torch.device, *, backend: str | None = None,
            options: Mapping[str, Any] | None = None, assumption: str | None = None, world_size: int = 1,
            sharding: str | None = None) -> MemoryEstimate:
    """The prediction of :func:`~hf_efficient.estimate_memory` for parameters already described
    (:func:`describe_params`): the bytes of ``name`` on ``device`` by the rule of the backend the registry picks
    there, per rank of ``world_size`` under ``sharding``. For callers that compare several names on one model
    (``hf_eff_auto``) without describing it again for each."""
    world_size = _check_world(world_size, sharding)
    spec = get_spec(name)
    given = dict(options or {}, **({"backend": backend} if backend else {}))
    opts = parse_options(spec.name, spec.accepted, given, source="estimate_memory")
    opts["compensation"] = compensation_of(spec, opts["compensation"])
    low = any(t.dtype in LOW_PRECISION for t in tensors if t.trainable)
    res = resolve(spec.name, device, opts["backend"], log=False, compensated=low and opts["compensation"] != "none")
    if res.spec is not spec:  # a fallback (paged off CUDA): the options belong to the name that runs
        opts = parse_options(res.spec.name, res.spec.accepted, {k: v for k, v in opts.items() if k in res.spec.options},
                             source="estimate_memory")
    sharding = sharding if world_size > 1 or sharding == "fsdp2" else None  # ZeRO on one rank: nothing split
    _check_runs_sharded(res, sharding)
    rule = res.implementation.memory  # the backend's rule, in the registry
    train = [t for t in tensors if t.trainable]
    dtypes = {_dtype_name(t.dtype) for t in train}
    held, stepped = _per_rank(tensors, world_size, sharding), _state_view(train, world_size, sharding)
    grads = [t for t in (held if sharding in ("fsdp2", "zero2", "zero3") else tensors) if t.trainable]
    grad_bytes = _bytes(grads, world_size, sharding in ("zero2", "zero3"))
    if opts.get("gradient_release") and sharding is None:  # released: the gradients in flight (release.py)
        grad_bytes = min(grad_bytes, released_grad_bytes(grads))
    return MemoryEstimate(
        name=PREFIX + res.name, backend=res.backend, device=device.type, num_params=sum(t.elements for t in train),
        param_dtype=dtypes.pop() if len(dtypes) == 1 else "mixed",
        param_bytes=_bytes(held if sharding in ("fsdp2", "zero3") else tensors, world_size, sharding == "zero3"),
        grad_bytes=grad_bytes,
        state_bytes=rule(stepped, opts), fp32_adamw_state_bytes=adamw_memory([_as_fp32(t) for t in stepped], {}),
        options={k: v for k, v in opts.items() if k != "backend"}, assumption=assumption, reason=res.reason,
        world_size=world_size, sharding=sharding)


def released_grad_bytes(grads: list[ParamShape]) -> int:
    """The most gradient bytes alive under gradient release: a bucket of gradients waiting for their step
    (:data:`.release.BUCKET_BYTES`) and the tensor being completed, at most the largest (measured so:
    docs/results/memory_release.md)."""
    return BUCKET_BYTES + max((t.numel * t.dtype.itemsize for t in grads), default=0)


def _check_world(world_size, sharding) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: the number of processes, an integer >= 1")
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding={sharding!r}: use one of {', '.join(map(repr, SHARDINGS))} (None: every rank "
                         "holds everything, as DDP)")
    return world_size


def _check_runs_sharded(res, sharding: str | None) -> None:
    """Refuse a per-rank prediction for a set-up the resolved name cannot train under (the registry's reason)."""
    label = f"{PREFIX}{res.name} (backend={res.backend})"
    if sharding == "fsdp2" and res.implementation.fsdp2:
        raise UnsupportedSharding(f"{label} does not step FSDP2 shards: {res.implementation.fsdp2}")
    if sharding in ("zero1", "zero2", "zero3") and res.spec.facts.deepspeed:
        raise UnsupportedSharding(f"{label} does not train under DeepSpeed ZeRO: {res.spec.facts.deepspeed}")


def _shard_rows(t: ParamShape, world_size: int) -> ParamShape:
    """FSDP2's largest shard of ``t``: ``ceil(rows / world_size)`` rows (torch.chunk's split; rank 0 holds it)."""
    if not t.shape:
        return t
    rows = -(-t.shape[0] // world_size)
    shape = (rows, *t.shape[1:])
    return dataclasses.replace(t, numel=math.prod(shape), shape=shape, shard_of=t.shard_of or t.shape)


def _per_rank(tensors: list[ParamShape], world_size: int, sharding: str | None) -> list[ParamShape]:
    """The tensors one rank holds: FSDP2's largest shard of each; otherwise the tensors (ZeRO's flat partitions
    are counted by :func:`_bytes`)."""
    return [_shard_rows(t, world_size) for t in tensors] if sharding == "fsdp2" else tensors


def _state_view(train: list[ParamShape], world_size: int, sharding: str | None) -> list[ParamShape]:
    """What the optimizer steps on one rank: FSDP2's row shards, ZeRO's one flat fp32 partition, else the
    parameters."""
    if sharding is None or (world_size == 1 and sharding != "fsdp2"):  # FSDP2 on one rank still steps shards
        return train
    if sharding == "fsdp2":
        return _per_rank(train, world_size, sharding)
    n = -(-sum(t.elements for t in train) // world_size)
    return [ParamShape(n, (n,), torch.float32)]


def _bytes(tensors: list[ParamShape], world_size: int, flat: bool) -> int:
    """Bytes of ``tensors``; ``flat``: a ZeRO partition of them (each dtype's bytes over ``world_size``, rounded up)."""
    if not flat:
        return sum(t.elements * t.dtype.itemsize for t in tensors)
    by_dtype: dict[torch.dtype, int] = {}
    for t in tensors:
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.elements
    return sum(-(-n // world_size) * d.itemsize for d, n in by_dtype.items())


def _as_fp32(t: ParamShape) -> ParamShape:
    return dataclasses.replace(t, dtype=torch.float32)


class Described(NamedTuple):
    """A model as the predictions see it (:func:`describe_params`)."""

    tensors: list[ParamShape]
    assumption: str | None  # the shapes assumed for a bare parameter count, else None
    device: torch.device  # where training runs: the one asked for, else the model's (see estimate_memory)
    resident: bool  # the parameters already occupy that memory, as they will train (their bytes are not needed anew)
    world_size: int = 1  # processes sharing the model (an FSDP2 model's mesh size; else 1)
    sharding: str | None = None  # "fsdp2" for a model whose parameters are DTensors (SHARDINGS)


def describe_params(model, param_dtype: torch.dtype | str | None = None,
                    device: torch.device | str | None = None) -> Described:
    """``model`` (anything :func:`~hf_efficient.estimate_memory` takes) as one :class:`ParamShape` per parameter, for
    :func:`predict`; ``param_dtype`` and ``device`` as :func:`~hf_efficient.estimate_memory` takes them."""
    tensors, assumption, model_device, resident, mesh = _read_params(model, param_dtype)
    dev = torch.device(device) if device is not None else model_device
    return Described(tensors, assumption, dev, resident and dev == model_device and param_dtype is None,
                     mesh or 1, "fsdp2" if mesh else None)


def _read_params(model, param_dtype) -> tuple[list[ParamShape], str | None, torch.device, bool, int]:
    """``model``'s parameters (global shapes), the shape assumption made (if any), its device, whether the
    parameters really occupy that device (False for a count or a meta model), and the size of the mesh its
    DTensor parameters are sharded over (0: none; 1: a mesh of one rank, whose optimizer still steps shards and
    decides 8-bit state as under any mesh)."""
    dtype = _as_dtype(param_dtype)
    default_dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(model, bool) or (isinstance(model, float) and not model.is_integer()):
        raise TypeError(f"model={model!r}: pass a module, parameters or an integer parameter count")
    if isinstance(model, str):
        raise TypeError(f"model={model!r} is a string: estimate_memory takes a module, its parameters or a parameter "
                        f"count. For a hub name or a directory with config.json run "
                        f"`hf-efficient estimate {model}`, or pass "
                        f"model_from_config(AutoConfig.from_pretrained({model!r})) "
                        "(hf_efficient.integrations.transformers)")
    if isinstance(model, (int, float)):
        n = int(model)
        if n <= 0 or n > MAX_PARAMS:
            raise ValueError(f"a parameter count must be positive and at most {MAX_PARAMS:.0e} (the largest models "
                             f"have ~2e12), got {model!r}: check the number")
        full, rest = divmod(n, _ASSUMED_TENSOR)
        tensors = [ParamShape(s, (-(-s // ASSUMED_COLUMNS), ASSUMED_COLUMNS), dtype or torch.float32, count=c,
                              muon=True) for s, c in ((_ASSUMED_TENSOR, full), (rest, 1)) if s and c]
        assumption = (f"{n:,} parameters counted as 2-D matrices of {ASSUMED_COLUMNS} columns, "
                      f"{full + bool(rest):,} tensors of <= {_ASSUMED_TENSOR:,} elements; no embeddings, none small "
                      "(Muon: every one a hidden matrix)")
        return tensors, assumption, default_dev, False, 0
    if hasattr(model, "to_dict") and hasattr(model, "model_type") and not isinstance(model, nn.Module):
        raise TypeError(f"model is a transformers config ({type(model).__name__}): the core builds no transformers "
                        "model. Pass the model it describes, built on the meta device (no memory): "
                        "from hf_efficient.integrations.transformers import model_from_config; "
                        "estimate_memory(model_from_config(config), ...)")
    if isinstance(model, nn.Module):
        split = split_parameters(model)
        embeddings, muon = set(split.embeddings), set(split_muon(model, decay=split).muon)
        params = dict(model.named_parameters())
        tensors = [ParamShape(p.numel(), tuple(p.shape), dtype or p.dtype, n in embeddings, n in split.params,
                              name=n, muon=n in muon) for n, p in params.items()]
        devices = {p.device for p in params.values()}
    else:
        items = list(model)
        groups = items if items and isinstance(items[0], dict) else [{"params": items}]
        named = [(name, p, bool(g.get("muon"))) for gi, g in enumerate(groups) for name, p in zip(
            _names_of(g, gi), [g["params"]] if torch.is_tensor(g["params"]) else g["params"])]
        params = [p[1] if isinstance(p, tuple) else p for _, p, _ in named]
        tensors = [ParamShape(p.numel(), tuple(p.shape), dtype or p.dtype, name=name, muon=muon)
                   for (name, _, muon), p in zip(named, params)]
        devices = {p.device for p in params}
    if not tensors:
        raise ValueError(f"{type(model).__name__} has no parameters to estimate")
    mesh = max((p.device_mesh.size() for p in (params.values() if isinstance(params, dict) else params)
                if hasattr(p, "device_mesh")), default=0)
    if len(devices) != 1 or (dev := devices.pop()).type == "meta":
        return tensors, None, default_dev, False, mesh
    return tensors, None, dev, True, mesh


def _names_of(group: dict, gi: int) -> list[str]:
    """Names of a group's parameters for the estimate: its ``param_names``, a ``named_parameters()`` pair's name, or
    ``group{gi}.param{i}``; a group's ``"muon"`` flag (:func:`.param_groups.build_muon_param_groups`) gives its
    parameters to Muon."""
    params = [group["params"]] if torch.is_tensor(group["params"]) else list(group["params"])
    given = group.get("param_names") or [None] * len(params)
    return [n or (p[0] if isinstance(p, tuple) else f"group{gi}.param{i}")
            for i, (n, p) in enumerate(zip(given, params))]


def _as_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16}
    if str(dtype).removeprefix("torch.") not in names:
        raise ValueError(f"param_dtype={dtype!r}: use one of {', '.join(names)} or a torch.dtype")
    return names[str(dtype).removeprefix("torch.")]
