"""What hf_efficient costs a Python process: start-up with and without its hook, and ``import hf_efficient``.

    python scripts/bench_import.py              # 15 repetitions, writes docs/results/bench_import.{md,json}
    python scripts/bench_import.py --reps 3 --out /tmp/bench

Needs the package installed (``pip install -e .`` or a wheel): the hook under test is the installed
``hf_efficient-autoload.pth``. Every case is a fresh interpreter; the cases of one repetition run in turn,
starting at a different one each time, so machine load falls on all alike. Reported: medians of wall time and
of CPU time (user + system of the child), and the hook's own import time from ``python -X importtime``.

Cases. ``python -c pass`` with the hook (default), with ``HF_EFF_AUTOLOAD=0`` (the .pth line still runs, reads
the variable and loads nothing more) and with ``-S`` (no site-packages at all: the floor).
``import torch`` with the hook on and off: the hook's finder sees every one of torch's ~1,000 imports.
``import hf_efficient`` against ``import torch`` (target: within 1.2x, no transformers module loaded).
``import transformers.training_args`` with the hook on and off: what registering costs a process that uses
transformers (it imports hf_efficient's core then).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import RESULTS, machine, machine_md, md_table, median  # noqa: E402

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
    rows = [[label, f"{1e3 * m['wall']:.1f}", f"{1e3 * m['cpu']:.1f}"] for label, m in med.items()]
    md = "\n\n".join([
        "# What hf_efficient costs a Python process",
        f"`python scripts/bench_import.py --reps {args.reps}`: fresh interpreters, medians of {args.reps} "
        f"repetitions after one warm-up run of each; hook: `{pth}`; bytecode caches on (as after `pip install`).",
        machine_md(info),
        md_table(["case", "wall ms", "CPU ms"], rows),
        f"- The hook's module at start-up (`-X importtime`, cumulative): {hook_med['on']:.0f} us with the hook on, "
        f"{hook_med['off']:.0f} us under `HF_EFF_AUTOLOAD=0` (the .pth line reads the variable and loads nothing).",
        "\n".join(f"- {k}: {v:.2f}" for k, v in ratio.items()),
        f"- Target: `import hf_efficient` within 1.2x of `import torch` (CPU): "
        f"{'met' if ratio['import hf_efficient / import torch (cpu)'] <= 1.2 else 'NOT met'}; it loads no "
        "transformers module (asserted in the case itself).",
        "CPU time is the steadier figure on a shared machine; differences of a few milliseconds between "
        "whole interpreters are within their noise, which the `-X importtime` line resolves.",
    ]) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_import.md").write_text(md)
    data = {"machine": info, "reps": args.reps, "median_s": med, "hook_import_us": hook_med, "ratios": ratio,
            "samples_s": times}
    (args.out / "bench_import.json").write_text(json.dumps(data, indent=1))
    print(md)
    return data


if __name__ == "__main__":
    main()
