"""What the ``hf-efficient`` commands print: ``list`` (names, backends here, why) and ``estimate`` (a model's
predicted optimizer memory, one row per name). :mod:`.cli` parses the arguments and imports this module (torch) only
for a command that will run.
"""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .backends import TORCHAO_MIN_SIZE
from .auto import AUTO_MARGIN, choose_auto
from .memory import (MB, MemoryEstimate, UnsupportedSharding, estimate_memory, format_bytes, model_from_config,
                     optimizer_state_bytes)
from .registry import PREFIX, SPECS, resolve

__all__ = ["list_names", "estimate", "ROWS", "Row"]


@dataclass(frozen=True)
class Row:
    """One line of the estimate table: a name with options, and the parameter dtype it trains in."""

    label: str
    name: str
    options: dict[str, Any] = field(default_factory=dict)
    param_dtype: torch.dtype | None = None  # None: the model's own


ROWS = tuple(Row(spec.trainer_name + r.suffix, spec.name, dict(r.options), r.param_dtype)
             for spec in SPECS.values() for r in spec.estimate_rows)  # the registry's rows, in its order
WIDTH = 100  # columns the tables fit: a terminal's usual minimum


def _devices() -> list[str]:
    return (["cuda"] if torch.cuda.is_available() else []) + ["cpu"]


def list_names(args) -> int:
    """``hf-efficient list``."""
    rows = []
    for spec in SPECS.values():
        for dev in _devices():
            nominal = _nominal_bytes(spec)
            row = {"name": spec.trainer_name, "device": dev, "state_bytes_per_param": nominal,
                   "state_bytes_label": spec.bytes_label, "notes": spec.notes}
            if not spec.backends:
                row.update(backend=None, runs_as=None, reason="chooses one of the names above per model")
            else:
                try:
                    res = resolve(spec.name, dev, log=False)
                    row.update(backend=res.backend, runs_as=PREFIX + res.name, reason=res.reason)
                except (RuntimeError, ValueError, ImportError) as e:
                    row.update(backend=None, runs_as=None, reason=f"unavailable: {e}")
            if nominal is None and spec.backends:  # Adafactor: what its bytes per parameter depend on
                row["reason"] += f"; state: {spec.notes.split(';')[0]}, so bytes per parameter depend on the shapes " \
                                 f"(hf-efficient estimate MODEL counts them)"
            rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2, allow_nan=False))
        return 0
    cells = [[r["name"], r["device"], r["backend"] or "-", "-" if not r["backend"] else r["state_bytes_label"],
              r["reason"] + (f" (runs as {r['runs_as']})" if r["runs_as"] and r["runs_as"] != r["name"] else "")]
             for r in rows]
    _print_columns(["name", "device", "backend", "B/param", "why"], cells, wrap=4)
    print("B/param: optimizer state bytes per trained parameter")
    return 0


def _nominal_bytes(spec) -> float | None:
    """Bytes per parameter that hold for any model, or None where they depend on the shapes (Adafactor's row and
    column statistics: far below 1, but not a constant) or on a choice (``hf_eff_auto``)."""
    return spec.state_bytes if math.isfinite(spec.state_bytes) and spec.state_bytes > 0 else None


def _print_columns(head: list[str], lines: list[list[str]], wrap: int, right: int = 99) -> None:
    """A table of ``WIDTH`` columns: column ``wrap`` takes what the others leave and wraps; columns from ``right``
    on are right-aligned (numbers)."""
    widths = [max(len(c) for c in col) for col in zip(head, *lines)]
    widths[wrap] = max(16, WIDTH - sum(w for i, w in enumerate(widths) if i != wrap) - 2 * (len(widths) - 1))
    for cells in [head, *lines]:
        wrapped = [textwrap.wrap(c, widths[i], subsequent_indent="  ") or [""] if i == wrap else [c]
                   for i, c in enumerate(cells)]
        for n in range(max(len(w) for w in wrapped)):
            parts = [(w[n] if n < len(w) else "") for w in wrapped]
            text = "  ".join(p.rjust(widths[i]) if i >= right else p.ljust(widths[i]) for i, p in enumerate(parts))
            print(text.rstrip())


def _load_model(args):
    """The model (meta device) and a description of it, from a directory or hub name."""
    from transformers import AutoConfig

    _check_local_path(args.model)
    try:
        config = AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError) as e:
        raise OSError(f"cannot load a config for {args.model!r} (a local directory with config.json, or a hub "
                      f"name when a network or the cache has it): {e}. Or give a count: --params N") from None
    model = model_from_config(config, args.auto_class)
    return config, model, f"{args.model} ({type(model).__name__})"


def _check_local_path(model: str) -> None:
    """Refuse a local path that holds no config, before transformers reads it as a malformed hub name ("Repo id
    must be in the form..."). A path: it exists, or it is written as one (absolute, ./, ../, ~, two or more /)."""
    path = Path(model).expanduser()
    looks_local = path.exists() or model.startswith((".", "~", "/", "\\")) or model.count("/") > 1 or "\\" in model
    if not looks_local:
        return
    if not path.is_dir():
        raise OSError(f"cannot load a config for {model!r}: no such directory. Give a local directory holding "
                      f"config.json, a hub name (org/name), or a count: --params N")
    if not (path / "config.json").is_file():
        raise OSError(f"cannot load a config for {model!r}: the directory has no config.json (save one with "
                      f"config.save_pretrained(dir)), or give a count: --params N")


def estimate(args) -> int:
    """``hf-efficient estimate``, its arguments checked by :mod:`.cli`."""
    sharding = args.sharding or ("fsdp2" if args.world_size > 1 else "none")  # one rank: unsharded unless asked
    sharded = {"world_size": args.world_size, "sharding": None if sharding == "none" else sharding}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype)
    device = torch.device(args.device or _devices()[0])
    if args.params is not None:
        source, config, what = args.params, None, f"--params {args.params}"
    else:
        config, source, what = _load_model(args)
    estimates, unavailable, asked = [], {}, set()
    for row in ROWS:
        try:
            est = _row_estimate(source, row, dtype, device, sharded)
        except (ImportError, RuntimeError, UnsupportedSharding) as e:  # it cannot run here, or not so sharded
            unavailable[row.label] = str(e)
            continue
        # a row that --dtype (or a default it implies) makes the same question as an earlier one is left out: under
        # --dtype bf16, "hf_eff_adamw (bf16 params)" asks exactly what "hf_eff_adamw" asks
        key = (row.name, est.backend, est.param_dtype, json.dumps(est.options, sort_keys=True, default=str))
        if key not in asked:
            asked.add(key)
            estimates.append((row, est))
    measured = _measure(config, args.auto_class, estimates, dtype, device) if args.measure else {}
    try:
        budget = {"budget_gb": args.budget_gb} if args.budget_gb is not None else {}
        auto = choose_auto(source, budget, param_dtype=dtype, device=device, source="--budget-gb", **sharded)
    except RuntimeError as e:  # no free-memory reading for this device here
        auto = f"cannot tell: {e}"
    if args.json:
        data = _as_json(what, estimates, measured, auto, unavailable)
        print(json.dumps(data, indent=2, default=str, allow_nan=False))
    else:
        _print_table(what, estimates, measured, auto, unavailable)
    return 0


def _row_estimate(source, row: Row, dtype, device, sharded: dict) -> MemoryEstimate:
    options = dict(row.options, **sharded)
    try:
        return estimate_memory(source, row.name, param_dtype=row.param_dtype or dtype, device=device, **options)
    except ValueError as e:  # torchao cannot quantize below its fixed threshold: show its smallest
        if "torchao" not in str(e) or "min_8bit_size" not in options:
            raise
        options["min_8bit_size"] = TORCHAO_MIN_SIZE
        return estimate_memory(source, row.name, param_dtype=row.param_dtype or dtype, device=device, **options)


def _measure(config, auto_class, estimates, dtype, device) -> dict[str, int]:
    """Build the model for real on ``device`` and measure each row's state after one step of zero gradients."""
    from .factory import create_optimizer

    model = model_from_config(config, auto_class, device=device)
    out = {}
    for row, est in estimates:
        model.to(row.param_dtype or dtype or torch.float32)
        opt = create_optimizer(model, est.name, lr=1e-4, **est.options)
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        opt.step()
        out[row.label] = optimizer_state_bytes(opt)
        del opt
        model.zero_grad(set_to_none=True)
    return out


def _as_json(what, estimates, measured, auto, unavailable) -> dict:
    first = estimates[0][1]
    rows = []
    for row, est in estimates:
        d = est.as_dict()
        d.update(label=row.label, measured_state_bytes=measured.get(row.label))
        rows.append(d)
    rows += [{"label": label, "unavailable": why} for label, why in unavailable.items()]
    return {"model": what, "num_params": first.num_params, "device": first.device, "assumption": first.assumption,
            "world_size": first.world_size, "sharding": first.sharding,
            "mb": MB, "rows": rows,
            "auto": {"name": PREFIX + auto.name, "summary": auto.summary()} if not isinstance(auto, str) else auto}


def _print_table(what, estimates, measured, auto, unavailable) -> None:
    first = estimates[0][1]
    per_rank = (f"; bytes per rank of {first.world_size} ({first.sharding or 'DDP: each holds everything'})"
                if first.world_size > 1 else "")
    print(textwrap.fill(f"{what}: {first.num_params:,} trainable parameters, backends chosen for {first.device}"
                        f"{per_rank}", WIDTH, subsequent_indent="  "))
    if first.assumption:
        print(textwrap.fill(f"assumed: {first.assumption}", WIDTH, subsequent_indent="  "))
    head = ["optimizer", "backend", "dtype", "B/param", "state MiB", "saved", "total MiB"]
    lines = []
    for row, est in estimates:
        runs_as = "" if est.name.endswith(row.name) else f" (runs as {est.name})"
        cells = [row.label + runs_as, est.backend, _DTYPES.get(est.param_dtype, est.param_dtype),
                 f"{est.state_bytes_per_param:.3f}", _mib(est.state_bytes), f"{est.saving:.1%}", _mib(est.total_bytes)]
        if measured:
            m = measured[row.label]
            cells.append(f"{_mib(m)} {(m - est.state_bytes) / max(est.state_bytes, 1):+.1%}")
        lines.append(cells)
    _print_columns(head + (["measured MiB"] if measured else []), lines, wrap=0, right=3)
    print(textwrap.fill("B/param: state bytes per parameter; saved: state saved against fp32 AdamW; total: "
                        "parameters + gradients + state", WIDTH, subsequent_indent="  "))
    for label, why in unavailable.items():
        print(textwrap.fill(f"{label}: unavailable here: {why}", WIDTH, subsequent_indent="  "))
    if isinstance(auto, str):
        print(textwrap.fill(f"{PREFIX}auto here: {auto}", WIDTH, subsequent_indent="  "))
    else:
        print(textwrap.fill(f"{PREFIX}auto here would choose {PREFIX}{auto.name}{'' if auto.fits else ' (nothing fits)'}"
                            f": usable {format_bytes(auto.usable_bytes)} = {1 - AUTO_MARGIN:.0%} of "
                            f"{format_bytes(auto.available_bytes)} ({auto.source})", WIDTH, subsequent_indent="  "))


_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _mib(n: int) -> str:
    """``n`` bytes in MiB, with the digits a small model (a few MiB) needs to show differences."""
    return f"{n / MB:,.1f}" if n >= 10 * MB else f"{n / MB:.3f}"

