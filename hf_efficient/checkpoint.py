"""Optimizer state dicts that say what wrote them, load only where they fit, and move between formats.

Every optimizer made by :func:`hf_efficient.create_optimizer` writes a tag (``state_dict()["hf_efficient"]``)
naming its optimizer family and backend. Loading checks everything *before* anything is changed (groups and
their hyperparameters, parameter names, and per parameter the state keys its layout requires, their value
types, dtypes and sizes), so a wrong checkpoint is refused, never half-loaded.

8-bit state is written in one canonical layout, whichever backend made it: ``exp_avg`` / ``exp_avg_sq``
as uint8 codes of the parameter's shape plus ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` (fp32, one per
256-element block), or fp32 tensors for parameters with 32-bit state. bitsandbytes and torchao use the
same dynamic quantization maps and block size (checked below), so the conversion is a relabelling, not a
requantization: a bnb checkpoint resumes on torchao or this package's kernel exactly, and back. Every
tensor in it is a plain tensor, so ``torch.load(..., weights_only=True)`` works (torchao's own state
holds tensor subclasses, which it does not).

Foreign state. adamw, adamw8bit and adamw_bf16 run the same AdamW update, so their moments convert into
each other: state of another of them (tagged, or untagged such as a transformers ``adamw_torch``
checkpoint or a bare bitsandbytes / torchao one) is converted to the loading optimizer's format, with a
warning saying from what: moments of tensors it keeps in 8-bit are quantized (``quantize_moments``), 8-bit
moments loaded elsewhere are dequantized, adamw_bf16 casts to its state dtype and starts its Kahan
compensation at zero (the sub-ulp remainder of past updates, lost in any fp32 run anyway). Adafactor's
factored statistics are not AdamW's moments: state moving into or out of it is refused, saying how to
resume. An untagged state with none of these formats' marks is read as Adafactor's own by Adafactor (its
vectors' state has AdamW's keys; its matrices' tell the difference) and as plain AdamW's by the others.

Parameters are matched by name where both the checkpoint and the optimizer name them (torch records
``param_names`` in each group), by position otherwise.
"""

from __future__ import annotations

import logging
import math

import torch

from .options import OPTIONS, check_hyperparams

__all__ = ["FORMAT", "tag_of", "to_canonical", "from_canonical", "dequantize", "validate", "save", "load"]

logger = logging.getLogger(__name__)

FORMAT = 1
BLOCK = 256
_TAG = "hf_efficient"
_ABSMAX = ("exp_avg_absmax", "exp_avg_sq_absmax")
_8BIT_KEYS = {"step", "exp_avg", "exp_avg_sq", *_ABSMAX}
KEYS = {  # family -> state keys its optimizers may hold (canonical layout)
    "adamw": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    "adamw8bit": _8BIT_KEYS,
    "adafactor": {"step", "exp_avg", "exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col"},
    "adamw_bf16": {"step", "exp_avg", "exp_avg_sq", "kahan_comp"},
}
_ADAMW_MATH = ("adamw", "adamw8bit", "adamw_bf16")  # one AdamW update: their moments convert into each other
# group keys that say how one implementation computes, not what the run's hyperparameters are: not carried
# to another family (maximize / amsgrad are, so that the optimizer refuses them if it cannot honour them)
_IMPL_KEYS = {"foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay", "min_8bit_size", "compile",
              "compensation", "optim_bits", "percentile_clipping", "block_wise", "max_unorm", "skip_zeros", "is_paged",
              "alpha", "t_alpha", "t_beta3", "block_size", "bf16_stochastic_round", "is_adamw"}
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def tag_of(state_dict: dict) -> dict | None:
    return state_dict.get(_TAG) if isinstance(state_dict, dict) else None


def _bnb_maps(device) -> tuple[torch.Tensor, torch.Tensor]:
    from bitsandbytes.functional import create_dynamic_map

    return create_dynamic_map(signed=True).to(device), create_dynamic_map(signed=False).to(device)


def _torchao_maps(device) -> tuple[torch.Tensor, torch.Tensor]:
    from torchao.optim import subclass_8bit as s8

    return (torch.tensor(s8.get_qmap_signed(), device=device), torch.tensor(s8.get_qmap_unsigned(), device=device))


# --- per-backend layout <-> canonical layout (8-bit family) ------------------------------------------

_BNB_KEYS = {"step", "state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2", "unorm_vec"}


def _bnb_to_canonical(st: dict) -> dict:
    for key in [k for k, v in st.items() if isinstance(v, dict)]:  # bnb nests quantization state for FSDP
        st = {**{k: v for k, v in st.items() if k != key}, **st[key]}
    if "state1" not in st:
        raise ValueError(f"this optimizer state has keys {sorted(st)}, not bitsandbytes' (state1, state2, ...): "
                         "it was written by another optimizer")
    unknown = set(st) - _BNB_KEYS
    quantized = torch.is_tensor(st["state1"]) and st["state1"].dtype == torch.uint8
    missing = {"step", "state2"} | ({"absmax1", "absmax2", "qmap1", "qmap2"} if quantized else set())
    if unknown or missing - set(st):
        raise ValueError(f"bitsandbytes state with keys {sorted(st)}: blockwise AdamW state has "
                         f"{sorted(_BNB_KEYS - {'unorm_vec'})}; "
                         + (f"{sorted(unknown)} belong to another bitsandbytes optimizer or setting, which only it can "
                            "resume" if unknown else
                            f"{sorted(missing - set(st))} missing: the checkpoint is incomplete"))
    step = st["step"]  # bnb counts in an int; canonical is a float tensor (anything else: refused by validation)
    numeric = isinstance(step, (int, float)) and not isinstance(step, bool)
    out = {"step": torch.tensor(float(step)) if numeric else step}
    out["exp_avg"], out["exp_avg_sq"] = st["state1"], st["state2"]
    if quantized:
        signed, unsigned = _bnb_maps(st["qmap1"].device)
        if not (torch.equal(st["qmap1"].float(), signed) and torch.equal(st["qmap2"].float(), unsigned)):
            raise ValueError("this bitsandbytes state uses non-standard quantization maps; it can only be resumed "
                             "with backend=bnb")
        out["exp_avg_absmax"], out["exp_avg_sq_absmax"] = st["absmax1"], st["absmax2"]
    return out


def _canonical_to_bnb(st: dict, p: torch.Tensor) -> dict:
    out = {"step": int(st["step"]), "state1": st["exp_avg"], "state2": st["exp_avg_sq"]}
    if "exp_avg_absmax" in st:
        out["qmap1"], out["qmap2"] = _bnb_maps(st["exp_avg"].device)
        out["absmax1"], out["absmax2"] = st["exp_avg_absmax"], st["exp_avg_sq_absmax"]
    return out


def _torchao_to_canonical(st: dict) -> dict:
    out = {k: v for k, v in st.items() if k not in ("exp_avg", "exp_avg_sq")}
    if torch.is_tensor(out.get("step")):
        out["step"] = st["step"].detach().float().reshape(())
    for key in ("exp_avg", "exp_avg_sq"):
        v = st.get(key)
        if hasattr(v, "codes"):  # torchao OptimState8bit: codes + per-block scale (its absmax)
            out[key], out[f"{key}_absmax"] = v.codes.clone(), v.scale.clone()
        elif torch.is_tensor(v):
            out[key] = v.detach().clone()
    return out


def _canonical_to_torchao(st: dict, p: torch.Tensor) -> dict:
    from torchao.optim.subclass_8bit import OptimState8bit

    out = {"step": st["step"].to(p.device)}
    signed, unsigned = _torchao_maps(p.device)
    for key, qmap in (("exp_avg", signed), ("exp_avg_sq", unsigned)):
        codes = st[key]
        if f"{key}_absmax" not in st:
            out[key] = codes
        elif p.numel() % BLOCK == 0:
            out[key] = OptimState8bit(codes.reshape(p.shape), st[f"{key}_absmax"], qmap, key == "exp_avg")
        else:  # torchao keeps such tensors in full precision: give it the exact values the codes stand for
            out[key] = dequantize(codes, st[f"{key}_absmax"], qmap).reshape(p.shape)
    return out


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Values of blockwise codes: ``qmap[code] * absmax[block]`` (the last block may be partial)."""
    flat = qmap[codes.reshape(-1).long()]
    pad = absmax.numel() * BLOCK - flat.numel()
    return (torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK) * absmax.view(-1, 1)).reshape(-1)[: codes.numel()]


_CONVERT = {"bnb": (_bnb_to_canonical, _canonical_to_bnb), "torchao": (_torchao_to_canonical, _canonical_to_torchao)}


def to_canonical(family: str, backend: str, state: dict) -> dict:
    """Per-parameter state of ``backend`` in the canonical layout (unchanged for non-8-bit families)."""
    if family != "adamw8bit" or backend not in _CONVERT:
        return state
    return {k: _CONVERT[backend][0](v) for k, v in state.items()}


def from_canonical(family: str, backend: str, state: dict, params: dict[int, torch.Tensor]) -> dict:
    if family != "adamw8bit" or backend not in _CONVERT:
        return state
    return {k: _CONVERT[backend][1](v, params[k]) for k, v in state.items()}


def _any_to_canonical(st: dict) -> tuple[dict, str | None]:
    """An untagged parameter state in whichever layout wrote it (bitsandbytes', torchao's or torch's) -> canonical,
    and the 8-bit library it came from (None: plain tensors, as torch's optimizers keep them)."""
    if "state1" in st or any(isinstance(v, dict) for v in st.values()):
        return _bnb_to_canonical(st), "bitsandbytes"
    if any(hasattr(v, "codes") for v in st.values()):
        return _torchao_to_canonical(st), "torchao"
    return dict(st), None


def groups_to_canonical(groups: list[dict]) -> list[dict]:
    """Param groups with plain-number hyperparameters (torchao keeps ``lr`` as a tensor)."""
    return [{k: v.item() if torch.is_tensor(v) and v.numel() == 1 else v for k, v in g.items()} for g in groups]


def groups_from_canonical(backend: str, saved: list[dict], current: list[dict]) -> list[dict]:
    """Saved groups in the form ``backend`` keeps: its own extra keys, a tensor ``lr`` where it has one."""
    out = []
    for g, live in zip(saved, current):
        # keys only this backend keeps (our kernel's `compile`, ...) come from the live group
        g = {**{k: v for k, v in live.items() if k not in ("params", "param_names")}, **g}
        if torch.is_tensor(live.get("lr")) and not torch.is_tensor(g.get("lr")):
            g["lr"] = torch.tensor(g["lr"], dtype=live["lr"].dtype, device=live["lr"].device)
        out.append(g)
    return out


# --- validation before loading -------------------------------------------------------------------------


def _allowed_shapes(family: str, key: str, p: torch.Tensor) -> set[tuple]:
    """Shapes (as tuples) a state tensor ``key`` may have for parameter ``p``."""
    shape = tuple(p.shape)
    if key.endswith("_absmax"):
        return {(math.ceil(p.numel() / BLOCK),)}
    if key == "exp_avg_sq_row":
        return {shape[:-1]}
    if key == "exp_avg_sq_col":
        return {shape[:-2] + shape[-1:]}
    return {shape}


def _required_keys(family: str, st: dict, p: torch.Tensor, group: dict) -> set[str]:
    """Keys a state of ``family`` must hold for ``p`` in ``group`` (the saved group: its flags decide)."""
    need = {"step", "exp_avg", "exp_avg_sq"}
    if family == "adamw" and group.get("amsgrad"):
        need.add("max_exp_avg_sq")
    if family == "adamw8bit" and torch.is_tensor(st.get("exp_avg")) and st["exp_avg"].dtype == torch.uint8:
        need |= set(_ABSMAX)
    if family == "adamw_bf16" and group.get("compensation", "kahan") == "kahan" and p.dtype in _LOW_PRECISION:
        need.add("kahan_comp")
    if family == "adafactor":
        need = {"step"} | ({"exp_avg_sq_row", "exp_avg_sq_col"} if p.dim() >= 2 else {"exp_avg_sq"})
        if group.get("beta1") is not None:
            need.add("exp_avg")
    return need


def _dtype_error(family: str, st: dict, key: str, value: torch.Tensor) -> str | None:
    """What is wrong with the dtype of state tensor ``key``, or None."""
    quantized = family == "adamw8bit" and st["exp_avg"].dtype == torch.uint8
    if key in _ABSMAX:
        return None if value.dtype == torch.float32 else "float32 (one scale per 256-element block)"
    if quantized and key in ("exp_avg", "exp_avg_sq"):
        return None if value.dtype == torch.uint8 else "uint8 codes, as exp_avg's"
    if value.dtype.is_floating_point:
        return None
    if family == "adamw8bit":
        return "uint8 codes (with absmaxes) or a floating-point dtype"
    return "a floating-point dtype"


def _check_step(step, where: str) -> None:
    value = step.item() if torch.is_tensor(step) and step.numel() == 1 else step
    if torch.is_tensor(value) or isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0):
        shown = f"a tensor of shape {tuple(step.shape)}" if torch.is_tensor(value) else repr(step)
        raise ValueError(f"{where} has step {shown}: a step count must be a number >= 0 or a one-element tensor; the "
                         "checkpoint is corrupt or was edited")


def _check_param_state(family: str, name: str, st, p: torch.Tensor, pname: str, group: dict) -> None:
    """Raise ValueError unless ``st`` is a complete state of ``family`` (canonical layout) for ``p``."""
    where = f"the state of parameter {pname!r}"
    if not isinstance(st, dict):
        raise ValueError(f"{where} is a {type(st).__name__}, not a dict of state tensors: the checkpoint is corrupt")
    unknown = set(st) - KEYS[family]
    if unknown:
        raise ValueError(f"{where} has keys {sorted(unknown)}, which {family} state does not use: it was written by "
                         f"another optimizer")
    if family == "adafactor" and p.dim() >= 2 and "exp_avg_sq" in st:
        *rows, cols = p.shape
        raise ValueError(f"{where} has a full exp_avg_sq (shape {tuple(getattr(st['exp_avg_sq'], 'shape', ()))}); "
                         f"Adafactor keeps a matrix's second moment factored, as exp_avg_sq_row of shape {tuple(rows)} "
                         f"and exp_avg_sq_col of shape {tuple(p.shape[:-2]) + (cols,)}: this state was written by "
                         f"another optimizer (AdamW-like). Resume with the optimizer that wrote it, or start "
                         f"hf_eff_{name} afresh (remove optimizer.pt from the checkpoint)")
    for key, value in st.items():
        if key != "step" and not torch.is_tensor(value):
            raise ValueError(f"{where} has {key} of type {type(value).__name__}, not a tensor: the checkpoint is "
                             "corrupt or was edited")
    missing = _required_keys(family, st, p, group) - set(st)
    if family == "adamw8bit" and "exp_avg" in st and st["exp_avg"].dtype.is_floating_point:
        extra = set(st) & set(_ABSMAX)
        if extra:
            raise ValueError(f"{where} has {sorted(extra)} beside {st['exp_avg'].dtype} moments: absmaxes belong to "
                             "uint8 codes only; the checkpoint is corrupt")
    if missing:
        raise ValueError(f"{where} lacks {sorted(missing)}, which {family} state with these settings always holds: "
                         "the checkpoint is incomplete or corrupt. Resume from another checkpoint, or start the "
                         "optimizer afresh (remove optimizer.pt from the checkpoint)")
    _check_step(st["step"], where)
    for key, value in st.items():
        if key == "step":
            continue
        wanted = _dtype_error(family, st, key, value)
        if wanted is not None:
            raise ValueError(f"{where} has {key} of dtype {value.dtype}, but {family} state keeps it in {wanted}: "
                             "the checkpoint is corrupt or was written by another optimizer")
        signed = key in ("exp_avg", "kahan_comp")  # the others are second moments or their scales: >= 0
        if value.dtype.is_floating_point and not (bool(value.isfinite().all()) and (
                signed or bool((value >= 0).all()))):
            raise ValueError(f"{where} has {key} holding non-finite values{'' if signed else ' or negative ones'}: "
                             "training from it would turn the weights non-finite; the checkpoint is corrupt. Resume "
                             "from an earlier checkpoint, or start the optimizer afresh")
        if tuple(value.shape) not in _allowed_shapes(family, key, p):
            expected = " or ".join(str(s) for s in _allowed_shapes(family, key, p))
            raise ValueError(f"{where} has {key} of shape {tuple(value.shape)}, but {key} of a parameter of shape "
                             f"{tuple(p.shape)} has shape {expected}: the checkpoint is for another model or "
                             "another optimizer")


def _check_group(g: dict, gi: int) -> None:
    """Raise ValueError if saved group ``gi`` holds a hyperparameter no optimizer may run with."""
    plain = groups_to_canonical([g])[0]
    try:
        check_hyperparams(lr=plain.get("lr", 0.0), betas=plain.get("betas"), eps=plain.get("eps"),
                          weight_decay=plain.get("weight_decay", 0.0))
        for key in ("beta1", "decay_rate", "clip_threshold", "compensation"):  # the family options groups carry
            if key not in plain:
                continue
            opt, value = OPTIONS[key], plain[key]
            number = opt.type is float and isinstance(value, (int, float))
            if isinstance(value, bool) or not (isinstance(value, opt.type) or number or value is None):
                raise ValueError(f"{key}={value!r} is not a {opt.type.__name__}")
            opt.coerce(value, "the group")
        size = plain.get("min_8bit_size", 0)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"min_8bit_size={size!r} is not an int >= 0")
    except (ValueError, TypeError) as e:
        raise ValueError(f"param group {gi} of the loaded optimizer state: {e}. The checkpoint is corrupt or was "
                         "edited: fix the value, or start the optimizer afresh") from None


def _live_order(saved_groups: list, live_groups: list[dict]) -> list[dict]:
    """Saved groups with their parameter ids in the optimizer's order: by name where both sides carry
    ``param_names``, else by position (torch's rule). Refuses differing names, naming them."""
    out = []
    for gi, (g, live) in enumerate(zip(saved_groups, live_groups)):
        # names that do not describe the live group's parameters (a wrapper such as DeepSpeed's ZeRO swapped them
        # for flat partitions) say nothing: position is torch's rule
        if "param_names" not in g or "param_names" not in live or len(live["param_names"]) != len(live["params"]):
            out.append(g)
            continue
        names, want = list(g["param_names"]), list(live["param_names"])
        if len(names) != len(g["params"]) or len(set(names)) != len(names):
            raise ValueError(f"param group {gi} of the loaded optimizer state has param_names {names} for "
                             f"{len(g['params'])} parameters: names must be unique, one per parameter; the checkpoint "
                             "is corrupt")
        missing, extra = [n for n in want if n not in names], [n for n in names if n not in want]
        if missing or extra:
            raise ValueError(f"param group {gi} of the loaded optimizer state names other parameters than the "
                             f"optimizer's: missing {missing}, not in this optimizer {extra}. It was written for "
                             "another model or another grouping: load the matching model, or start the optimizer "
                             "afresh")
        where = {n: i for i, n in enumerate(names)}
        out.append(dict(g, params=[g["params"][where[n]] for n in want], param_names=want))
    return out


def _check_structure(sd, live_groups: list[dict], name: str) -> list[dict]:
    """The saved groups, after checking the dict's shape, grouping and group hyperparameters."""
    if not isinstance(sd, dict) or not isinstance(sd.get("param_groups"), list) or not isinstance(
            sd.get("state"), dict):
        raise ValueError("not an optimizer state dict: expected a dict with keys 'state' (a dict) and "
                         "'param_groups' (a list)")
    saved = sd["param_groups"]
    for gi, g in enumerate(saved):
        if not isinstance(g, dict) or not isinstance(g.get("params"), (list, tuple)):
            raise ValueError(f"param group {gi} of the loaded optimizer state has no 'params' list: the checkpoint "
                             "is corrupt")
    saved_sizes, sizes = [len(g["params"]) for g in saved], [len(g["params"]) for g in live_groups]
    if saved_sizes != sizes:
        raise ValueError(f"this optimizer state holds {sum(saved_sizes)} parameters in groups of {saved_sizes}; "
                         f"hf_eff_{name} has {sum(sizes)} in groups of {sizes}: it was written for another model or "
                         "another grouping")
    ids = {pid for g in saved for pid in g["params"]}
    if len(ids) != sum(saved_sizes):
        raise ValueError("the loaded optimizer state lists a parameter id in two places: the checkpoint is corrupt")
    for pid in sd["state"]:
        if pid not in ids:
            raise ValueError(f"this optimizer state has state for parameter id {pid!r}, which no group lists")
    for gi, g in enumerate(saved):
        _check_group(g, gi)
    return _live_order(saved, live_groups)


def _check_tag(tag, family: str, name: str) -> None:
    if tag is None:
        return
    if not isinstance(tag, dict):
        raise ValueError(f"the loaded optimizer state's {_TAG!r} entry is a {type(tag).__name__}, not a dict: the "
                         "checkpoint is corrupt")
    if tag.get("format", FORMAT) > FORMAT:
        raise ValueError(f"this optimizer state uses hf_efficient state format {tag['format']}; this version reads "
                         f"up to {FORMAT}: upgrade hf_efficient")
    if tag.get("family") != family and not (tag.get("family") in _ADAMW_MATH and family in _ADAMW_MATH):
        raise ValueError(f"this optimizer state was written by hf_eff_{tag.get('name')} ({tag.get('family')} "
                         f"state) and cannot be loaded into hf_eff_{name}: resume with optim=hf_eff_{tag.get('name')},"
                         f" or start the optimizer afresh (remove optimizer.pt from the checkpoint)")
    for key in ("steps", "skipped_steps"):
        if not isinstance(tag.get(key, 0), int) or isinstance(tag.get(key), bool) or tag.get(key, 0) < 0:
            raise ValueError(f"the loaded optimizer state's tag has {key}={tag.get(key)!r}, not a count: the "
                             "checkpoint is corrupt or was edited")


def _untagged_family(state: dict, libraries: set, family: str) -> str:
    """Which family wrote an untagged canonical state, by the marks its formats leave (see the module docstring)."""
    keys = set().union(*state.values()) if state else set()
    if libraries - {None} or any(torch.is_tensor(st.get("exp_avg")) and st["exp_avg"].dtype == torch.uint8
                                 for st in state.values()):
        return "adamw8bit"
    if keys & {"exp_avg_sq_row", "exp_avg_sq_col"} or family == "adafactor":
        return "adafactor"
    return "adamw_bf16" if "kahan_comp" in keys else "adamw"


def validate(state_dict: dict, family: str, name: str, param_names: list[str], params: list[torch.Tensor],
             groups: list[dict] | None = None) -> None:
    """Raise ValueError unless ``state_dict`` (canonical layout, ``family``'s state, saved ids in the order of
    ``params``) is complete and fits ``params``: keys, value types, dtypes, shapes and group hyperparameters.

    ``groups``: the optimizer's param groups, to check the grouping and names against (default: one group).
    """
    live = groups if groups is not None else [{"params": params}]
    saved = _check_structure(state_dict, live, name)
    for i, (gi, pid) in enumerate((gi, pid) for gi, g in enumerate(saved) for pid in g["params"]):
        st = state_dict["state"].get(pid)
        if st is not None:
            _check_param_state(family, name, st, params[i], param_names[i], saved[gi])


# --- conversion between the AdamW-math families ----------------------------------------------------------


def _keeps_8bit(optimizer, backend: str):
    """``(group index, index in group, param) -> bool``: whether ``optimizer`` gives that tensor 8-bit state, by
    its backend's own rule."""
    fp32_ids = getattr(optimizer, "_fp32_ids", set())
    if backend == "bnb":
        def rule(gi, pi, p):
            config = optimizer.get_config(gi, pi, optimizer.param_groups[gi])
            return config["optim_bits"] == 8 and p.numel() >= config["min_8bit_size"]
    elif backend == "torchao":  # torchao's _new_buffer: >= 4096 elements in whole blocks; ours: >= min_8bit_size
        def rule(gi, pi, p):
            return (id(p) not in fp32_ids and p.numel() >= max(optimizer._min_8bit_size, 4096)
                    and p.numel() % optimizer.block_size == 0)
    else:
        def rule(gi, pi, p):
            return id(p) not in fp32_ids and p.numel() >= optimizer.param_groups[gi]["min_8bit_size"]
    return rule


def _moments(st: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The moments a canonical state stands for, in fp32 (8-bit codes decoded)."""
    if st["exp_avg"].dtype != torch.uint8:
        return st["exp_avg"].float(), st["exp_avg_sq"].float()
    from .optim.adamw8bit import dynamic_map

    shape = st["exp_avg"].shape
    return tuple(dequantize(st[k], st[f"{k}_absmax"], dynamic_map(signed).to(st[k].device)).reshape(shape)
                 for k, signed in (("exp_avg", True), ("exp_avg_sq", False)))


def _convert(state: dict, src: str, dst: str, optimizer, backend: str, saved_ids: list) -> dict[str, list[str]]:
    """Convert ``state`` (canonical, ``src``'s) in place to ``dst``'s format for ``optimizer``'s parameters.
    Returns what was done -> names of the tensors it was done to ("" for tensors whose format did not change)."""
    done: dict[str, list[str]] = {}
    keeps_8bit = _keeps_8bit(optimizer, backend) if dst == "adamw8bit" else None
    i = 0
    for gi, group in enumerate(optimizer.param_groups):
        names = group.get("param_names") or [f"group{gi}.param{j}" for j in range(len(group["params"]))]
        for pi, (p, pname) in enumerate(zip(group["params"], names)):
            pid, i = saved_ids[i], i + 1
            st = state.get(pid)
            if st is None:
                continue
            m, v = _moments(st)
            out, actions = {"step": st["step"]}, []
            if st["exp_avg"].dtype == torch.uint8:
                actions.append("8-bit moments dequantized")
            if dst == "adamw8bit" and keeps_8bit(gi, pi, p):
                from .optim.adamw8bit import quantize_moments

                try:
                    codes = quantize_moments(m, v)
                except ValueError as e:
                    raise ValueError(f"the state of parameter {pname!r}: {e}") from None
                out.update({k: t.reshape(p.shape) if k in ("exp_avg", "exp_avg_sq") else t for k, t in codes.items()})
                actions.append("moments quantized to 8-bit")
            elif dst == "adamw_bf16":
                from .optim.adamw_bf16 import _state_dtype

                dtype = _state_dtype(p)
                if st["exp_avg"].dtype not in (dtype, torch.uint8):
                    actions.append(f"moments cast from {st['exp_avg'].dtype} to {dtype}".replace("torch.", ""))
                out["exp_avg"], out["exp_avg_sq"] = m.to(dtype), v.to(dtype)
                if group.get("compensation") == "kahan" and p.dtype in _LOW_PRECISION:
                    out["kahan_comp"] = torch.zeros_like(p, dtype=dtype)
                    actions.append("Kahan compensation started at zero")
            else:  # fp32 moments: adamw (torch casts them to the parameter's dtype) or 32-bit adamw8bit state
                out["exp_avg"], out["exp_avg_sq"] = m, v
            if "kahan_comp" in st:
                actions.append("Kahan compensation dropped")
            for action in actions or [""]:
                done.setdefault(action, []).append(pname)
            state[pid] = out
    return done


def _describe(tag, libraries: set, src: str) -> str:
    if tag is not None:
        return f"hf_eff_{tag.get('name')} ({src} state, backend {tag.get('backend')})"
    return {"adamw8bit": f"an untagged {' / '.join(sorted(lib for lib in libraries if lib) or ['8-bit'])} 8-bit AdamW",
            "adamw_bf16": "an untagged AdamWBF16", "adamw": "an untagged fp32 AdamW (e.g. torch.optim.AdamW, "
            "transformers' adamw_torch)"}[src] + " state"


def _convert_groups(groups: list[dict], src: str, trainer_name: str) -> list[dict]:
    """Saved groups of another family, less the keys that configure its implementation."""
    for gi, g in enumerate(groups):
        if g.get("amsgrad"):  # its max_exp_avg_sq has no counterpart in the other formats
            raise ValueError(f"param group {gi} of the loaded {src} state ran with amsgrad=True, which {trainer_name} "
                             "does not continue: resume with optim=hf_eff_adamw (or adamw_torch), or start the "
                             "optimizer afresh")
    return [{k: v for k, v in g.items() if k not in _IMPL_KEYS} for g in groups]


# --- what an optimizer made by create_optimizer does on state_dict() / load_state_dict() -----------------


def save(sd: dict, spec, backend: str, info) -> dict:
    """The backend's state dict ``sd`` in the canonical layout, tagged with what wrote it."""
    sd = dict(sd, state=to_canonical(spec.family, backend, sd["state"]),
              param_groups=groups_to_canonical(sd["param_groups"]))
    sd[_TAG] = {"name": spec.name, "family": spec.family, "backend": backend, "format": FORMAT,
                "skipped_steps": info.skipped_steps, "steps": info.steps}
    return sd


def load(optimizer, load_state_dict, sd: dict, spec, backend: str, info, param_names: list[str]) -> None:
    """Validate ``sd`` against ``optimizer`` (a tagged canonical dict, or an untagged one in any layout this module
    reads), convert it to ``backend``'s format and layout, and hand it to the backend's ``load_state_dict``.
    Nothing is changed unless every check passed."""
    from .guard import check_group_flags

    tag = tag_of(sd)
    _check_tag(tag, spec.family, spec.name)
    live = optimizer.param_groups
    params = [p for g in live for p in g["params"]]
    saved = _check_structure(sd, live, spec.name)
    saved_ids = [pid for g in saved for pid in g["params"]]
    state, libraries = {}, set()
    for pid, pname in zip(saved_ids, param_names):
        st = sd["state"].get(pid)
        if isinstance(st, dict) and not st:
            continue  # no state yet: as if absent
        if tag is None and isinstance(st, dict):
            try:
                st, library = _any_to_canonical(st)
            except ValueError as e:
                raise ValueError(f"the state of parameter {pname!r}: {e}") from None
            libraries.add(library)
        if st is not None:
            state[pid] = dict(st) if isinstance(st, dict) else st  # the caller's dict stays as it was
    src = tag["family"] if tag is not None else _untagged_family(
        {k: v for k, v in state.items() if isinstance(v, dict)}, libraries, spec.family)
    if src != spec.family and not (src in _ADAMW_MATH and spec.family in _ADAMW_MATH):
        raise ValueError(f"this optimizer state holds {src} state and cannot be loaded into {spec.trainer_name}: it "
                         "was written by another optimizer. Resume with the optimizer that wrote it, or start the "
                         "optimizer afresh (remove optimizer.pt from the checkpoint)")
    validate(dict(sd, state=state, param_groups=saved), src, spec.name, param_names, params, live)
    for st in state.values():  # a number (torch accepts one) or a one-element tensor: the kernels' scalar tensor
        st["step"] = torch.as_tensor(st["step"], dtype=torch.float32).detach().reshape(()).clone()
    if src != spec.family:
        saved = _convert_groups(saved, src, spec.trainer_name)
    groups = groups_from_canonical(backend, saved, live)
    for g in groups:
        check_group_flags(g, optimizer.defaults, spec.trainer_name)
    if src != spec.family:
        done = _convert(state, src, spec.family, optimizer, backend, saved_ids)
        if set(done) - {""}:
            logger.warning("%s: the loaded optimizer state was written by %s; converted it to %s's format: %s",
                           spec.trainer_name, _describe(tag, libraries, src), spec.trainer_name, "; ".join(
                               f"{action or 'format unchanged'}: {len(names)} tensor(s) ({', '.join(names[:4])}"
                               f"{', ...' if len(names) > 4 else ''})" for action, names in done.items()))
    native = from_canonical(spec.family, backend, state, {pid: p for pid, p in zip(saved_ids, params)})
    plain = {k: v for k, v in sd.items() if k != _TAG}
    load_state_dict(dict(plain, state=native, param_groups=groups))
    if tag is not None:
        info.skipped_steps, info.steps = tag.get("skipped_steps", 0), tag.get("steps", 0)
