"""What the measuring scripts in scripts/ share: the repo on sys.path, a description of the machine, the command.

Their pages are rendered from their JSON by render_results.py."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
for _p in (REPO, REPO / "examples"):  # run from a checkout without `pip install -e .` too
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: str = "cpu") -> dict:
    """The machine a result was measured on, with the load at the time (the machine may be shared)."""
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu_name(),
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "python": platform.python_version(), "device": device, "gpu": None,
            "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()]}
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def command_line(script: str, argv: list[str]) -> str:
    """The command that reproduces a run, from the repository root."""
    return " ".join(["python", f"scripts/{Path(script).name}", *argv])
