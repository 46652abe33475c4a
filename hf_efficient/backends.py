"""What each backend brings to a registry entry: how to build its optimizer, how it lays out state, what it costs.

Builders turn param groups + validated hyperparameters and options into an optimizer of one backend; each has the
same keyword signature so the registry can call any of them, and an ``optimizer_cls()`` attribute that imports
(lazily) and returns the class it builds. Layouts convert a backend's per-parameter state to and from the
canonical layout checkpoints hold (:mod:`hf_efficient.checkpoint`). Memory rules predict a backend's state bytes
tensor by tensor (:mod:`hf_efficient.memory`). 8-bit rules say which tensors a backend keeps in 8 bits.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable, Mapping

import torch

from .optim.compensation import LOW_PRECISION
from .optim import quant4
from .optim.facts import Family, codes_bytes, keeps_quantized_state
from .optim.quant8 import BLOCK, dequantize_blockwise, dynamic_map
from .optional import require
from .param_groups import MuonPatterns

logger = logging.getLogger(__name__)

__all__ = ["build_torch_adamw", "class_builder", "bnb_builder", "build_torchao_adamw8bit", "Layout", "bnb_layout", "torchao_layout", "bnb_keeps_8bit",
           "torchao_keeps_8bit", "torch_keeps_8bit", "adamw_memory", "bnb_memory", "torchao_memory",
           "torch_8bit_memory", "adafactor_memory", "adamw_bf16_memory", "torch_adamw_memory", "muon_memory",
           "fp32_momentum_memory"]


def _with_cls(load: Callable[[], type]):
    def deco(fn):
        fn.optimizer_cls = load
        return fn
    return deco


def fused_adamw_supported(device: torch.device, params: Iterable[torch.Tensor]) -> bool:
    """torch ships a fused AdamW kernel for this device type and these dtypes, and it steps these weights right (a
    slice of a larger tensor it would not: :func:`.optim.adamw.fused_takes`)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    from .optim.adamw import fused_takes

    return device.type in _get_fused_kernels_supported_devices() and all(
        p.dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16) and fused_takes(p) for p in params)


def _compensated_adamw_cls():
    from .optim.adamw import AdamW
    return AdamW


@_with_cls(lambda: torch.optim.AdamW)
def build_torch_adamw(groups, *, lr, betas, eps, weight_decay, options, fp32_state_params, device):
    """torch's AdamW; with bf16/fp16 weights, optim/adamw.py's (fp32 moments, the compensated write: torch's would
    keep moments in the weights' dtype and lose every update below half a ulp)."""
    params = [p for g in groups for p in g["params"]]
    if any(p.dtype in LOW_PRECISION for p in params):
        return _compensated_adamw_cls()(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                        compensation=options["compensation"])
    fused = fused_adamw_supported(device, params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             fused=True if fused else None, foreach=None if fused else True)


@lru_cache(maxsize=None)
def _bnb_class(base_name: str) -> type:
    """bitsandbytes' ``bnb.optim.<base_name>`` (any of its 8-bit optimizers) keeping 32-bit state for the parameters
    in ``fp32_state_params``: per optimizer, unlike bnb's process-wide GlobalOptimManager, so two optimizers over
    the same model cannot leak each other's overrides."""
    bnb = require("bitsandbytes", f"bitsandbytes' {base_name} (backend=bnb)")
    base = getattr(bnb.optim, base_name)

    def __init__(self, params, *, fp32_state_params=(), **kwargs):
        self._fp32_ids = {id(p) for p in fp32_state_params}
        base.__init__(self, params, **kwargs)

    def get_config(self, gindex, pindex, group):
        config = base.get_config(self, gindex, pindex, group)
        if id(self.param_groups[gindex]["params"][pindex]) in self._fp32_ids:
            config["optim_bits"] = 32
        return config

    cls = type(base_name, (base,), {"__init__": __init__, "get_config": get_config, "__doc__": _bnb_class.__doc__,
                                    "__module__": __name__})
    cls.__qualname__ = "Bnb" + base_name  # found by pickle: __getattr__ below
    return cls


def bnb_builder(base_name: str, *, uses_eps: bool = True) -> Callable:
    """The builder of bitsandbytes' ``bnb.optim.<base_name>``: betas, weight decay, ``min_8bit_size``, 32-bit state for
    ``fp32_state_params`` (and eps, where the algorithm has one)."""

    @_with_cls(lambda: _bnb_class(base_name))
    def build(groups, *, lr, betas, eps, weight_decay, options, fp32_state_params, device):
        extra = {"eps": eps} if uses_eps else {}
        return _bnb_class(base_name)(groups, lr=lr, betas=betas, weight_decay=weight_decay, **extra,
                                     min_8bit_size=options["min_8bit_size"], fp32_state_params=fp32_state_params)

    build.__name__ = build.__qualname__ = f"build_bnb_{base_name.lower()}"
    return build




TORCHAO_MIN_SIZE = 4096  # torchao quantizes only tensors of at least this many elements


@lru_cache(maxsize=None)
def _torchao_class() -> type:
    optim = require("torchao", "hf_eff_adam8bit with backend=torchao").optim

    class AdamW8bit(optim.AdamW8bit):
        """torchao's 8-bit AdamW keeping full-precision state for ``fp32_state_params`` and small tensors."""

        def __init__(self, params, *, fp32_state_params=(), min_8bit_size=TORCHAO_MIN_SIZE, **kwargs):
            self._fp32_ids = {id(p) for p in fp32_state_params}
            self._min_8bit_size = min_8bit_size
            super().__init__(params, **kwargs)

        def _new_buffer(self, p, signed):
            if id(p) in self._fp32_ids or p.numel() < self._min_8bit_size:
                return torch.zeros_like(p)
            return super()._new_buffer(p, signed)

    AdamW8bit.__qualname__ = "TorchaoAdamW8bit"
    return AdamW8bit


def __getattr__(name: str):
    """The wrapper classes of optional backends, built on first use, by name: so that pickle (a saved optimizer
    object, ``copy.deepcopy``) finds them as ``hf_efficient.backends.<name>`` (``Bnb<bnb class>``,
    ``TorchaoAdamW8bit``)."""
    if name == "TorchaoAdamW8bit":
        return _torchao_class()
    if name.startswith("Bnb") and name[3:].isidentifier():
        return _bnb_class(name[3:])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_torchao_min_size(options: Mapping) -> None:
    if options["min_8bit_size"] < TORCHAO_MIN_SIZE:
        raise ValueError(f"min_8bit_size={options['min_8bit_size']} is below torchao's fixed threshold of "
                         f"{TORCHAO_MIN_SIZE} elements: use backend=bnb for a lower threshold")


@_with_cls(_torchao_class)
def build_torchao_adamw8bit(groups, *, lr, betas, eps, weight_decay, options, fp32_state_params, device):
    _check_torchao_min_size(options)
    optimizer = _torchao_class()(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                 fp32_state_params=fp32_state_params, min_8bit_size=options["min_8bit_size"])
    _say_torchao_full_precision(optimizer)
    return optimizer


def _say_torchao_full_precision(optimizer) -> None:
    """Name the tensors that would keep 8-bit state on the other backends but full-precision state on torchao (its
    rule: whole 256-element blocks only), once per build: they cost 4x the state bytes, and the estimate counts it."""
    from .param_groups import group_names

    keeps = torchao_keeps_8bit(optimizer)
    odd = [name for gi, g in enumerate(optimizer.param_groups) for pi, (name, p) in
           enumerate(zip(group_names(g, gi), g["params"])) if id(p) not in optimizer._fp32_ids
           and p.numel() >= max(optimizer._min_8bit_size, TORCHAO_MIN_SIZE) and not keeps(gi, pi, p)]
    if odd:
        logger.info("hf_eff_adam8bit backend=torchao: %d tensor(s) keep full-precision state, not 8-bit, because "
                    "torchao quantizes only tensors made of whole %d-element blocks (backend=torch or bnb keep them "
                    "8-bit): %s%s", len(odd), BLOCK, ", ".join(odd[:8]), ", ..." if len(odd) > 8 else "")


def compiler_missing(device_type: str) -> str | None:
    """Why our 8-bit kernel cannot be built for ``device_type`` here (on CPU: no C compiler for its C kernel and no
    C++ compiler for torch.compile; on CUDA: no Triton), or None. Without it the kernel runs eagerly, slower
    than bitsandbytes: prefer that then."""
    import importlib.util
    import shutil

    from .optim._native import c_compiler

    if device_type == "cpu":
        found = c_compiler() or any(shutil.which(c) for c in ("g++", "c++", "clang++"))
        return None if found else "needs a C or C++ compiler to build its kernel (none found)"
    if device_type == "cuda":
        return None if importlib.util.find_spec("triton") else "needs Triton to compile its CUDA kernel (not installed)"
    return None


def takes(cls: type) -> set[str]:
    """The keywords ``cls`` (an optimizer class) takes."""
    return set(inspect.signature(cls).parameters)


def class_builder(cls: type) -> Callable:
    """The builder of one of this package's optimizer classes: it passes each value the class takes, by name (its
    keyword-only signature is its hyperparameters): ``lr``, ``betas``, ``eps``, ``weight_decay``,
    ``fp32_state_params`` and the parsed options (``compensation``, ``min_8bit_size``, the family's own)."""
    accepted = takes(cls)

    @_with_cls(lambda: cls)
    def build(groups, *, lr, betas, eps, weight_decay, options, fp32_state_params, device):
        given = dict(options, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                     fp32_state_params=fp32_state_params)
        return cls(groups, **{k: v for k, v in given.items() if k in accepted})

    build.__name__ = build.__qualname__ = f"build_{cls.__name__}"
    return build


# --- state layouts: a backend's per-parameter state <-> the canonical layout -------------------------------------
# Canonical 8-bit state: each moment as uint8 codes of the parameter's shape plus ``<moment>_absmax`` (fp32, one per
# BLOCK elements), or a float tensor where the tensor keeps 32-bit state; ``step`` a float tensor. bitsandbytes and
# torchao use quant8's maps and block size, so converting is relabelling, never requantizing.


@dataclass(frozen=True)
class Layout:
    """How one backend stores a family's per-parameter state, and the conversions to and from the canonical one."""

    library: str  # who writes it, for messages ("bitsandbytes")
    detect: Callable[[dict], bool]  # an untagged per-parameter state is in this layout
    to_canonical: Callable[[dict], dict]
    from_canonical: Callable[[dict, torch.Tensor], dict]  # (canonical state, its parameter) -> the backend's


def _step_as_tensor(step):
    """bnb counts in an int; canonical is a float tensor (anything else: refused by validation)."""
    numeric = isinstance(step, (int, float)) and not isinstance(step, bool)
    return torch.tensor(float(step)) if numeric else step


def bnb_layout(what: str, *moments: tuple[str, bool]) -> Layout:
    """bitsandbytes' blockwise state of ``what`` (``"AdamW"``): ``state<i>`` / ``absmax<i>`` / ``qmap<i>`` hold the
    i-th of ``moments`` ((canonical key, signed), in bnb's order)."""
    idx = range(1, len(moments) + 1)
    known = {"step", "unorm_vec", *(f"{k}{i}" for i in idx for k in ("state", "qmap", "absmax"))}

    def to_canonical(st: dict) -> dict:
        for key in [k for k, v in st.items() if isinstance(v, dict)]:  # bnb nests quantization state for FSDP
            st = {**{k: v for k, v in st.items() if k != key}, **st[key]}
        if "state1" not in st:
            raise ValueError(f"this optimizer state has keys {sorted(st)}, not bitsandbytes' (state1, ...): it was "
                             "written by another optimizer")
        unknown = set(st) - known
        quantized = torch.is_tensor(st["state1"]) and st["state1"].dtype == torch.uint8
        missing = {"step", *(f"state{i}" for i in idx)} | (
            {f"{k}{i}" for i in idx for k in ("absmax", "qmap")} if quantized else set())
        if unknown or missing - set(st):
            raise ValueError(f"bitsandbytes state with keys {sorted(st)}: blockwise {what} state has "
                             f"{sorted(known - {'unorm_vec'})}; "
                             + (f"{sorted(unknown)} belong to another bitsandbytes optimizer or setting, which only "
                                "it can resume" if unknown else
                                f"{sorted(missing - set(st))} missing: the checkpoint is incomplete"))
        out = {"step": _step_as_tensor(st["step"])}
        for i, (key, signed) in zip(idx, moments):
            out[key] = st[f"state{i}"]
            if quantized:
                if not torch.equal(st[f"qmap{i}"].float(), dynamic_map(signed).to(st[f"qmap{i}"].device)):
                    raise ValueError("this bitsandbytes state uses non-standard quantization maps; it can only be "
                                     "resumed with backend=bnb")
                out[f"{key}_absmax"] = st[f"absmax{i}"]
        return out

    def from_canonical(st: dict, p: torch.Tensor) -> dict:
        out = {"step": int(st["step"])}
        for i, (key, signed) in zip(idx, moments):
            out[f"state{i}"] = st[key]
            if f"{key}_absmax" in st:
                out[f"qmap{i}"], out[f"absmax{i}"] = dynamic_map(signed).to(st[key].device), st[f"{key}_absmax"]
        return out

    return Layout("bitsandbytes", lambda st: "state1" in st or any(isinstance(v, dict) for v in st.values()),
                  to_canonical, from_canonical)


def torchao_layout(*moments: tuple[str, bool]) -> Layout:
    """torchao's low-bit state: each of ``moments`` ((key, signed)) an ``OptimState8bit`` (codes + per-block
    ``scale``, its absmax) for tensors it quantizes, else a plain tensor. Read, not written: an ``OptimState4bit``
    (``AdamW4bit``'s; two codes a byte, its own maps) arrives as the fp32 values torchao decodes it to, which the
    loader then quantizes in its own codec (lossy, and its warning says so) or keeps."""

    def to_canonical(st: dict) -> dict:
        out = {k: v for k, v in st.items() if k not in dict(moments)}
        if torch.is_tensor(out.get("step")):
            out["step"] = st["step"].detach().float().reshape(())
        for key, _ in moments:
            v = st.get(key)
            if hasattr(v, "codes") and v.codes.numel() * 2 == math.prod(v.shape):  # 4-bit: two codes a byte
                out[key] = quant4.torchao_values(v)
            elif hasattr(v, "codes"):
                out[key], out[f"{key}_absmax"] = v.codes.clone(), v.scale.clone()
            elif torch.is_tensor(v):
                out[key] = v.detach().clone()
        return out

    def from_canonical(st: dict, p: torch.Tensor) -> dict:
        from torchao.optim.subclass_8bit import OptimState8bit

        out = {"step": st["step"].to(p.device)}
        for key, signed in moments:
            codes = st[key]
            if f"{key}_absmax" not in st:
                out[key] = codes
            elif p.numel() % BLOCK == 0:
                out[key] = OptimState8bit(codes.reshape(p.shape), st[f"{key}_absmax"],
                                          dynamic_map(signed).to(p.device), signed)
            else:  # torchao keeps such tensors in full precision: give it the exact values the codes stand for
                out[key] = dequantize_blockwise(codes, st[f"{key}_absmax"], signed).reshape(p.shape)
        return out

    return Layout("torchao", lambda st: any(hasattr(v, "codes") for v in st.values()), to_canonical, from_canonical)


# --- which tensors a backend keeps in 8 bits: optimizer -> rule(group index, index in group, param) -> bool --------


def bnb_keeps_8bit(optimizer):
    def rule(gi, pi, p):
        config = optimizer.get_config(gi, pi, optimizer.param_groups[gi])
        return config["optim_bits"] == 8 and p.numel() >= config["min_8bit_size"]
    return rule


def torchao_keeps_8bit(optimizer):
    """torchao's _new_buffer: >= 4096 elements in whole blocks, and >= our wrapper's min_8bit_size."""
    def rule(gi, pi, p):
        return (id(p) not in optimizer._fp32_ids and p.numel() >= max(optimizer._min_8bit_size, TORCHAO_MIN_SIZE)
                and p.numel() % optimizer.block_size == 0)
    return rule


def torch_keeps_8bit(optimizer):
    """This package's 8-bit optimizers: their own rule (``Blockwise8bit._has_8bit_state``), so that what memory
    and the estimates count is what the step allocates."""
    def rule(gi, pi, p):
        return optimizer._has_8bit_state(p, optimizer.param_groups[gi])
    return rule


# --- memory rules: predicted state bytes of a list of memory.ParamShape (numel, shape, dtype, embedding, count) ---

_STEP = 4  # torch / torchao / our optimizers keep ``step`` as a float32 scalar tensor per parameter
_QMAP = 256 * 4  # an 8-bit code book: 256 float32 values


def _keeps_32bit(t, opts: Mapping) -> bool:
    """create_optimizer's policy: embedding matrices keep 32-bit state unless ``embedding_state`` is the name's
    quantized state (``8bit``, ``4bit``)."""
    return t.embedding and opts.get("embedding_state") == "32bit"


def adamw_memory(ts, opts: Mapping) -> int:
    """torch.optim.AdamW: exp_avg and exp_avg_sq shaped and typed like the parameter, and a step."""
    return sum(t.count * (2 * t.numel * t.dtype.itemsize + _STEP) for t in ts)


def _kahan_bytes(t, opts: Mapping) -> int:
    """The bf16 ``kahan_comp`` of a bf16/fp16 tensor under compensation=kahan (optim/compensation.py)."""
    return t.count * 2 * t.numel if opts.get("compensation") == "kahan" and t.dtype in LOW_PRECISION else 0


def torch_adamw_memory(ts, opts: Mapping) -> int:
    """build_torch_adamw: torch.optim.AdamW on fp32 weights; on bf16/fp16 ones optim/adamw.py's fp32 moments and,
    under kahan, their bf16 buffer."""
    if not any(t.dtype in LOW_PRECISION for t in ts):
        return adamw_memory(ts, opts)
    return sum(t.count * (8 * t.numel + _STEP) + _kahan_bytes(t, opts) for t in ts)


def bnb_memory(moments: int) -> Callable:
    """bitsandbytes: uint8 ``state<i>`` + float32 ``absmax<i>`` per 256 elements per moment; else float32 state.

    ``step`` is a Python int; the code books are shared by all params, one per moment (after ``load_state_dict``
    each parameter holds its own copies: 1 KB more per moment and 8-bit tensor, measured).
    """
    def rule(ts, opts: Mapping) -> int:
        total, quantized = 0, False
        for t in ts:
            if _keeps_32bit(t, opts) or t.numel < opts["min_8bit_size"]:
                total += t.count * moments * 4 * t.numel
            else:
                total += t.count * moments * (t.numel + 4 * -(-t.numel // BLOCK))
                quantized = True
        return total + (moments * _QMAP if quantized else 0)
    return rule


def torchao_memory(moments: int) -> Callable:
    """torchao: per moment an OptimState8bit (uint8 codes, float32 scale per 256, its own code book) when the
    tensor is >= 4096 elements and a multiple of 256; else a tensor like the parameter. Step: float32."""
    def rule(ts, opts: Mapping) -> int:
        _check_torchao_min_size(opts)  # as build_torchao_adamw8bit refuses it
        total = 0
        for t in ts:
            if _keeps_32bit(t, opts) or t.numel < opts["min_8bit_size"] or t.numel % BLOCK:
                total += t.count * moments * t.numel * t.dtype.itemsize
            else:
                total += t.count * moments * (t.numel + 4 * (t.numel // BLOCK) + _QMAP)
            total += t.count * _STEP
        return total
    return rule


def _torch_keeps_8bit_shape(t, opts: Mapping, codec) -> bool:
    """``Blockwise8bit._has_8bit_state`` on paper: :func:`.optim.facts.keeps_quantized_state` of the whole tensor (an
    FSDP2 row shard, ``t.shard_of``, is judged by the tensor it is a shard of), so that the estimate counts what the
    step allocates."""
    return keeps_quantized_state(t.shard_of or t.shape, codec, sharded=t.shard_of is not None,
                                 min_8bit_size=opts["min_8bit_size"], keep_32bit=_keeps_32bit(t, opts))


def torch_8bit_memory(family: Family, keys=None) -> Callable:
    """This package's quantized optimizers (``family``'s): per moment its codec's codes padded to whole blocks + a
    float32 absmax per block (:func:`.optim.facts.codes_bytes`; an FSDP2 shard of a quantized tensor is whole rows
    of whole blocks: no padding) where :func:`_torch_keeps_8bit_shape` says so; else float32 moments. Step: float32.
    The code books are module constants, not state. bf16/fp16 weights under compensation=kahan: their bf16
    buffer. ``keys``: the quantized keys each tensor holds (default: all of the family's)."""
    moments = [family.state[k].codec for k in (keys or [k for k, _ in family.moments])]

    def rule(ts, opts: Mapping) -> int:
        total = 0
        for t in ts:
            for codec in moments:
                keeps = _torch_keeps_8bit_shape(t, opts, codec)
                total += t.count * (codes_bytes(codec, t.numel) if keeps else 4 * t.numel)
            total += t.count * _STEP + _kahan_bytes(t, opts)
        return total
    return rule


def adafactor_memory(ts, opts: Mapping) -> int:
    """optim/adafactor.py: float32 row + column statistics of a matrix (full exp_avg_sq for vectors),
    float32 exp_avg when beta1 is set, a step; bf16/fp16 weights under compensation=kahan: their bf16 buffer."""
    total = 0
    for t in ts:
        one = 4 * math.prod(t.shape[:-2]) * (t.shape[-2] + t.shape[-1]) if len(t.shape) >= 2 else 4 * t.numel
        if opts.get("beta1") is not None:
            one += 4 * t.numel
        total += t.count * (one + _STEP) + _kahan_bytes(t, opts)
    return total


def adamw_bf16_memory(ts, opts: Mapping) -> int:
    """optim/adamw_bf16.py: exp_avg, exp_avg_sq (and, for bf16/fp16 params with ``compensation=kahan``,
    kahan_comp) shaped and typed like the parameter; a float32 step."""
    return sum(t.count * (2 * t.numel * t.dtype.itemsize + _STEP) + _kahan_bytes(t, opts) for t in ts)


def fp32_momentum_memory(ts, opts: Mapping) -> int:
    """optim/muon.py's Muon matrices: an fp32 ``momentum_buffer`` and a float32 step each; under compensation=kahan
    the bf16 buffer of bf16/fp16 weights."""
    return sum(t.count * (4 * t.numel + _STEP) + _kahan_bytes(t, opts) for t in ts)


def muon_memory(muon_rule: Callable, adamw_rule: Callable) -> Callable:
    """A Muon name's rule: ``muon_rule`` for the tensors Muon steps, ``adamw_rule`` for the rest. Which is which:
    the model's split (``ParamShape.muon``, :func:`.param_groups.split_muon`'s rule), then the options
    ``muon_include`` / ``muon_exclude`` as :func:`.param_groups.split_muon` applies them (and refuses a pattern
    that matches nothing)."""
    def rule(ts, opts: Mapping) -> int:
        patterns = MuonPatterns.parse(opts.get("muon_include"), opts.get("muon_exclude"))
        patterns.check([(t.name, len(t.shape)) for t in ts], "the model")
        said = [patterns.decide(t.name, len(t.shape)) for t in ts]
        takes = [t.muon if s is None else s for t, s in zip(ts, said)]
        return (muon_rule([t for t, m in zip(ts, takes) if m], opts)
                + adamw_rule([t for t, m in zip(ts, takes) if not m], opts))
    return rule
