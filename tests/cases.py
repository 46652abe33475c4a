"""The cross-cutting tests' cases, generated from the registry: a new name or backend is covered without editing them.

:func:`cases` gives ``(name, backend, dtype, compensation)`` for every registered name that has backends of its own
(not ``auto``, which picks one of them) and runs on the device itself (not a name that falls back elsewhere), crossed
with each of its backends that serves the device. ``dtype`` is the family's parameter dtype (bf16 for the bf16 name);
``compensation`` is ``"auto"``, the family's default. A backend whose package is missing stays in the list, skipped,
with the reason the registry gives (the pip extra to install).
"""

from __future__ import annotations

import pytest
import torch

from hf_efficient.registry import SPECS


def _skip(impl, device: str):
    why = impl.why_not(device)
    return [pytest.mark.skip(reason=why)] if why else []


def case_id(name: str, backend: str, dtype: torch.dtype, compensation: str = "auto") -> str:
    dt = str(dtype).removeprefix("torch.")
    return "-".join([name, backend, dt] + ([compensation] if compensation != "auto" else []))


def cases(device: str = "cpu", *, dtypes: tuple[torch.dtype, ...] | None = None,
          compensations: tuple[str, ...] = ("auto",), names=None) -> list:
    """``pytest.param(name, backend, dtype, compensation)`` per runnable name x backend serving ``device`` (x each of
    ``dtypes`` the name takes, default: the family's parameter dtype; x ``compensations``, which apply to bf16/fp16
    weights only, so fp32 cases take ``"auto"`` once)."""
    out = []
    for spec in SPECS.values():
        if not spec.backends or spec.fallback or (names is not None and spec.name not in names):
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
                    out.append(pytest.param(spec.name, backend, dtype, comp, marks=_skip(impl, device),
                                            id=case_id(spec.name, backend, dtype, comp)))
    return out


CASES = cases()  # every name and backend on CPU, on its family's parameter dtype
