"""Weight-decay groups decided per parameter, by the module that owns it; and Muon's share of them.

Decay shrinks weights toward zero; that regularises matrices but only harms normalisation gains and
biases, which set a scale or an offset. So: no decay for every parameter of a normalisation layer
(torch's, transformers' ``LlamaRMSNorm`` / ``T5LayerNorm`` / ..., a user's ``MyNorm``) and for biases;
embeddings are decayed unless ``decay_embeddings=False``. Frozen parameters are left out, and a tied
weight appears once.

Muon orthogonalises the updates of hidden matrices; the input embeddings, the output head, gains and biases go to
AdamW (Keller Jordan's guidance, Moonlight's practice). :func:`split_muon` decides which is which, by module as well
(see there), and :func:`build_muon_param_groups` cuts the decay groups along it.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["DecaySplit", "split_parameters", "build_param_groups", "is_norm_module", "group_names", "named_params",
           "MuonSplit", "split_muon", "build_muon_param_groups", "MuonPatterns"]

logger = logging.getLogger(__name__)

_TORCH_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase, nn.RMSNorm)
# Class names of norm layers: "LayerNorm", "RMSNorm", "T5LayerNorm", "LlamaRMSNorm", "ScaleNorm", "BatchNorm1d".
_NORM_NAME = re.compile(r"norm(\d+d)?$", re.IGNORECASE)
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def is_norm_module(module: nn.Module) -> bool:
    """True for torch's norm layers and any class whose name ends in "Norm" (transformers', a user's)."""
    return isinstance(module, _TORCH_NORMS) or any(_NORM_NAME.search(c.__name__) for c in type(module).__mro__[:-2])


@dataclass
class DecaySplit:
    """Which trainable parameters get weight decay, by name, with the reason for each exclusion."""

    decay: list[str] = field(default_factory=list)
    no_decay: list[str] = field(default_factory=list)
    embeddings: list[str] = field(default_factory=list)  # embedding matrices, decayed or not
    reasons: dict[str, str] = field(default_factory=dict)  # no-decay name -> "norm" | "bias" | "embedding"
    params: dict[str, nn.Parameter] = field(default_factory=dict, repr=False)

    def numel(self, names: list[str]) -> int:
        return sum(self.params[n].numel() for n in names)

    def summary(self) -> str:
        return (f"decay: {len(self.decay)} tensors / {self.numel(self.decay):,} params; "
                f"no decay: {len(self.no_decay)} tensors / {self.numel(self.no_decay):,} params")


def _owners(model: nn.Module) -> dict[int, list[tuple[str, str, nn.Module]]]:
    """``id(parameter)`` -> every ``(module name, attribute, module)`` holding it (a tied weight has several)."""
    owners: dict[int, list[tuple[str, str, nn.Module]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod_name, attr, module))
    return owners


def split_parameters(model: nn.Module, decay_embeddings: bool = True) -> DecaySplit:
    """Classify every trainable parameter of ``model`` once (tied weights by their first name)."""
    owners = _owners(model)
    split = DecaySplit()
    for name, p in model.named_parameters():  # remove_duplicate=True: a tied weight once
        if not p.requires_grad:
            continue
        split.params[name] = p
        uses = owners.get(id(p), [])
        if any(isinstance(m, _EMBEDDINGS) for _, _, m in uses):
            split.embeddings.append(name)
            reason = None if decay_embeddings else "embedding"
        elif any(is_norm_module(m) for _, _, m in uses):
            reason = "norm"
        elif any(attr == "bias" or attr.endswith("_bias") for _, attr, _ in uses) or name.endswith("bias"):
            reason = "bias"
        else:
            reason = None
        if reason is None:
            split.decay.append(name)
        else:
            split.no_decay.append(name)
            split.reasons[name] = reason
    return split


def build_param_groups(model: nn.Module, weight_decay: float = 0.0, decay_embeddings: bool = True,
                       split: DecaySplit | None = None) -> list[dict]:
    """Two param groups, decay and no-decay, for any torch optimizer.

    Args:
        model: the model whose trainable parameters are grouped.
        weight_decay: decay of the first group (the second has 0.0).
        decay_embeddings: whether embedding matrices are decayed (transformers: yes).
        split: a precomputed :func:`split_parameters` result, to avoid walking the model twice.

    Returns:
        ``[{"params", "param_names", "weight_decay"}, ...]``, empty groups dropped. ``param_names`` lets
        torch (>= 2.6) and our error messages name parameters.
    """
    split = split or split_parameters(model, decay_embeddings)
    logger.info("hf_efficient weight decay %s: %s", weight_decay, split.summary())
    groups = []
    for names, wd in ((split.decay, weight_decay), (split.no_decay, 0.0)):
        if names:
            groups.append({"params": [split.params[n] for n in names], "param_names": list(names), "weight_decay": wd})
    if not groups:
        raise ValueError(f"{type(model).__name__} has no trainable parameters (all are frozen or it has none)")
    return groups


# Muon's share ---------------------------------------------------------------------------------------------------

_CONTAINERS = (nn.ModuleList, nn.Sequential)
# AdamW's reasons, in the order they are decided (the first that applies is recorded)
MUON_REASONS = ("muon_exclude", "embedding", "output head", "norm", "bias", "not 2-D", "not a linear layer in a block")


def _is_linear(module: nn.Module) -> bool:
    """``nn.Linear`` (and its subclasses), or transformers' ``Conv1D`` (GPT-2), known by its class name: the core
    never imports transformers. ``Conv1D`` keeps its weight as ``(in, out)``, the transpose of ``nn.Linear``'s."""
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _is_conv1d(module: nn.Module) -> bool:
    return any(c.__name__ == "Conv1D" for c in type(module).__mro__[:-2])  # torch's nn.Conv1d: another name


def _inside_blocks(model: nn.Module) -> set[str]:
    """Names of the modules strictly inside an element of an ``nn.ModuleList`` / ``nn.Sequential``: the repeated
    blocks of every transformers model (``model.layers``, ``transformer.h``, ``encoder.layer``, T5's ``block``). An
    element itself (a ``Linear`` directly in a ``Sequential``: an MLP's input or output layer) is not inside one."""
    inside = set()
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, _CONTAINERS):
            for child_name, child in module.named_children():
                prefix = f"{name}.{child_name}" if name else child_name
                inside.update(f"{prefix}.{sub}" for sub, _ in child.named_modules(remove_duplicate=False) if sub)
    return inside


def _output_head(model: nn.Module) -> set[int]:
    """``id`` of the output head's parameters (``get_output_embeddings()``, where the model has it)."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except (AttributeError, NotImplementedError):  # transformers' base class raised where a model has no head
        head = None
    return {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()


def _patterns(value, option: str) -> list[str]:
    """``muon_include`` / ``muon_exclude``: None, fnmatch patterns separated by ``|`` (``optim_args`` text, whose
    options are separated by commas), or a sequence of patterns."""
    if value is None:
        return []
    if isinstance(value, str):
        value = value.split("|")
    patterns = [str(v).strip() for v in value]
    if any(not p for p in patterns):
        raise ValueError(f"{option}={value!r}: an empty pattern; give fnmatch patterns of parameter names separated "
                         "by '|', e.g. '*.q_proj.weight|*.k_proj.weight'")
    return patterns


@dataclass(frozen=True)
class MuonPatterns:
    """``muon_include`` / ``muon_exclude`` parsed: what they decide of a parameter, before the rule of
    :func:`split_muon` (and the memory estimate, which applies them to a model described once) decides the rest."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    @classmethod
    def parse(cls, muon_include=None, muon_exclude=None) -> "MuonPatterns":
        return cls(tuple(_patterns(muon_include, "muon_include")), tuple(_patterns(muon_exclude, "muon_exclude")))

    def check(self, named: list[tuple[str, int]], owner: str) -> None:
        """Refuse a pattern that matches nothing it could apply to in ``named`` ((name, ndim) of the trainable
        parameters of ``owner``, a model's class name): a misspelt name would otherwise change nothing, silently."""
        for option, patterns, matrices_only in (("muon_include", self.include, True),
                                                ("muon_exclude", self.exclude, False)):
            candidates = [n for n, ndim in named if ndim == 2 or not matrices_only]
            for pattern in patterns:
                if not any(fnmatch.fnmatchcase(n, pattern) for n in candidates):
                    what = "2-D trainable parameter" if matrices_only else "trainable parameter"
                    sample = ", ".join(candidates)
                    raise ValueError(f"{option}: pattern {pattern!r} matches no {what} of {owner} (fnmatch on full "
                                     f"names such as: {sample[:300]}{'...' if len(sample) > 300 else ''})")

    def decide(self, name: str, ndim: int) -> bool | None:
        """False: AdamW (an exclusion, which wins); True: Muon (a 2-D parameter an inclusion names); None: neither
        says, the rule decides."""
        if any(fnmatch.fnmatchcase(name, pat) for pat in self.exclude):
            return False
        if ndim == 2 and any(fnmatch.fnmatchcase(name, pat) for pat in self.include):
            return True
        return None


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@dataclass
class MuonSplit:
    """Which trainable parameters Muon steps, by name; the rest go to AdamW, each with its reason
    (:data:`MUON_REASONS`)."""

    muon: list[str] = field(default_factory=list)
    adamw: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)  # AdamW name -> reason
    transposed: list[str] = field(default_factory=list)  # Muon names stored (in, out): transformers' Conv1D
    params: dict[str, nn.Parameter] = field(default_factory=dict, repr=False)

    def bytes(self, names: list[str]) -> int:
        return sum(self.params[n].numel() * self.params[n].element_size() for n in names)

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for reason in self.reasons.values():
            counts[reason] = counts.get(reason, 0) + 1
        why = ", ".join(f"{r} {counts[r]}" for r in MUON_REASONS if r in counts)
        numel = lambda names: sum(self.params[n].numel() for n in names)  # noqa: E731
        return (f"Muon: {len(self.muon)} matrices / {numel(self.muon):,} params ({_mib(self.bytes(self.muon))}); "
                f"AdamW: {len(self.adamw)} tensors / {numel(self.adamw):,} params ({_mib(self.bytes(self.adamw))})"
                + (f" ({why})" if why else ""))


def split_muon(model: nn.Module, muon_include=None, muon_exclude=None, decay: DecaySplit | None = None) -> MuonSplit:
    """Muon's parameters and AdamW's, decided by the module that owns each trainable parameter.

    Muon takes the 2-D ``weight`` of every ``nn.Linear`` (or transformers' ``Conv1D``, whose ``(in, out)`` weight is
    the transpose: orthogonalisation commutes with transposition, so it is stepped as stored) that lies inside a
    block: strictly inside an element of an ``nn.ModuleList`` or ``nn.Sequential``. AdamW takes the rest: the input
    embeddings (any parameter an ``nn.Embedding`` holds, a tied head included), the output head
    (``get_output_embeddings()``; heads outside the blocks, such as a classifier or pooler, are not in a block
    either), norm gains, biases, anything not 2-D. A model without such containers (a plain ``nn.Sequential`` of
    ``Linear`` layers: its elements are its input and output layers) gives Muon nothing unless told.

    Args:
        muon_include: fnmatch patterns of parameter names (``"*.mlp.*|blocks.*.weight"``, or a list) whose 2-D
            parameters Muon takes whatever the rule says; each must match a 2-D trainable parameter.
        muon_exclude: patterns of names AdamW takes; each must match a trainable parameter. Exclusion wins.
        decay: the model's :func:`split_parameters` (its embeddings, norms and biases), if already made.

    Raises:
        ValueError: a pattern that matches nothing it could apply to (a misspelt name), naming a few names.
    """
    patterns = MuonPatterns.parse(muon_include, muon_exclude)
    decay = decay or split_parameters(model)
    owners, inside, head = _owners(model), _inside_blocks(model), _output_head(model)
    named = list(decay.params.items())  # trainable, a tied weight once (by its first name)
    embeddings = set(decay.embeddings)
    patterns.check([(n, p.ndim) for n, p in named], type(model).__name__)
    split = MuonSplit()
    for name, p in named:
        split.params[name] = p
        uses = owners.get(id(p), [])
        said = patterns.decide(name, p.ndim)
        if said is False:
            reason = "muon_exclude"
        elif said:
            reason = None
        elif name in embeddings:
            reason = "embedding"
        elif id(p) in head:
            reason = "output head"
        elif decay.reasons.get(name) in ("norm", "bias"):
            reason = decay.reasons[name]
        elif p.ndim != 2:
            reason = "not 2-D"
        elif not any(attr == "weight" and _is_linear(m) and m_name in inside for m_name, attr, m in uses):
            reason = "not a linear layer in a block"
        else:
            reason = None
        if reason is None:
            split.muon.append(name)
            if any(attr == "weight" and _is_conv1d(m) for _, attr, m in uses):
                split.transposed.append(name)
        else:
            split.adamw.append(name)
            split.reasons[name] = reason
    return split


def build_muon_param_groups(model: nn.Module, weight_decay: float = 0.0, decay_embeddings: bool = True,
                            muon_include=None, muon_exclude=None, split: DecaySplit | None = None) -> list[dict]:
    """:func:`build_param_groups`' decay groups, each cut in two along :func:`split_muon`: the Muon groups first
    (``"muon": True``), then AdamW's (``"muon": False``), empty ones dropped; each with ``param_names`` and its
    ``weight_decay``. A Muon group holds matrices stored as ``nn.Linear``'s ``(out, in)`` or, marked
    ``"transposed": True``, as transformers' ``Conv1D``'s ``(in, out)`` (``adjust_lr="original"`` scales by the
    output features), never both. The split is logged once (counts and bytes), and a warning says when Muon gets
    nothing. ``split``: the model's :func:`split_parameters` under ``decay_embeddings``, if already made."""
    decay = split or split_parameters(model, decay_embeddings)
    muon = split_muon(model, muon_include, muon_exclude, decay)
    (logger.warning if not muon.muon else logger.info)(
        "hf_efficient Muon split: %s%s", muon.summary(),
        "" if muon.muon else ": Muon steps nothing; it takes the linear layers inside blocks (elements of an "
        "nn.ModuleList / nn.Sequential) and what muon_include names")
    groups = build_param_groups(model, weight_decay, decay_embeddings, split=decay)
    chosen, transposed = set(muon.muon), set(muon.transposed)
    out = []
    for use_muon, flip in ((True, False), (True, True), (False, False)):
        for g in groups:
            names = [n for n in g["param_names"] if (n in chosen) == use_muon and (n in transposed) == flip]
            if names:
                out.append({"params": [muon.params[n] for n in names], "param_names": names,
                            "weight_decay": g["weight_decay"], "muon": use_muon,
                            **({"transposed": flip} if use_muon else {})})
    return out


def param_device(params) -> torch.device:
    """The one device of ``params``; parameters on several devices are refused (one step cannot span them)."""
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"parameters are on several devices {sorted(map(str, devices))}: move the model to one "
                         "device before creating the optimizer (or create one optimizer per device)")
    return devices.pop()


def group_names(group: dict, gi: int, count: int | None = None) -> list[str]:
    """The names of param group ``gi``'s parameters, for messages and matching: its ``param_names`` (torch >= 2.6
    records them; ours always set them), else ``group{gi}.param{i}`` (``count`` of them: default, its params)."""
    return list(group.get("param_names") or
                [f"group{gi}.param{i}" for i in range(len(group["params"]) if count is None else count)])


def named_params(groups) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of every parameter of ``groups`` (an optimizer's ``param_groups``), in order."""
    return [pair for gi, g in enumerate(groups) for pair in zip(group_names(g, gi), g["params"])]
