"""What hf_efficient costs a Python process: start-up with and without its hook, and ``import hf_efficient``.

    python scripts/bench_import.py              # 15 repetitions, writes docs/results/bench_import.{json,md}
    python scripts/bench_import.py --reps 3 --out /tmp/bench
    python scripts/render_results.py docs/results/bench_import.json   # the page again, from the JSON

Needs the package installed (``pip install -e .`` or a wheel): the hook under test is the installed
``hf_efficient-autoload.pth``. Every case is a fresh interpreter; the cases of one repetition run in turn,
starting at a different one each time, so machine load falls on all alike. Reported: medians of wall time and
of CPU time (user + system of the child), and the hook's own import time from ``python -X importtime``.

Cases. ``python -c pass`` with the hook (default), with ``HF_EFF_AUTOLOAD=0`` (the .pth line still runs, reads
the variable and loads nothing more) and with ``-S`` (no site-packages at all: the floor).
``import torch`` with the hook on and off: the hook's finder sees every one of torch's ~1,000 imports.
``import hf_efficient`` against ``import torch`` (and asserting that it loads no transformers module).
``import transformers.training_args`` with the hook on and off: what registering costs a process that uses
transformers (it imports hf_efficient's core then).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import render_results  # noqa: E402
from _bench_common import RESULTS, command_line, machine, median  # noqa: E402

PTH = "hf_efficient-autoload.pth"
NO_TRANSFORMERS = "import sys; assert not [m for m in sys.modules if m.startswith('transformers')], 'transformers'"
CASES = {  # label -> (interpreter flags, code, environment)
    "python -c pass": ([], "pass", {}),
    "python -c pass, HF_EFF_AUTOLOAD=0": ([], "pass", {"HF_EFF_AUTOLOAD": "0"}),
    "python -S -c pass (no site-packages)": (["-S"], "pass", {}),
    "import torch": ([], "import torch", {}),
    "import torch, HF_EFF_AUTOLOAD=0": ([], "import torch", {"HF_EFF_AUTOLOAD": "0"}),
    "import hf_efficient": ([], f"import hf_efficient; {NO_TRANSFORMERS}", {}),
    "import transformers.training_args": ([], "import transformers.training_args", {}),
    "import transformers.training_args, HF_EFF_AUTOLOAD=0": ([], "import transformers.training_args",
                                                             {"HF_EFF_AUTOLOAD": "0"}),
}


def _env(extra: dict) -> dict:
    # PYTHONDONTWRITEBYTECODE would recompile the hook's modules at every start: installs have their .pyc
    drop = ("PYTHONPATH", "HF_EFF_AUTOLOAD", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def run_once(flags: list[str], code: str, env: dict) -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of one fresh interpreter running ``code``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, *flags, "-c", code], env=_env(env), check=True, cwd="/",
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def hook_import_us(env: dict) -> int | None:
    """Cumulative microseconds ``-X importtime`` reports for the hook's module at start-up (None: not run)."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], env=_env(env), cwd="/",
                         capture_output=True, text=True, check=True).stderr
    m = re.search(r"^import time:\s+\d+ \|\s+(\d+) \|\s+_hf_efficient_autoload$", err, re.M)
    return int(m.group(1)) if m else None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    pth = Path(sysconfig.get_path("purelib"), PTH)
    if not pth.is_file():
        raise SystemExit(f"{pth} is missing: install the package first (pip install -e . or the wheel); "
                         "this measures the installed hook")
    info = machine()
    for flags, code, env in CASES.values():  # warm-up: bytecode caches written, files in the page cache
        run_once(flags, code, env)
    times = {label: {"wall": [], "cpu": []} for label in CASES}
    hook_us = {"on": [], "off": []}
    labels = list(CASES)
    for rep in range(args.reps):
        for label in labels[rep % len(labels):] + labels[:rep % len(labels)]:
            wall, cpu = run_once(*CASES[label])
            times[label]["wall"].append(wall)
            times[label]["cpu"].append(cpu)
        for state, env in (("on", {}), ("off", {"HF_EFF_AUTOLOAD": "0"})):
            hook_us[state].append(hook_import_us(env))
    med = {label: {k: median(v) for k, v in t.items()} for label, t in times.items()}
    hook_med = {state: median([u for u in us if u is not None]) for state, us in hook_us.items()}
    ratio = {
        "import hf_efficient / import torch (cpu)": med["import hf_efficient"]["cpu"] / med["import torch"]["cpu"],
        "import hf_efficient / import torch (wall)": med["import hf_efficient"]["wall"] / med["import torch"]["wall"],
        "start-up, hook on - off (CPU ms)": 1e3 * (med["python -c pass"]["cpu"]
                                                  - med["python -c pass, HF_EFF_AUTOLOAD=0"]["cpu"]),
        "import torch, hook on - off (CPU ms)": 1e3 * (med["import torch"]["cpu"]
                                                      - med["import torch, HF_EFF_AUTOLOAD=0"]["cpu"]),
        "import transformers.training_args, hook on - off (CPU ms)": 1e3 * (
            med["import transformers.training_args"]["cpu"]
            - med["import transformers.training_args, HF_EFF_AUTOLOAD=0"]["cpu"]),
    }
    data = {"command": command_line(__file__, sys.argv[1:] if argv is None else argv), "machine": info,
            "hook": str(pth), "reps": args.reps, "median_s": med, "hook_import_us": hook_med, "ratios": ratio,
            "samples_s": times}
    print(render_results.write(args.out, "bench_import", data))
    return data


if __name__ == "__main__":
    main()
