"""``hf-efficient``: what each optimizer name runs as here, and what it will cost a model, before training.

    hf-efficient list                              # names, the backend each uses on this machine, and why
    hf-efficient estimate distilbert-base-cased    # a hub name (needs a network or the cache)
    hf-efficient estimate ./my_model_dir           # a local directory holding config.json
    hf-efficient estimate --params 65783042        # a bare count (shapes assumed; the output says how)
    hf-efficient estimate ./my_model_dir --measure # also build the model here and measure one step of each

The model is built from its config on the meta device, so estimating a 7B model allocates nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from .backends import TORCHAO_MIN_SIZE
from .auto import AUTO_MARGIN, choose_auto
from .memory import MB, MemoryEstimate, estimate_memory, model_from_config, optimizer_state_bytes
from .registry import PREFIX, SPECS, resolve

__all__ = ["main", "ROWS", "Row"]


@dataclass(frozen=True)
class Row:
    """One line of the estimate table: a name with options, and the parameter dtype it trains in."""

    label: str
    name: str
    options: dict[str, Any] = field(default_factory=dict)
    param_dtype: torch.dtype | None = None  # None: the model's own


ROWS = tuple(Row(spec.trainer_name + r.suffix, spec.name, dict(r.options), r.param_dtype)
             for spec in SPECS.values() for r in spec.estimate_rows)  # the registry's rows, in its order


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-efficient", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="names, the backend each uses on this machine, and why")
    p_list.add_argument("--json", action="store_true", help="machine-readable output")
    p_est = sub.add_parser("estimate", help="predicted optimizer memory of a model, one row per optimizer")
    p_est.add_argument("model", nargs="?", help="local directory with config.json, or a hub name")
    p_est.add_argument("--params", type=int, help="a parameter count instead of a model (shapes assumed)")
    p_est.add_argument("--auto-class", help="transformers class to build (default: the config's architectures[0])")
    p_est.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="parameter dtype in training (default: "
                       "the model's)")
    p_est.add_argument("--device", help="device the backends are chosen for (default: cuda if available, else cpu)")
    p_est.add_argument("--budget-gb", type=float, help="memory for hf_eff_auto's choice (default: free memory)")
    p_est.add_argument("--measure", action="store_true", help="also build the model on --device and measure the "
                       "state after one step of each optimizer (allocates the model: needs its memory)")
    p_est.add_argument("--json", action="store_true", help="machine-readable output")
    for p in (p_list, p_est):
        p.add_argument("-v", "--verbose", action="store_true", help="show hf_efficient's log messages")
    args = parser.parse_args(argv)
    package_logger = logging.getLogger("hf_efficient")
    level = package_logger.level  # restored after: main() may run inside a larger program (a notebook, tests)
    package_logger.setLevel(logging.INFO if args.verbose else logging.ERROR)
    with warnings.catch_warnings():
        if not args.verbose:
            warnings.simplefilter("ignore")
        try:
            return _list(args) if args.command == "list" else _estimate(args, parser)
        except (ValueError, OSError, ImportError, RuntimeError) as e:
            print(f"hf-efficient: error: {e}", file=sys.stderr)
            return 2
        finally:
            package_logger.setLevel(level)


def _devices() -> list[str]:
    return (["cuda"] if torch.cuda.is_available() else []) + ["cpu"]


def _list(args) -> int:
    rows = []
    for spec in SPECS.values():
        for dev in _devices():
            nominal = spec.state_bytes if math.isfinite(spec.state_bytes) else None  # auto has none (NaN): JSON null
            row = {"name": spec.trainer_name, "device": dev, "state_bytes_per_param": nominal, "notes": spec.notes}
            if not spec.backends:
                row.update(backend=None, runs_as=None, reason="chooses one of the names above per model")
            else:
                try:
                    res = resolve(spec.name, dev, log=False)
                    row.update(backend=res.backend, runs_as=PREFIX + res.name, reason=res.reason)
                except (RuntimeError, ValueError, ImportError) as e:
                    row.update(backend=None, runs_as=None, reason=f"unavailable: {e}")
            rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2, allow_nan=False))
        return 0
    width = max(len(r["name"]) for r in rows)
    print(f"{'name':<{width}}  {'device':<6}  {'backend':<8}  {'B/param':>7}  why")
    for r in rows:
        ran = f" (runs as {r['runs_as']})" if r["runs_as"] and r["runs_as"] != r["name"] else ""
        nominal = "-" if r["state_bytes_per_param"] is None else f"{r['state_bytes_per_param']:.2f}"
        print(f"{r['name']:<{width}}  {r['device']:<6}  {r['backend'] or '-':<8}  {nominal:>7}  {r['reason']}{ran}")
    return 0


def _load_model(args):
    """The model (meta device) and a description of it, from a directory or hub name."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError) as e:
        raise OSError(f"cannot load a config for {args.model!r} (a local directory with config.json, or a hub "
                      f"name when a network or the cache has it): {e}. Or give a count: --params N") from None
    model = model_from_config(config, args.auto_class)
    return config, model, f"{args.model} ({type(model).__name__})"


def _estimate(args, parser) -> int:
    if (args.model is None) == (args.params is None):
        parser.error("estimate needs exactly one of MODEL or --params N")
    if args.measure and args.params is not None:
        parser.error("--measure needs a model (directory or hub name), not --params")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype)
    device = torch.device(args.device or _devices()[0])
    if args.params is not None:
        source, config, what = args.params, None, f"--params {args.params}"
    else:
        config, source, what = _load_model(args)
    estimates, unavailable = [], {}
    for row in ROWS:
        try:
            estimates.append((row, _row_estimate(source, row, dtype, device)))
        except (ImportError, RuntimeError) as e:  # no backend of this name can run here
            unavailable[row.label] = str(e)
    measured = _measure(config, args.auto_class, estimates, dtype, device) if args.measure else {}
    try:
        budget = {"budget_gb": args.budget_gb} if args.budget_gb is not None else {}
        auto = choose_auto(source, budget, param_dtype=dtype, device=device, source="--budget-gb")
    except RuntimeError as e:  # no free-memory reading for this device here
        auto = f"cannot tell: {e}"
    if args.json:
        data = _as_json(what, estimates, measured, auto, unavailable)
        print(json.dumps(data, indent=2, default=str, allow_nan=False))
    else:
        _print_table(what, estimates, measured, auto, unavailable)
    return 0


def _row_estimate(source, row: Row, dtype, device) -> MemoryEstimate:
    options = dict(row.options)
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
            "mb": MB, "rows": rows,
            "auto": {"name": PREFIX + auto.name, "summary": auto.summary()} if not isinstance(auto, str) else auto}


def _print_table(what, estimates, measured, auto, unavailable) -> None:
    first = estimates[0][1]
    print(f"{what}: {first.num_params:,} trainable parameters, backends chosen for {first.device} (MB = 2**20 bytes)")
    if first.assumption:
        print(f"assumed: {first.assumption}")
    head = ["optimizer", "backend", "params", "dtype", "state B/param", "state MB", "saving vs fp32 AdamW",
            "params+grads+state MB", "total B/param"] + (["measured MB", "diff"] if measured else [])
    lines = []
    for row, est in estimates:
        cells = [row.label, est.backend + ("" if est.name.endswith(row.name) else f" (as {est.name})"),
                 f"{est.num_params:,}", est.param_dtype, f"{est.state_bytes_per_param:.3f}",
                 f"{est.state_bytes / MB:.1f}", f"{est.saving:.1%}", f"{est.total_bytes / MB:.1f}",
                 f"{est.total_bytes_per_param:.2f}"]
        if measured:
            m = measured[row.label]
            cells += [f"{m / MB:.1f}", f"{(m - est.state_bytes) / max(est.state_bytes, 1):+.2%}"]
        lines.append(cells)
    widths = [max(len(str(c)) for c in col) for col in zip(head, *lines)]
    for cells in [head, *lines]:
        print("  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))))
    for label, why in unavailable.items():
        print(f"{label}: unavailable here: {why}")
    if isinstance(auto, str):
        print(f"{PREFIX}auto here: {auto}")
    else:
        print(f"{PREFIX}auto here would choose {PREFIX}{auto.name}{'' if auto.fits else ' (nothing fits)'}: usable "
              f"{auto.usable_bytes / MB:.0f} MB = {1 - AUTO_MARGIN:.0%} of {auto.available_bytes / MB:.0f} MB "
              f"({auto.source})")


if __name__ == "__main__":
    sys.exit(main())
