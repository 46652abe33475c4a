"""``hf-efficient``: what each optimizer name runs as here, and what it will cost a model, before training.

    hf-efficient list                              # names, the backend each uses on this machine, and why
    hf-efficient estimate distilbert-base-cased    # a hub name (needs a network or the cache)
    hf-efficient estimate ./my_model_dir           # a local directory holding config.json
    hf-efficient estimate --params 7B              # a bare count: 7e9, 7B, 350M, 1.3b (shapes assumed; it says how)
    hf-efficient estimate ./my_model_dir --measure # also build the model here and measure one step of each

The model is built from its config on the meta device, so estimating a 7B model allocates nothing. Sizes are in
MiB and GiB (2**20 and 2**30 bytes, as torch and nvidia-smi count them); the tables fit the terminal's width.

This module parses and checks the arguments with the standard library alone: ``--help``, ``--version`` and a refused
argument answer at once, and torch (transformers too, for a model) is imported by :mod:`.cli_commands` only for a
command that will run. The console script loads this file without the package (``_hf_efficient_cli``), since
``hf_efficient/__init__`` imports torch.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import re
import sys
import warnings
from decimal import Decimal, InvalidOperation

__all__ = ["main", "parse_count"]

_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """A parameter count as people write it: ``65783042``, ``65,783,042``, ``7e9``, ``7B``, ``350M``, ``1.3b``.

    Raises:
        argparse.ArgumentTypeError: not a whole number of parameters (argparse shows it as a usage error).
    """
    match = re.fullmatch(r"\s*(-?[0-9][0-9_,]*(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", text, re.IGNORECASE)
    try:
        value = Decimal(match[1].replace(",", "").replace("_", "")) * _SUFFIXES.get(match[2].lower(), 1)
    except (TypeError, InvalidOperation):  # TypeError: no match
        value = None
    if value is None or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of parameters: write it as 65783042, "
                                         f"7e9, 7B, 350M or 1.3b")
    return int(value)


def _version() -> str:
    try:
        return importlib.metadata.version("hf_efficient")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: run from a source tree)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-efficient", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="names, the backend each uses on this machine, and why")
    p_list.add_argument("--json", action="store_true", help="machine-readable output")
    p_est = sub.add_parser("estimate", help="predicted optimizer memory of a model, one row per optimizer")
    p_est.add_argument("model", nargs="?", help="local directory with config.json, or a hub name")
    p_est.add_argument("--params", type=parse_count, help="a parameter count instead of a model (shapes assumed): "
                       "7e9, 7B, 350M, 1.3b")
    p_est.add_argument("--auto-class", help="transformers class to build (default: the config's architectures[0])")
    p_est.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="parameter dtype in training (default: "
                       "the model's)")
    p_est.add_argument("--device", help="device the backends are chosen for (default: cuda if available, else cpu)")
    p_est.add_argument("--world-size", type=int, help="processes training together: bytes are per rank (default: 1)")
    p_est.add_argument("--sharding", choices=("fsdp2", "zero1", "zero2", "zero3", "none"),
                       help="how --world-size ranks split the model: fsdp2 (each tensor by rows; the default with "
                       "--world-size above 1), "
                       "zero1/2/3 (DeepSpeed: one flat partition of the state; zero2 also gradients, zero3 "
                       "parameters), none (DDP: every rank holds everything)")
    p_est.add_argument("--budget-gb", type=float, help="memory in GiB for hf_eff_auto's choice (default: free memory)")
    p_est.add_argument("--gradient-release", action="store_true", help="every row with gradient_release (each tensor "
                       "stepped in backward: the gradients held are the largest tensor's and a bucket, not all)")
    p_est.add_argument("--measure", action="store_true", help="also build the model on --device and measure the "
                       "state after one step of each optimizer (allocates the model: needs its memory)")
    p_est.add_argument("--json", action="store_true", help="machine-readable output")
    for p in (p_list, p_est):
        p.add_argument("-v", "--verbose", action="store_true", help="show hf_efficient's log messages")
    return parser


def _check_estimate(args, parser: argparse.ArgumentParser) -> None:
    """Refuse what no model could make sense of, before anything is imported or loaded (exits, as argparse does)."""
    if (args.model is None) == (args.params is None):
        parser.error("estimate needs exactly one of MODEL or --params N")
    if args.measure and args.params is not None:
        parser.error("--measure needs a model (directory or hub name), not --params")
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"--world-size {args.world_size}: the number of processes, at least 1")
    if args.sharding not in (None, "none") and args.world_size is None:
        parser.error(f"--sharding {args.sharding} splits the model among ranks: give their number, --world-size N "
                     f"(1 for one process sharded so)")
    args.world_size = args.world_size or 1
    if args.measure and args.world_size > 1:
        parser.error("--measure runs one process: measure per-rank bytes in the sharded run itself (the Trainer's "
                     "memory log, or hf_efficient.optimizer_state_bytes on each rank)")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "estimate":
        _check_estimate(args, parser)
    from . import cli_commands  # torch, and transformers for a model: only for a command that will run

    package_logger = logging.getLogger("hf_efficient")
    level = package_logger.level  # restored after: main() may run inside a larger program (a notebook, tests)
    package_logger.setLevel(logging.INFO if args.verbose else logging.ERROR)
    with warnings.catch_warnings():
        if not args.verbose:
            warnings.simplefilter("ignore")
        try:
            return cli_commands.list_names(args) if args.command == "list" else cli_commands.estimate(args)
        except (ValueError, OSError, ImportError, RuntimeError) as e:
            print(f"hf-efficient: error: {e}", file=sys.stderr)
            return 2
        finally:
            package_logger.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
