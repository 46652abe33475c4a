"""`accelerate launch --cpu --num_processes N` runs one process (accelerate's single-process launcher): warned."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
from transformers import TrainingArguments
from hf_efficient.integrations.accelerate import EfficientOptimPlugin
print("processes", EfficientOptimPlugin(optim="adamw").create_accelerator().num_processes)
TrainingArguments("out", optim="hf_eff_adamw", report_to=[], use_cpu=True)  # (resets Accelerate's state)
"""


def _launch(tmp_path, processes: int) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes",
                           str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads the launcher's command line from /proc")
@pytest.mark.parametrize("processes", [2, 1])
def test_launch_asked_for_more_processes_than_started_is_warned_once(tmp_path, processes):
    out = _launch(tmp_path, processes)
    assert out.returncode == 0 and "processes 1" in out.stdout, out.stderr[-3000:]
    warned = out.stderr.count("accelerate launch was asked for 2 processes (--num_processes 2) but started only")
    assert warned == (processes == 2), out.stderr[-3000:]  # once, though the plugin and the Trainer both check
    if processes == 2:
        assert "ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2" in out.stderr
