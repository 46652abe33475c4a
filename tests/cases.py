"""The cross-cutting tests' cases, generated from the registry: a new name or backend is covered without editing them.

:func:`cases` gives ``(name, backend, dtype, compensation)`` for every registered name that has backends of its own
(not ``auto``, which picks one of them) and runs on the device itself (not a name that falls back elsewhere), crossed
with each of its backends that serves the device. ``dtype`` is the family's parameter dtype (bf16 for the bf16 name);
``compensation`` is ``"auto"``, the family's default. A backend whose package is missing stays in the list, skipped,
with the reason the registry gives (the pip extra to install).

:func:`names` gives the names a test of one concern runs, by what the registry says of them (:func:`quantized`,
:func:`c_kernel`, ...), never by a list typed in the test.

Both include docs/contributing.md's example family (tests/example_family.py), marked ``example_family``: the fixture
of tests/conftest.py registers it for the test that takes it and unregisters it after. Tests whose work leaves this
process take it too where they register it there (the FSDP2 ranks of tests/fsdp_helpers.py; a Trainer's
transformers-side name list takes a name registered late); scripts launched by ``accelerate launch`` take
:func:`packaged` names only.
"""

from __future__ import annotations

import pytest
import torch

from example_family import SPEC as EXAMPLE
from hf_efficient.optim._blockwise import Blockwise8bit
from hf_efficient.registry import SPECS


def specs() -> list:
    """Every registered spec, then the example family's."""
    return [*SPECS.values(), *([EXAMPLE] if EXAMPLE.name not in SPECS else [])]


def spec_of(name: str):
    """The spec of ``name`` among :func:`specs` (the example family's too, registered or not)."""
    return next(s for s in specs() if s.name == name)


def _marks(spec, impl=None, device: str = "cpu") -> list:
    why = impl.why_not(device) if impl is not None else None
    return ([pytest.mark.skip(reason=why)] if why else []) + (
        [pytest.mark.example_family] if spec is EXAMPLE else [])


def case_id(name: str, backend: str, dtype: torch.dtype, compensation: str = "auto") -> str:
    dt = str(dtype).removeprefix("torch.")
    return "-".join([name, backend, dt] + ([compensation] if compensation != "auto" else []))


def cases(device: str = "cpu", *, dtypes: tuple[torch.dtype, ...] | None = None,
          compensations: tuple[str, ...] = ("auto",), names=None, where=None) -> list:
    """``pytest.param(name, backend, dtype, compensation)`` per runnable name x backend serving ``device`` (x each of
    ``dtypes`` the name takes, default: the family's parameter dtype; x ``compensations``, which apply to bf16/fp16
    weights only, so fp32 cases take ``"auto"`` once); ``names`` / ``where(spec)``: only those names."""
    out = []
    for spec in specs():
        if not spec.backends or spec.fallback or (names is not None and spec.name not in names) or (
                where is not None and not where(spec)):
            continue
        for backend, impl in spec.backends.items():
            if not impl.serves(device):
                continue
            for dtype in dtypes or (spec.facts.param_dtype,):
                if dtype not in spec.dtypes:
                    continue
                low = dtype in (torch.bfloat16, torch.float16)
                for comp in compensations if low else ("auto",):
                    if low and comp != "none" and not impl.compensates:
                        continue  # refused by resolve(): it would round every update to nearest
                    out.append(pytest.param(spec.name, backend, dtype, comp, marks=_marks(spec, impl, device),
                                            id=case_id(spec.name, backend, dtype, comp)))
    return out


def cls_of(spec) -> type:
    """The class its torch backend builds (torch's AdamW for hf_eff_adamw's fp32 weights)."""
    return spec.backends["torch"].build.optimizer_cls()


def names(*where) -> list:
    """``pytest.param(name)`` of every runnable name with a torch backend (this package's or torch's own class) for
    which each of ``where(spec)`` holds."""
    return [pytest.param(s.name, marks=_marks(s), id=s.name) for s in specs()
            if s.backends and not s.fallback and "torch" in s.backends and all(w(s) for w in where)]


def bare(name: str, params: list) -> list:
    """``params`` (tensors, or ``named_parameters()`` pairs) as a test gives them to any optimizer, bare. A Muon name
    refuses a bare list (it cannot tell a hidden matrix from an embedding without the model): it gets them as param
    groups, the matrices to Muon, the rest to AdamW (names kept)."""
    items = list(params)
    if spec_of(name).facts.math != "muon":
        return items
    named = bool(items) and isinstance(items[0], tuple)
    tensors = [it[1] if named else it for it in items]
    groups = []
    for flag in (True, False):
        pick = [i for i, t in enumerate(tensors) if (t.ndim == 2) == flag]
        if pick:
            groups.append({"params": [tensors[i] for i in pick], "muon": flag,
                           **({"param_names": [items[i][0] for i in pick]} if named else {})})
    return groups


def plain(params: list) -> list[str]:
    """The names of :func:`names`' params (for tests that loop over them in one process, or send them elsewhere:
    pass :func:`packaged` there)."""
    return [p.values[0] for p in params]


# --- what a test may ask of a name --------------------------------------------------------------------------------

def quantized(spec) -> bool:
    """Keeps blockwise quantized state (its Family's code keys)."""
    return spec.facts.quantized


def _own_kernels(spec) -> bool:
    """A quantized family whose kernels are its own (not another family's: Muon8bit steps its AdamW groups with
    AdamW8bit's, tested as AdamW8bit's)."""
    cls = cls_of(spec)
    return issubclass(cls, Blockwise8bit) and cls.NAME == spec.facts.name


def c_kernel(spec) -> bool:
    """A quantized family with its own C kernel (``{NAME}_cpu.c``)."""
    return _own_kernels(spec) and cls_of(spec).C_KERNEL


def triton_kernel(spec) -> bool:
    """A quantized family with its own Triton kernel (``blockwise_triton.{NAME}``)."""
    return _own_kernels(spec) and cls_of(spec).TRITON_KERNEL


def fp32_model(spec) -> bool:
    """Made for fp32 models (not hf_eff_adamw_bf16, made for bf16 ones)."""
    return spec.facts.param_dtype == torch.float32


def packaged(spec) -> bool:
    """A name of the package: known wherever it is imported (spawned ranks, transformers' list of optimizer names),
    not only in this process while a fixture registers it."""
    return spec is not EXAMPLE


def shardable(spec) -> bool:
    """Steps FSDP2's DTensor shards with its torch backend (the distributed tests run these on several ranks; the
    example family too: tests/fsdp_helpers.py registers it in every rank)."""
    return spec.backends["torch"].fsdp2 is None


def deepspeed(spec) -> bool:
    """Trains under DeepSpeed ZeRO (perhaps with the options its Family names)."""
    return spec.facts.deepspeed is None


CASES = cases()  # every name and backend on CPU, on its family's parameter dtype
