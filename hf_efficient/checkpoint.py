"""Optimizer state dicts that say what wrote them, load only where they fit, and move between 8-bit backends.

Every optimizer made by :func:`hf_efficient.create_optimizer` writes a tag (``state_dict()["hf_efficient"]``)
naming its optimizer family and backend. Loading checks the tag, state keys and tensor sizes against the
parameters *before* anything is changed, so a wrong checkpoint is refused, never half-loaded.

8-bit state is written in one canonical layout, whichever backend made it: ``exp_avg`` / ``exp_avg_sq``
as uint8 codes of the parameter's shape plus ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` (fp32, one per
256-element block), or fp32 tensors for parameters with 32-bit state. bitsandbytes and torchao use the
same dynamic quantization maps and block size (checked below), so the conversion is a relabelling, not a
requantization: a bnb checkpoint resumes on torchao or this package's kernel exactly, and back. Every
tensor in it is a plain tensor, so ``torch.load(..., weights_only=True)`` works (torchao's own state
holds tensor subclasses, which it does not).
"""

from __future__ import annotations

import math

import torch

__all__ = ["FORMAT", "tag_of", "to_canonical", "from_canonical", "validate", "save", "load"]

FORMAT = 1
BLOCK = 256
_TAG = "hf_efficient"
_8BIT_KEYS = {"step", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"}
KEYS = {  # family -> state keys its optimizers may hold (canonical layout)
    "adamw": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    "adamw8bit": _8BIT_KEYS,
    "adafactor": {"step", "exp_avg", "exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col"},
    "adamw_bf16": {"step", "exp_avg", "exp_avg_sq", "kahan_comp"},
}


def tag_of(state_dict: dict) -> dict | None:
    return state_dict.get(_TAG)


def _bnb_maps(device) -> tuple[torch.Tensor, torch.Tensor]:
    from bitsandbytes.functional import create_dynamic_map

    return create_dynamic_map(signed=True).to(device), create_dynamic_map(signed=False).to(device)


def _torchao_maps(device) -> tuple[torch.Tensor, torch.Tensor]:
    from torchao.optim import subclass_8bit as s8

    return (torch.tensor(s8.get_qmap_signed(), device=device), torch.tensor(s8.get_qmap_unsigned(), device=device))


# --- per-backend layout <-> canonical layout (8-bit family) ------------------------------------------


def _bnb_to_canonical(st: dict) -> dict:
    for key in [k for k, v in st.items() if isinstance(v, dict)]:  # bnb nests quantization state for FSDP
        st = {**{k: v for k, v in st.items() if k != key}, **st[key]}
    if "state1" not in st:
        raise ValueError(f"this optimizer state has keys {sorted(st)}, not bitsandbytes' (state1, state2, ...): "
                         "it was written by another optimizer")
    out = {"step": torch.tensor(float(st["step"]))}
    out["exp_avg"], out["exp_avg_sq"] = st["state1"], st["state2"]
    if "absmax1" in st:
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
    out = {"step": st["step"].detach().float().reshape(())}
    for key in ("exp_avg", "exp_avg_sq"):
        v = st[key]
        if hasattr(v, "codes"):  # torchao OptimState8bit: codes + per-block scale (its absmax)
            out[key], out[f"{key}_absmax"] = v.codes.clone(), v.scale.clone()
        else:
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


def _allowed_numels(family: str, key: str, p: torch.Tensor) -> set[tuple]:
    """Shapes (as tuples) a state tensor ``key`` may have for parameter ``p``."""
    shape = tuple(p.shape)
    if key == "step":
        return {(), (1,)}
    if key.endswith("_absmax"):
        return {(math.ceil(p.numel() / BLOCK),)}
    if key == "exp_avg_sq_row":
        return {shape[:-1]}
    if key == "exp_avg_sq_col":
        return {shape[:-2] + shape[-1:]}
    if family == "adafactor" and key == "exp_avg_sq" and p.dim() >= 2:
        return set()  # Adafactor factors the second moment of every matrix
    return {shape}


def validate(state_dict: dict, family: str, name: str, param_names: list[str], params: list[torch.Tensor]) -> None:
    """Raise ValueError if ``state_dict`` (canonical layout) was not written for this optimizer and these params."""
    tag = tag_of(state_dict)
    if tag is not None and tag.get("family") != family:
        raise ValueError(f"this optimizer state was written by hf_eff_{tag.get('name')} ({tag.get('family')} "
                         f"state) and cannot be loaded into hf_eff_{name}: resume with optim=hf_eff_{tag.get('name')},"
                         f" or start the optimizer afresh (remove optimizer.pt from the checkpoint)")
    if tag is not None and tag.get("format", FORMAT) > FORMAT:
        raise ValueError(f"this optimizer state uses hf_efficient state format {tag['format']}; this version reads "
                         f"up to {FORMAT}: upgrade hf_efficient")
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, list) or "state" not in state_dict:
        raise ValueError("not an optimizer state dict: expected keys 'state' and 'param_groups'")
    saved_sizes = [len(g["params"]) for g in saved_groups]
    if sum(saved_sizes) != len(params):
        raise ValueError(f"this optimizer state holds {sum(saved_sizes)} parameters in groups of {saved_sizes}; "
                         f"the optimizer has {len(params)}: it was written for another model or another grouping")
    index = {pid: i for i, pid in enumerate(pid for g in saved_groups for pid in g["params"])}
    allowed_keys = KEYS[family]
    for pid, st in state_dict["state"].items():
        if pid not in index:
            raise ValueError(f"this optimizer state has state for parameter id {pid!r}, which no group lists")
        i = index[pid]
        p, pname = params[i], param_names[i]
        unknown = set(st) - allowed_keys
        if unknown:
            raise ValueError(f"the state of parameter {pname!r} has keys {sorted(unknown)}, which hf_eff_{name} does "
                             f"not use: it was written by another optimizer")
        for key, value in st.items():
            if torch.is_tensor(value) and tuple(value.shape) not in _allowed_numels(family, key, p):
                raise ValueError(f"the state of parameter {pname!r} has {key} of shape {tuple(value.shape)}, but the "
                                 f"parameter has shape {tuple(p.shape)}: the checkpoint is for another model or "
                                 f"another optimizer")


# --- what an optimizer made by create_optimizer does on state_dict() / load_state_dict() -----------------


def save(sd: dict, spec, backend: str, info) -> dict:
    """The backend's state dict ``sd`` in the canonical layout, tagged with what wrote it."""
    sd = dict(sd, state=to_canonical(spec.family, backend, sd["state"]), param_groups=groups_to_canonical(sd["param_groups"]))
    sd[_TAG] = {"name": spec.name, "family": spec.family, "backend": backend, "format": FORMAT,
                "skipped_steps": info.skipped_steps, "steps": info.steps}
    return sd


def load(optimizer, load_state_dict, sd: dict, spec, backend: str, info, param_names: list[str]) -> None:
    """Validate ``sd`` against ``optimizer`` (a tagged canonical dict, or an untagged one of ``backend``'s own
    layout), convert it to ``backend``'s layout and hand it to the backend's ``load_state_dict``."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    tag = tag_of(sd)
    state = sd.get("state", {})
    if tag is None:  # written by the bare backend: read it in that backend's own layout
        state = to_canonical(spec.family, backend, state)
    validate(dict(sd, state=state), spec.family, spec.name, param_names, params)
    by_id = dict(enumerate(params))
    saved_ids = [pid for g in sd["param_groups"] for pid in g["params"]]
    native = from_canonical(spec.family, backend, dict(state), {pid: by_id[i] for i, pid in enumerate(saved_ids)})
    plain = {k: v for k, v in sd.items() if k != _TAG}
    load_state_dict(dict(plain, state=native, param_groups=groups_from_canonical(
        backend, sd["param_groups"], optimizer.param_groups)))
    if tag is not None:
        info.skipped_steps, info.steps = tag.get("skipped_steps", 0), tag.get("steps", 0)
