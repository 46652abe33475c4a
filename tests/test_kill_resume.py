"""A run killed (SIGKILL, a real separate process) right after a checkpoint, then resumed, ends exactly where
an uninterrupted run ends: every hf_eff name and 8-bit backend, on CPU where all of them are deterministic."""

import os
import subprocess
import sys

import pytest
import torch
from _kill_train import run

CHILD = os.path.join(os.path.dirname(__file__), "_kill_train.py")
CASES = [  # (optim, optim_args, parameter dtype)
    ("hf_eff_adamw", "", "float32"),
    ("hf_eff_adam8bit", "", "float32"),  # the registry's CPU choice: backend=torch
    ("hf_eff_adam8bit", "backend=bnb", "float32"),
    ("hf_eff_adam8bit", "backend=torchao", "float32"),
    ("hf_eff_adafactor", "", "float32"),
    ("hf_eff_adamw_bf16", "", "bfloat16"),
    ("hf_eff_muon", "", "float32"),  # Muon on tiny_bert's encoder layers, AdamW on the rest
    ("hf_eff_muon8bit", "", "float32"),
]


def _child(*args):
    env = dict(os.environ, PYTHONHASHSEED="0")
    return subprocess.run([sys.executable, CHILD, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("optim, optim_args, dtype", CASES, ids=[f"{o}-{a or 'default'}" for o, a, _ in CASES])
def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path, optim, optim_args, dtype):
    if "torchao" in optim_args:
        pytest.importorskip("torchao")
    steps, out = 9, tmp_path / "run"
    killed = _child(optim, optim_args, out, steps, 6, 0, dtype)
    assert killed.returncode == -9, killed.stderr[-2000:]  # died by SIGKILL after the step-6 save
    assert (out / "checkpoint-6" / "optimizer.pt").exists() and not (out / "final.pt").exists()
    torch.load(out / "checkpoint-6" / "optimizer.pt", weights_only=True)
    resumed = _child(optim, optim_args, out, steps, 0, 1, dtype)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = torch.load(out / "final.pt", weights_only=True)
    reference = run(optim, optim_args, str(tmp_path / "ref"), steps, dtype=dtype).state_dict()
    for name, value in reference.items():
        assert torch.equal(final[name], value), name
