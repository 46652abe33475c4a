"""What the ``hf-efficient`` commands print: ``list`` (names, backends here, why) and ``estimate`` (a model's
predicted optimizer memory, one row per name). :mod:`.cli` parses the arguments and imports this module (torch) only
for a command that will run.
"""

from __future__ import annotations

import json
import math
import shutil
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .backends import TORCHAO_MIN_SIZE
from .auto import AUTO_MARGIN, choose_auto
from .estimate import estimate_memory
from .memory import MB, MemoryEstimate, UnsupportedSharding, format_bytes, optimizer_state_bytes
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
WIDTH = 100  # columns when the output is no terminal (a pipe, a file) and COLUMNS is unset


def _width() -> int:
    """Columns the output fits: COLUMNS, else the terminal's width, else :data:`WIDTH`."""
    return shutil.get_terminal_size((WIDTH, 24)).columns


def _say(text: str) -> None:
    print(textwrap.fill(text, _width(), subsequent_indent="  "))


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
    """A table as wide as the output: column ``wrap`` takes what the others leave (16 at least) and wraps; columns
    from ``right`` on are right-aligned (numbers). Columns are two spaces apart, one where two would not fit."""
    widths = [max(len(c) for c in col) for col in zip(head, *lines)]
    left = _width() - sum(w for i, w in enumerate(widths) if i != wrap)
    gap = 2 if left - 2 * (len(widths) - 1) >= 16 else 1
    widths[wrap] = max(16, left - gap * (len(widths) - 1))
    for cells in [head, *lines]:
        wrapped = [textwrap.wrap(c, widths[i], subsequent_indent="  ") or [""] if i == wrap else [c]
                   for i, c in enumerate(cells)]
        for n in range(max(len(w) for w in wrapped)):
            parts = [(w[n] if n < len(w) else "") for w in wrapped]
            text = (" " * gap).join(p.rjust(widths[i]) if i >= right else p.ljust(widths[i])
                                    for i, p in enumerate(parts))
            print(text.rstrip())


def _load_model(args):
    """The model (meta device) and a description of it, from a directory or hub name."""
    from transformers import AutoConfig

    from .integrations.transformers import model_from_config

    _check_local_path(args.model)
    try:
        config = AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError) as e:
        why = " ".join(str(e).split()).rstrip(".")  # transformers' message: sentences over lines, ending in a dot
        raise OSError(f"cannot load a config for {args.model!r} (a local directory with config.json, or a hub "
                      f"name when a network or the cache has it): {why}. Or give a count: --params N") from None
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
    release = {"gradient_release": True} if args.gradient_release else {}  # an option of every name
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype)
    device = torch.device(args.device or _devices()[0])
    if args.params is not None:
        source, config, what = args.params, None, f"--params {args.params}"
    else:
        config, source, what = _load_model(args)
    estimates, unavailable, asked = [], {}, set()
    for row in ROWS:
        try:
            est = _row_estimate(source, row, dtype, device, sharded, release)
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
        budget = dict(release, **({"budget_gb": args.budget_gb} if args.budget_gb is not None else {}))
        auto = choose_auto(source, budget, param_dtype=dtype, device=device, source="--budget-gb", **sharded)
    except RuntimeError as e:  # no free-memory reading for this device here
        auto = f"cannot tell: {e}"
    if args.json:
        data = _as_json(what, estimates, measured, auto, unavailable)
        print(json.dumps(data, indent=2, default=str, allow_nan=False))
    else:
        _print_table(what, estimates, measured, auto, unavailable)
    return 0


def _row_estimate(source, row: Row, dtype, device, sharded: dict, release: dict) -> MemoryEstimate:
    options = dict(row.options, **sharded, **release)
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
    from .integrations.transformers import model_from_config

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
    sharded = first.world_size > 1
    per_rank = f"; bytes per rank of {first.world_size} ({first.sharding or 'DDP: each holds everything'})" if sharded \
        else ""
    _say(f"{what}: {first.num_params:,} trainable parameters, backends chosen for {first.device}{per_rank}")
    if first.assumption:
        _say(f"assumed: {first.assumption}")
    head = ["optimizer", "backend", "dtype", "B/param", "state MiB", "saved", "total MiB"]
    shown, same = [], []
    for row, est in estimates:
        twin = next((i for i, (r, e) in enumerate(shown) if (r.name, e.backend, e.param_dtype, e.state_bytes,
                     e.total_bytes) == (row.name, est.backend, est.param_dtype, est.state_bytes, est.total_bytes)
                     and measured.get(r.label) == measured.get(row.label)), None)
        if twin is None:
            shown.append((row, est))
            continue
        # the same name asked with other options, and the same answer: one row (the default's: fewest options)
        kept, dropped = sorted([shown[twin], (row, est)], key=lambda pair: len(pair[0].options))
        shown[twin] = kept
        same.append(f"{dropped[0].label} = {kept[0].label}")
    lines = []
    for row, est in shown:
        runs_as = "" if est.name.endswith(row.name) else f" (runs as {est.name})"
        cells = [row.label + runs_as, est.backend, _DTYPES.get(est.param_dtype, est.param_dtype),
                 f"{est.state_bytes_per_param:.3f}", _mib(est.state_bytes), f"{est.saving:.1%}", _mib(est.total_bytes)]
        if measured:
            m = measured[row.label]
            cells.append(f"{_mib(m)} {(m - est.state_bytes) / max(est.state_bytes, 1):+.1%}")
        lines.append(cells)
    _print_columns(head + (["measured MiB"] if measured else []), lines, wrap=0, right=3)
    if sharded:
        _say("B/param: this rank's state bytes / the model's parameters; saved: state saved against fp32 AdamW on "
             "this rank; total: this rank's parameters + gradients + state")
    else:
        _say("B/param: state bytes per parameter; saved: state saved against fp32 AdamW; total: parameters + "
             "gradients + state")
    if same:  # the registry's rows of one name differ in where state stays 32-bit (and compensation, its default)
        shapes = "--params assumes none" if first.assumption else "this model has none"
        _say(f"Not shown, the same figures as the row named: {'; '.join(same)}. What sets them apart is which tensors "
             f"keep 32-bit state (embeddings, tensors under min_8bit_size), and {shapes}.")
    for label, why in unavailable.items():
        _say(f"{label}: unavailable here: {why}")
    if isinstance(auto, str):
        _say(f"{PREFIX}auto here: {auto}")
    else:
        _say(f"{PREFIX}auto here would choose {PREFIX}{auto.name}{'' if auto.fits else ' (nothing fits)'}: usable "
             f"{format_bytes(auto.usable_bytes)} = {1 - AUTO_MARGIN:.0%} of {format_bytes(auto.available_bytes)} "
             f"({auto.source})")


_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _mib(n: int) -> str:
    """``n`` bytes in MiB, with the digits a small model (a few MiB) needs to show differences."""
    return f"{n / MB:,.1f}" if n >= 10 * MB else f"{n / MB:.3f}"

