"""Optimizer state dicts that say what wrote them, load only where they fit, and move between formats.

Every optimizer made by :func:`hf_efficient.create_optimizer` writes a tag (``state_dict()["hf_efficient"]``, and
the same in each param group, which is all of it torch.distributed.checkpoint keeps) naming its optimizer family and
backend, with its step counts. Loading checks everything *before* anything is changed (groups and
their hyperparameters, parameter names, and per parameter the state keys its layout requires, their value
types, dtypes and sizes), so a wrong checkpoint is refused, never half-loaded.

State is written in one canonical layout per family (its registry entry: ``Family.state``), whichever backend
made it; a backend that stores it otherwise has a ``Layout`` (backends.py) converting both ways. Quantized moments
are their codec's canonical codes (``StateKey.codec``: quant8's are uint8 of the parameter's shape) plus
``<moment>_absmax`` (fp32, one per block), or fp32 tensors for parameters with 32-bit state. bitsandbytes and
torchao use quant8's maps and block size (tests/test_checkpoint.py),
so the conversion is a relabelling, not a requantization: a bnb checkpoint resumes on torchao or this package's
kernel exactly, and back. Every tensor in it is a plain tensor, so ``torch.load(..., weights_only=True)`` works
(torchao's own state holds tensor subclasses, which it does not).

Foreign state. Families of one math (``Family.math``: adamw, adamw8bit and adamw_bf16 run the same AdamW update)
convert each other's moments: state of another of them (tagged, or untagged such as a transformers ``adamw_torch``
checkpoint or a bare bitsandbytes / torchao one) is converted to the loading optimizer's format, with a warning
saying from what: tensors both keep are carried over (quantized where the backend keeps 8-bit state, dequantized
where it does not, cast to the family's moment dtype), tensors only the loader keeps start at zero (adamw_bf16's
Kahan compensation: the sub-ulp remainder of past updates, lost in any fp32 run anyway), tensors only the writer
keeps are dropped. State of another math (Adafactor's factored statistics are not AdamW's moments) is refused,
saying how to resume. An untagged state is recognised by its marks (8-bit codes or a library's layout; keys only
one family holds, ``Family.marks``); one without marks is torch's plain AdamW state for the AdamW-math families
and the loader's own for the others.

Precision. Where a tensor's saved state is 8-bit and this optimizer keeps it fp32, or the reverse (one process and
FSDP2 choose differently: :func:`.optim.facts.keeps_quantized_state`; so do backends and thresholds), the state is
dequantized (exact) or quantized (lossy, within the codec's rounding), whole, and placed like its parameter; one
warning names the tensors.

Parameters are matched by name where both the checkpoint and the optimizer name them (torch records
``param_names`` in each group), by position otherwise.

Sharded checkpoints (torch.distributed.checkpoint, under FSDP2). ``dcp.load`` reads a checkpoint into the state dict
it is given, made by the loading optimizer: its keys, its dtypes. A state saved under other settings or by another
optimizer then arrives cast (8-bit codes as fp32 numbers, without their scales: refused, by the record of 8-bit
states each group's tag keeps), or ``dcp.load`` fails on a key the checkpoint lacks, before this module is reached.
:class:`LoadPlanner` reads what the checkpoint holds instead, so that every sharded load gets the verdict a
single-file load of the same state gets: converted the same way, with the same warning, or refused with the same
message.
"""

from __future__ import annotations

import logging
import math

import torch

from .optim import _sharded
from .optim.compensation import drop_unused_buffers
from .optim.facts import rows_of_blocks
from .options import check_hyperparams, check_saved_tensor, check_step
from .param_groups import group_names
from .registry import PLAIN, Family, families, get_spec

__all__ = ["FORMAT", "tag_of", "to_canonical", "from_canonical", "validate", "save", "load", "LoadPlanner"]

logger = logging.getLogger(__name__)

FORMAT = 1
_TAG = "hf_efficient"
# group keys that say how one implementation computes, not what the run's hyperparameters are: not carried
# to another family (maximize / amsgrad are, so that the optimizer refuses them if it cannot honour them)
_IMPL_KEYS = {"foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay", "min_8bit_size", "compile",
              "compensation", "optim_bits", "percentile_clipping", "block_wise", "max_unorm", "skip_zeros", "is_paged",
              "alpha", "t_alpha", "t_beta3", "block_size", "bf16_stochastic_round", "is_adamw"}
# group keys that an option of create_optimizer sets (optim_args): on resume the value asked for now wins over the
# saved one, as optimizer_info reports it, and the state's buffers follow it (compensation.drop_unused_buffers)
_SETTING_KEYS = {"compensation"}


def tag_of(state_dict: dict) -> dict | None:
    """What wrote ``state_dict``: its top-level tag, else the tag each param group carries (less the group's own
    record, ``eight_bit``): torch.distributed.checkpoint keeps only ``state`` and ``param_groups``."""
    if not isinstance(state_dict, dict):
        return None
    if _TAG in state_dict:
        return state_dict[_TAG]
    groups = state_dict.get("param_groups")
    first = groups[0] if isinstance(groups, list) and groups and isinstance(groups[0], dict) else {}
    tag = first.get(_TAG)
    return {k: v for k, v in tag.items() if k != "eight_bit"} if isinstance(tag, dict) else tag


def _convertible(src: str, dst: str) -> bool:
    """Families of one math (one update rule) convert each other's moments."""
    return src == dst or families()[src].math == families()[dst].math


def _layout(spec, backend: str):
    impl = spec.backends.get(backend)
    return impl.layout if impl is not None else None


def to_canonical(spec, backend: str, state: dict) -> dict:
    """Per-parameter state of ``spec``'s ``backend`` in the canonical layout (unchanged where it is already)."""
    layout = _layout(spec, backend)
    return state if layout is None else {k: layout.to_canonical(v) for k, v in state.items()}


def from_canonical(spec, backend: str, state: dict, params: dict[int, torch.Tensor]) -> dict:
    layout = _layout(spec, backend)
    return state if layout is None else {k: layout.from_canonical(v, params[k]) for k, v in state.items()}


def _any_to_canonical(st: dict, family: Family) -> tuple[dict, str | None]:
    """An untagged parameter state in whichever layout wrote it -> canonical, and the library it came from (None:
    plain tensors, as torch's optimizers keep them). The loading family's layouts are tried first."""
    from .registry import SPECS

    specs = sorted(SPECS.values(), key=lambda s: s.facts is not family)
    for impl in (b for s in specs for b in s.backends.values()):
        if impl.layout is not None and impl.layout.detect(st):
            return impl.layout.to_canonical(st), impl.layout.library
    return dict(st), None


def groups_to_canonical(groups: list[dict]) -> list[dict]:
    """Param groups with plain-number hyperparameters (torchao keeps ``lr`` as a tensor)."""
    return [{k: v.item() if torch.is_tensor(v) and v.numel() == 1 else v for k, v in g.items()} for g in groups]


def groups_from_canonical(backend: str, saved: list[dict], current: list[dict]) -> list[dict]:
    """Saved groups in the form ``backend`` keeps: its own extra keys, a tensor ``lr`` where it has one, and the
    settings this optimizer was built with (``_SETTING_KEYS``)."""
    out = []
    for g, live in zip(saved, current):
        # keys only this backend keeps (our kernel's `compile`, ...) and the settings come from the live group
        g = {**{k: v for k, v in live.items() if k not in ("params", "param_names")},
             **{k: v for k, v in g.items() if k not in _SETTING_KEYS and k != _TAG}}
        if torch.is_tensor(live.get("lr")) and not torch.is_tensor(g.get("lr")):
            g["lr"] = torch.tensor(g["lr"], dtype=live["lr"].dtype, device=live["lr"].device)
        out.append(g)
    return out


# --- validation before loading -------------------------------------------------------------------------


def _allowed_shapes(family: Family, key: str, p: torch.Tensor, quantized: bool = False) -> set[tuple]:
    """Shapes (as tuples) a state tensor ``key`` may have for parameter ``p`` (``quantized``: its codes are)."""
    shape, fmt = tuple(p.shape), family.state[key]
    if fmt.format == "absmax":
        block = fmt.codec.BLOCK
        absmax = {(math.ceil(p.numel() / block),)}
        if rows_of_blocks(shape, block):  # FSDP2's (rows, blocks per row)
            absmax.add((shape[0], p.numel() // shape[0] // block))
        return absmax
    if fmt.format == "codes" and quantized:
        return {tuple(fmt.codec.canonical_shape(shape))}
    return {"row": {shape[:-1]}, "col": {shape[:-2] + shape[-1:]}}.get(fmt.format, {shape})


def _codes(family: Family, st: dict) -> list[str]:
    """The keys of ``st`` that ``family`` may keep as 8-bit codes."""
    return [k for k, f in family.state.items() if f.format == "codes" and k in st]


def _is_codes(value) -> bool:
    return torch.is_tensor(value) and value.dtype == torch.uint8


def _required_keys(family: Family, st: dict, p: torch.Tensor, group: dict) -> set[str]:
    """Keys a state of ``family`` must hold for ``p`` in ``group`` (the saved group: its flags decide), and the
    absmaxes of its codes where the state is 8-bit."""
    required = set(family.required(p, group))  # a family whose groups differ (Muon8bit) requires some codes only
    codes = [k for k, f in family.state.items() if f.format == "codes" and k in required]
    quantized = bool(_codes(family, st)) and _is_codes(st[_codes(family, st)[0]])
    return required | ({f"{k}_absmax" for k in codes} if quantized else set())


def _dtype_error(family: Family, st: dict, key: str, value: torch.Tensor) -> str | None:
    """What is wrong with the dtype of state tensor ``key``, or None."""
    fmt = family.state[key].format
    codes = _codes(family, st)
    if fmt == "absmax":
        block = family.state[key].codec.BLOCK
        return None if value.dtype == torch.float32 else f"float32 (one scale per {block}-element block)"
    if fmt == "codes" and _is_codes(st[codes[0]]):
        return None if value.dtype == torch.uint8 else f"uint8 codes, as {codes[0]}'s"
    if value.dtype.is_floating_point:
        return None
    return "uint8 codes (with absmaxes) or a floating-point dtype" if fmt == "codes" else "a floating-point dtype"


def _is_first_moment(family: Family, key: str) -> bool:
    """Whether ``key`` is a first moment (signed, not the Kahan buffer) or the per-block absmax of one."""
    base = key.removesuffix("_absmax")
    return base != "kahan_comp" and base in family.state and family.state[base].signed


def _check_param_state(family: Family, name: str, st, p: torch.Tensor, pname: str, group: dict) -> None:
    """Raise ValueError unless ``st`` is a complete state of ``family`` (canonical layout) for ``p``."""
    where = f"the state of parameter {pname!r}"
    if not isinstance(st, dict):
        raise ValueError(f"{where} is a {type(st).__name__}, not a dict of state tensors: the checkpoint is corrupt")
    unknown = set(st) - set(family.state)
    if unknown:
        raise ValueError(f"{where} has keys {sorted(unknown)}, which {family.name} state does not use: it was written "
                         f"by another optimizer")
    if family.check_state is not None:
        family.check_state(st, p, where, f"hf_eff_{name}")
    for key, value in st.items():
        if key != "step" and not torch.is_tensor(value):
            raise ValueError(f"{where} has {key} of type {type(value).__name__}, not a tensor: the checkpoint is "
                             "corrupt or was edited")
    missing = _required_keys(family, st, p, group) - set(st)
    codes = _codes(family, st)  # the first one decides whether this tensor's state is 8-bit
    extra = set(st) & {f"{k}_absmax" for k in codes} if codes and st[codes[0]].dtype.is_floating_point else set()
    if extra:
        raise ValueError(f"{where} has {sorted(extra)} beside {st[codes[0]].dtype} moments: absmaxes belong to "
                         "uint8 codes only; the checkpoint is corrupt")
    if missing:
        raise ValueError(f"{where} lacks {sorted(missing)}, which {family.name} state with these settings always "
                         "holds: the checkpoint is incomplete or corrupt. Resume from another checkpoint, or start the "
                         "optimizer afresh (remove optimizer.pt from the checkpoint)")
    check_step(st["step"], where)
    for key, value in st.items():
        if key == "step":
            continue
        _check_sharding(family, value, key, p, where)
        wanted = _dtype_error(family, st, key, value)
        if wanted is not None:
            raise ValueError(f"{where} has {key} of dtype {value.dtype}, but {family.name} state keeps it in {wanted}: "
                             "the checkpoint is corrupt or was written by another optimizer")
        if value.dtype.is_floating_point:  # the unsigned ones are second moments or scales: >= 0
            check_saved_tensor(value, key, where, signed=family.state[key].signed,
                               first_moment=_is_first_moment(family, key))
        allowed = _allowed_shapes(family, key, p, _is_codes(value))
        if tuple(value.shape) not in allowed:
            expected = " or ".join(str(s) for s in allowed)
            raise ValueError(f"{where} has {key} of shape {tuple(value.shape)}, but {key} of a parameter of shape "
                             f"{tuple(p.shape)} has shape {expected}: the checkpoint is for another model or "
                             "another optimizer")


def _check_sharding(family: Family, value: torch.Tensor, key: str, p: torch.Tensor, where: str) -> None:
    """A plain parameter takes plain state: a DTensor (FSDP2 shards) would be stepped beside the whole weight. A
    sharded one takes DTensor state, or whole plain tensors (a single-file state), which :func:`_place_whole`
    shards."""
    if _sharded.is_sharded(value) == _sharded.is_sharded(p) or _sharded.is_sharded(p):
        return  # plain beside a sharded parameter: a whole state (its shape was checked), placed by the load
    raise ValueError(f"{where} has {key} as a DTensor (FSDP2 shards), but the parameter is a plain tensor: take a "
                     "whole optimizer state from the sharded run with torch.distributed.checkpoint's "
                     "get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True)). "
                     "Nothing was loaded")


def _check_group(g: dict, gi: int, uses_eps: bool = True, options: dict | None = None) -> None:
    """Raise ValueError if saved group ``gi`` holds a hyperparameter no optimizer may run with (``eps`` only where
    the family has one; ``options``: the loading name's, whose values groups carry)."""
    plain = groups_to_canonical([g])[0]
    try:
        check_hyperparams(lr=plain.get("lr", 0.0), betas=plain.get("betas"), eps=plain.get("eps") if uses_eps else None,
                          weight_decay=plain.get("weight_decay", 0.0))
        options = options or {}
        for key in sorted(plain.keys() & options.keys() - {"min_8bit_size"}):  # the family options groups carry
            options[key].check_value(plain[key], "the group")
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
    spec = get_spec(name)
    for gi, g in enumerate(saved):
        _check_group(g, gi, spec.facts.uses_eps, spec.accepted)
    return _live_order(saved, live_groups)


def _check_tag(tag, family: Family, name: str) -> None:
    if tag is None:
        return
    if not isinstance(tag, dict):
        raise ValueError(f"the loaded optimizer state's {_TAG!r} entry is a {type(tag).__name__}, not a dict: the "
                         "checkpoint is corrupt")
    if tag.get("format", FORMAT) > FORMAT:
        raise ValueError(f"this optimizer state uses hf_efficient state format {tag['format']}; this version reads "
                         f"up to {FORMAT}: upgrade hf_efficient")
    if tag.get("family") not in families() or not _convertible(tag["family"], family.name):
        raise ValueError(f"this optimizer state was written by hf_eff_{tag.get('name')} ({tag.get('family')} "
                         f"state) and cannot be loaded into hf_eff_{name}: resume with optim=hf_eff_{tag.get('name')},"
                         f" or start the optimizer afresh (remove optimizer.pt from the checkpoint)")
    for key in ("steps", "skipped_steps"):
        if not isinstance(tag.get(key, 0), int) or isinstance(tag.get(key), bool) or tag.get(key, 0) < 0:
            raise ValueError(f"the loaded optimizer state's tag has {key}={tag.get(key)!r}, not a count: the "
                             "checkpoint is corrupt or was edited")


def _untagged_family(state: dict, libraries: set, family: Family) -> Family:
    """Which family wrote an untagged canonical state, by the marks its formats leave (see the module docstring):
    8-bit codes (or a library's layout) are the loader's if it keeps 8-bit state, else the 8-bit family of its
    math; keys only one family holds are that family's; a state without marks is torch's plain AdamW where the loader
    converts from it, else the loader's own."""
    keys = set().union(*state.values()) if state else set()
    known = list(families().values())
    kin = [family] + [f for f in known if f is not family and f.math == family.math]
    if libraries - {None} or any(_is_codes(v) for st in state.values() for v in st.values()):
        return next((f for f in kin + known if f.quantized), family)
    marked = [f for f in known if f.marks & keys]
    if marked:
        return marked[0]
    return PLAIN if _convertible(PLAIN.name, family.name) else family


def validate(state_dict: dict, family: Family | str, name: str, param_names: list[str], params: list[torch.Tensor],
             groups: list[dict] | None = None) -> None:
    """Raise ValueError unless ``state_dict`` (canonical layout, ``family``'s state, saved ids in the order of
    ``params``) is complete and fits ``params``: keys, value types, dtypes, shapes and group hyperparameters.

    ``groups``: the optimizer's param groups, to check the grouping and names against (default: one group).
    """
    family = families()[family] if isinstance(family, str) else family
    live = groups if groups is not None else [{"params": params}]
    saved = _check_structure(state_dict, live, name)
    for i, (gi, pid) in enumerate((gi, pid) for gi, g in enumerate(saved) for pid in g["params"]):
        st = state_dict["state"].get(pid)
        if st is not None:
            _check_param_state(family, name, st, params[i], param_names[i], saved[gi])


# --- conversion between families of one math ---------------------------------------------------------------------


def _decoded(family: Family, st: dict, shape) -> dict[str, torch.Tensor]:
    """The tensors a canonical state of a parameter of ``shape`` stands for, in fp32 (quantized codes decoded),
    absmaxes and step left out."""
    out = {}
    for key, value in st.items():
        fmt = family.state[key]
        if fmt.format in ("step", "absmax"):
            continue
        out[key] = (fmt.codec.dequantize_blockwise(value, st[f"{key}_absmax"], fmt.signed, shape) if _is_codes(value)
                    else value.float())
    return out


def _convert(state: dict, src: Family, dst: Family, optimizer, impl, saved_ids: list) -> dict[str, list[str]]:
    """Convert ``state`` (canonical, ``src``'s) in place to ``dst``'s format for ``optimizer``'s parameters: tensors
    both keep are carried over (quantized where ``impl``, the backend, keeps 8-bit state; cast to ``dst``'s moment
    dtype), tensors only ``dst`` keeps start at zero, tensors only ``src`` keeps are dropped.
    Returns what was done -> names of the tensors it was done to ("" for tensors whose format did not change)."""
    done: dict[str, list[str]] = {}
    keeps_8bit = impl.keeps_8bit(optimizer) if dst.quantized and impl.keeps_8bit else None
    i = 0
    for gi, group in enumerate(optimizer.param_groups):
        names = group_names(group, gi)
        for pi, (p, pname) in enumerate(zip(group["params"], names)):
            pid, i = saved_ids[i], i + 1
            st = state.get(pid)
            if st is None:
                continue
            values, out, actions = _decoded(src, st, _sharded.global_shape(p)), {"step": st["step"]}, []
            if any(_is_codes(v) for v in st.values()):
                actions.append(f"{src.codec.BITS}-bit moments dequantized")
            quantize = keeps_8bit is not None and keeps_8bit(gi, pi, p)
            dtype = dst.moment_dtype(p) if dst.moment_dtype else torch.float32
            cast = {str(v.dtype).removeprefix("torch.") for k, v in st.items() if k in values and not _is_codes(v)
                    and v.dtype != dtype}
            for key in sorted(dst.required(p, group) - {"step"}, key=list(dst.state).index):
                fmt = dst.state[key]
                if key not in values:
                    out[key] = torch.zeros_like(p, dtype=dtype)
                    actions.append(f"{fmt.label or key} started at zero")
                elif quantize and fmt.format == "codes":  # an FSDP2 shard's whole, then its rows (as _requantized)
                    codes, out[f"{key}_absmax"] = fmt.codec.quantize_blockwise(_sharded.whole(values[key]), fmt.signed)
                    out[key] = _sharded.shard_like(p, codes.reshape(fmt.codec.canonical_shape(p.shape)))
                else:  # adamw: torch casts fp32 moments to the parameter's dtype itself
                    out[key] = values[key].to(dtype)
            if quantize:
                actions.append(f"moments quantized to {dst.codec.BITS}-bit (lossy: within the codec's rounding)")
            elif dst.moment_dtype and cast:
                actions.append(f"moments cast from {', '.join(sorted(cast))} to {dtype}".replace("torch.", ""))
            actions += [f"{src.state[k].label or k} dropped" for k in values if k not in out]
            for action in actions or [""]:
                done.setdefault(action, []).append(pname)
            state[pid] = out
    return done


def _without_template_absmax(st: dict) -> dict:
    """``st`` (a sharded parameter's) less absmaxes beside floating-point moments. DCP's full-state loader
    (``set_optimizer_state_dict``) fills the keys a saved state lacks from the optimizer's own state, so fp32 moments
    saved for a tensor these shards keep 8-bit arrive beside the shards' current absmaxes: not the checkpoint's, and
    meaningless beside full-precision values (:func:`_match_precision` then quantizes the moments). A single-file
    load gets exactly what its file holds, so there an absmax beside fp32 moments is still refused as corrupt."""
    stale = [f"{k}_absmax" for k, v in st.items() if torch.is_tensor(v) and v.is_floating_point()
             and f"{k}_absmax" in st]
    return {k: v for k, v in st.items() if k not in stale} if stale else st


def _match_precision(state: dict, optimizer, spec, backend: str, saved_ids: list) -> None:
    """Saved state of the loader's own family whose 8-bit / fp32 choice differs from this optimizer's, converted in
    place: 8-bit codes dequantized where the tensor keeps fp32, fp32 moments quantized (canonical blocks, as a kernel
    stores them: the only lossy direction) where it keeps 8-bit. The choices differ between one process and FSDP2
    (rows of whole blocks, :func:`.optim.facts.keeps_quantized_state`), between backends (torchao's whole-block rule) and
    thresholds. An FSDP2 state is converted whole (gathered: every rank loads, in the same order) and re-sharded
    like its parameter. One warning names the tensors."""
    impl = spec.backends[backend]
    if not spec.facts.quantized or impl.keeps_8bit is None:
        return
    keeps, ids, done = impl.keeps_8bit(optimizer), iter(saved_ids), {}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, (p, pname) in enumerate(zip(group["params"], group_names(group, gi))):
            pid = next(ids)
            st = state.get(pid)
            codes = _codes(spec.facts, st) if isinstance(st, dict) else []
            if not codes or _is_codes(st[codes[0]]) == keeps(gi, pi, p):
                continue
            to_8bit = not _is_codes(st[codes[0]])
            state[pid] = _requantized(spec.facts, st, codes, p, to_8bit)
            done.setdefault(to_8bit, []).append(pname)
    bits = spec.facts.codec.BITS
    said = {False: f"{bits}-bit state for {{n}} tensor(s) that this backend keeps in full precision, dequantized to "
                   "fp32 (exact: the values the codes stand for)",
            True: f"fp32 state for {{n}} tensor(s) that this backend keeps in {bits} bits, quantized (lossy: within "
                  "the codec's rounding)"}
    if done:
        logger.warning("%s (backend %s): the checkpoint's 8-bit / fp32 choice differs from this optimizer's (one "
                       "process and FSDP2 shards, backends and thresholds choose differently); converted %s",
                       spec.trainer_name, backend, "; ".join(
                           f"{said[q].format(n=len(names))}: {', '.join(names[:8])}{', ...' * (len(names) > 8)}"
                           for q, names in done.items()))


def _requantized(family: Family, st: dict, codes: list[str], p: torch.Tensor, to_8bit: bool) -> dict:
    """``st`` with its moments ``codes`` quantized (``to_8bit``) or dequantized, whole, placed like ``p``: codes of
    ``p``'s shape with whole ``(blocks,)`` absmaxes (the optimizer's load places those), or fp32 moments."""
    out = {k: v for k, v in st.items() if k not in codes and family.state[k].format != "absmax"}
    for key in codes:
        fmt, value = family.state[key], _sharded.whole(st[key])
        if to_8bit:
            out[key], out[f"{key}_absmax"] = fmt.codec.quantize_blockwise(value.float(), fmt.signed)
            out[key] = _sharded.shard_like(p, out[key])
        else:
            absmax = _sharded.whole(st[f"{key}_absmax"]).reshape(-1)
            out[key] = _sharded.shard_like(p, fmt.codec.dequantize_blockwise(value, absmax, fmt.signed,
                                                                             _sharded.global_shape(p)))
    return out


def _place_whole(state: dict, family: Family, saved_ids: list, params: list) -> None:
    """Whole (plain) state tensors of FSDP2 parameters, a single-file state loaded into shards, placed in place as the
    family makes its own: sharded like the parameter's rows, except a matrix's column statistics (Adafactor's: sums
    over every rank's rows), whole on every rank. Absmaxes are placed by the family's load, step counts stay plain."""
    for pid, p in zip(saved_ids, params):
        st = state.get(pid)
        if not _sharded.is_sharded(p) or not isinstance(st, dict):
            continue
        for key, value in st.items():
            fmt = family.state[key].format
            if fmt in ("step", "absmax") or not torch.is_tensor(value) or _sharded.is_sharded(value):
                continue
            st[key] = (_sharded.replicate_like(p, value) if fmt == "col" and p.dim() == 2
                       else _sharded.shard_like(p, value))


def _describe(tag, libraries: set, src: Family) -> str:
    if tag is not None:
        return f"hf_eff_{tag.get('name')} ({src.name} state, backend {tag.get('backend')})"
    if src is PLAIN:
        return "an untagged fp32 AdamW (e.g. torch.optim.AdamW, transformers' adamw_torch) state"
    libs = sorted(lib for lib in libraries if lib)
    return f"an untagged {' / '.join(libs) + ' ' if libs else ''}{src.name} state"


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
    """The backend's state dict ``sd`` in the canonical layout, tagged with what wrote it: at the top level, and in
    each param group with a record of which of its parameters' state is 8-bit codes (``eight_bit``: "1" or "0" per
    parameter, a string: torch's state-dict utilities flatten lists element by element and drop empty ones).
    torch.distributed.checkpoint keeps only the groups, and its loader reads a checkpoint into the loading optimizer's
    own state dict (its keys and dtypes): the groups' tag says what was saved, and the record what was cast."""
    state = to_canonical(spec, backend, sd["state"])
    tag = {"name": spec.name, "family": spec.family, "backend": backend, "format": FORMAT,
           "skipped_steps": info.skipped_steps, "steps": info.steps}
    groups = [dict(g, **{_TAG: dict(tag, eight_bit="".join("01"[_holds_codes(spec.facts, state.get(pid))]
                                                            for pid in g["params"]))})
              for g in groups_to_canonical(sd["param_groups"])]
    return dict(sd, state=state, param_groups=groups, **{_TAG: tag})


def _holds_codes(family: Family, st) -> bool:
    codes = _codes(family, st) if isinstance(st, dict) else []
    return bool(codes) and _is_codes(st[codes[0]])


def _recorded_8bit(sd: dict, tag: dict | None) -> set | None:
    """The saved ids whose state was written as 8-bit codes, by the record in each param group's tag (None where the
    groups carry none: untagged, or written before they did). Raises ValueError where a group's tag is malformed or,
    without a top-level tag, the groups' tags differ."""
    groups = sd["param_groups"]
    tags = [g.get(_TAG) for g in groups]
    if all(t is None for t in tags):
        return None
    recorded = set()
    for gi, (g, t) in enumerate(zip(groups, tags)):
        record = t.get("eight_bit") if isinstance(t, dict) else None
        if (not isinstance(record, str) or len(record) != len(g["params"]) or set(record) - {"0", "1"}
                or _TAG not in sd and {k: v for k, v in t.items() if k != "eight_bit"} != tag):
            raise ValueError(f"param group {gi} of the loaded optimizer state has the tag {t!r}: not the other groups' "
                             f"with a 0 or 1 for each of its {len(g['params'])} parameters. The checkpoint is corrupt "
                             "or was edited")
        recorded.update(pid for pid, bit in zip(g["params"], record) if bit == "1")
    return recorded


def _check_not_cast(sd: dict, tag: dict | None, saved_ids: list, param_names: list[str], trainer_name: str) -> None:
    """Refuse states that the record of their groups' tag says were saved as 8-bit codes but that arrived as
    floating-point moments with no absmaxes: what torch.distributed.checkpoint's ``dcp.load`` gives where the loading
    optimizer keeps the tensor's state in fp32 (it reads into the loader's own state dict: the codes cast to its
    dtype, the scales it does not hold left unread). Nothing can restore them; its planner reads them as saved."""
    recorded = _recorded_8bit(sd, tag)
    if recorded is None:
        return
    family = families()[tag["family"]]
    cast = []
    for pid, pname in zip(saved_ids, param_names):
        st = sd["state"].get(pid)
        codes = _codes(family, st) if pid in recorded and isinstance(st, dict) else []
        if codes and not _is_codes(st[codes[0]]) and f"{codes[0]}_absmax" not in st:
            cast.append(pname)
    if cast:
        raise ValueError(
            f"{trainer_name}: the loaded state of {', '.join(cast[:8])}{', ...' * (len(cast) > 8)} was saved as 8-bit "
            "codes but arrived as floating-point numbers without their scales. torch.distributed.checkpoint's dcp.load "
            "reads a checkpoint into the loading optimizer's own state dict, which keeps these tensors in fp32 "
            "(min_8bit_size, embedding_state or the backend differ from the run that saved it): it cast the codes and "
            "left the scales unread. Load it with dcp.load(..., planner=hf_efficient.checkpoint.LoadPlanner()), which "
            "reads what the checkpoint holds (then converted as a single-file state is), or resume with the saved "
            "run's settings. Nothing was loaded, but dcp.load wrote what it read into the state tensors that state "
            "dict shares with the optimizer: rebuild the optimizer before training on")


def load(optimizer, load_state_dict, sd: dict, spec, backend: str, info, param_names: list[str]) -> None:
    """Validate ``sd`` against ``optimizer`` (a tagged canonical dict, or an untagged one in any layout this module
    reads), convert it to ``backend``'s format and layout, and hand it to the backend's ``load_state_dict``.
    Nothing is changed unless every check passed."""
    from .options import check_flags

    tag = tag_of(sd)
    _check_tag(tag, spec.facts, spec.name)
    live = optimizer.param_groups
    params = [p for g in live for p in g["params"]]
    saved = _check_structure(sd, live, spec.name)
    saved_ids = [pid for g in saved for pid in g["params"]]
    _check_not_cast(sd, tag, saved_ids, param_names, spec.trainer_name)
    state, libraries, relabelled = {}, set(), []
    for pid, pname, p in zip(saved_ids, param_names, params):
        st = sd["state"].get(pid)
        if isinstance(st, dict) and not st:
            continue  # no state yet: as if absent
        if isinstance(st, dict) and _sharded.is_sharded(p):
            st = _without_template_absmax(st)
        if tag is None and isinstance(st, dict):
            try:
                st, library = _any_to_canonical(st, spec.facts)
            except ValueError as e:
                raise ValueError(f"the state of parameter {pname!r}: {e}") from None
            libraries.add(library)
            relabelled += [pname] if library else []
        if st is not None:
            state[pid] = dict(st) if isinstance(st, dict) else st  # the caller's dict stays as it was
    src = families()[tag["family"]] if tag is not None else _untagged_family(
        {k: v for k, v in state.items() if isinstance(v, dict)}, libraries, spec.facts)
    if not _convertible(src.name, spec.family):
        raise ValueError(f"this optimizer state holds {src.name} state and cannot be loaded into {spec.trainer_name}: "
                         "it was written by another optimizer. Resume with the optimizer that wrote it, or start the "
                         "optimizer afresh (remove optimizer.pt from the checkpoint)")
    validate(dict(sd, state=state, param_groups=saved), src, spec.name, param_names, params, live)
    for st in state.values():  # a number (torch accepts one) or a one-element tensor: the kernels' scalar tensor
        st["step"] = torch.as_tensor(st["step"], dtype=torch.float32).detach().reshape(()).clone()
    if src is not spec.facts:
        saved = _convert_groups(saved, src.name, spec.trainer_name)
    groups = groups_from_canonical(backend, saved, live)
    for g in groups:
        check_flags(g, optimizer.defaults, spec.trainer_name)
    if src is not spec.facts:
        done = _convert(state, src, spec.facts, optimizer, spec.backends[backend], saved_ids)
    else:  # a library's own layout (bitsandbytes, torchao) relabelled to the canonical one: the same numbers
        done = {"layout relabelled (8-bit: the same codes and scales; torchao's 4-bit: the values it decodes to)":
                relabelled} if relabelled else {}
    if set(done) - {""}:
        logger.warning("%s: the loaded optimizer state was written by %s; converted it to %s's format: %s",
                       spec.trainer_name, _describe(tag, libraries, src), spec.trainer_name, "; ".join(
                           f"{action or 'format unchanged'}: {len(names)} tensor(s) ({', '.join(names[:4])}"
                           f"{', ...' if len(names) > 4 else ''})" for action, names in done.items()))
    drop_unused_buffers(optimizer, spec.trainer_name, {p: state[pid] for pid, p in zip(saved_ids, params)
                                                        if pid in state})
    if src is spec.facts:  # another family's state was converted above, and said so
        _match_precision(state, optimizer, spec, backend, saved_ids)
    _place_whole(state, spec.facts, saved_ids, params)
    native = from_canonical(spec, backend, state, {pid: p for pid, p in zip(saved_ids, params)})
    plain = {k: v for k, v in sd.items() if k != _TAG}
    load_state_dict(dict(plain, state=native, param_groups=groups))
    if tag is not None:
        info.skipped_steps, info.steps = tag.get("skipped_steps", 0), tag.get("steps", 0)


# --- torch.distributed.checkpoint: reading what a checkpoint holds ----------------------------------------------


def __getattr__(name: str):
    if name == "LoadPlanner":  # made when first asked for: importing torch.distributed.checkpoint costs
        globals()[name] = _load_planner_class()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _load_planner_class() -> type:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class LoadPlanner(DefaultLoadPlanner):
        """torch.distributed.checkpoint's ``DefaultLoadPlanner``, except that every optimizer state dict in what
        ``dcp.load`` fills is first made to ask for what the checkpoint holds: its keys, dtypes and sizes, per
        parameter and per param group. DCP's own planner reads a checkpoint into the loading optimizer's state dict
        (its keys and dtypes), so a state saved under other settings or by another optimizer arrives cast, or fails
        on a key the checkpoint lacks; read as saved, ``set_optimizer_state_dict`` then converts it, or refuses it,
        exactly as a single-file state (:func:`load`). Tensors it adds are placed like the parameter's state where
        their rows are the parameter's, whole on every rank otherwise (what :func:`load` places).

        Example::

            sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
            dcp.load(sd, checkpoint_id=path, planner=hf_efficient.checkpoint.LoadPlanner())
            set_model_state_dict(model, sd["model"])
            set_optimizer_state_dict(model, optimizer, sd["optim"])
        """

        def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
            if metadata is not None:
                _ask_for_saved(state_dict, metadata.state_dict_metadata, "")
            super().set_up_planner(state_dict, metadata, is_coordinator)

    LoadPlanner.__module__ = __name__
    return LoadPlanner


def _ask_for_saved(nested: dict, saved: dict, prefix: str) -> None:
    """Each optimizer state dict in ``nested`` (whose flattened keys start with ``prefix``) rewritten in place to
    the keys, dtypes and sizes ``saved`` (the checkpoint's metadata, by flattened key) holds for it."""
    for key, value in nested.items():
        if not isinstance(value, dict):
            continue
        if isinstance(value.get("state"), dict) and isinstance(value.get("param_groups"), list):
            _as_saved(value, saved, f"{prefix}{key}.")
        else:
            _ask_for_saved(value, saved, f"{prefix}{key}.")


def _as_saved(osd: dict, saved: dict, prefix: str) -> None:
    """``osd``'s per-parameter states and param groups made to ask for what ``saved`` holds under ``prefix``."""
    held: dict[str, dict] = {}  # parameter (fqn) -> state key -> metadata
    groups: dict[int, dict] = {}  # index -> the group's entries, nested as saved (the tag is a dict)
    states, group_head = f"{prefix}state.", f"{prefix}param_groups."
    for key, m in saved.items():
        if key.startswith(states):
            fqn, _, name = key[len(states):].rpartition(".")  # state keys hold no dots; fqns may
            held.setdefault(fqn, {})[name] = m
        elif key.startswith(group_head):
            index, _, path = key[len(group_head):].partition(".")
            if index.isdigit() and path:
                node = groups.setdefault(int(index), {})
                *parents, last = path.split(".")
                for part in parents:
                    node = node.setdefault(part, {})
                node[last] = _placeholder(m, None, {})
    for fqn, st in list(osd["state"].items()):
        if fqn not in held:
            del osd["state"][fqn]  # nothing saved for it: as a single-file state without it
        elif isinstance(st, dict):
            osd["state"][fqn] = {k: _placeholder(m, st.get(k), st) for k, m in held[fqn].items()}
    osd["param_groups"][:] = [groups.get(i, {}) for i in range(max(groups) + 1)] if groups else []


def _placeholder(m, template, state: dict):
    """What DCP reads a saved entry with metadata ``m`` into: ``template`` where it is a tensor of the saved dtype
    and size; else a tensor of those, placed like ``template`` (same size), or sharded like a state tensor of
    ``state`` whose rows it shares, or whole; None for a saved object (DCP replaces it)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not isinstance(m, TensorStorageMetadata):
        return None
    size, dtype = torch.Size(m.size), m.properties.dtype
    if torch.is_tensor(template) and template.shape == size and template.dtype == dtype:
        return template
    shards = [t for t in state.values() if _sharded.is_sharded(t)]
    ref = template if _sharded.is_sharded(template) and template.shape == size else next(
        (t for t in shards if len(size) and t.dim() and t.shape[0] == size[0] and _sharded.sharded_by_rows(t)), None)
    if ref is not None:  # placed as ref is (its rows split, or whole on every rank)
        return _sharded.zeros(ref, size, dtype)
    device = _sharded.local(shards[0]).device if shards else next(
        (t.device for t in state.values() if torch.is_tensor(t)), torch.device("cpu"))
    return torch.zeros(size, dtype=dtype, device=device)
