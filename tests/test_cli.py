"""The ``hf-efficient`` console script: run in-process (its import costs as much as the rest of the test), and as the
installed entry point in a fresh interpreter where what it imports is the point."""

from __future__ import annotations

import configparser
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_efficient import cli
from hf_efficient.release import BUCKET_BYTES

N = 65_783_042  # DistilBERT (cased vocabulary) with a 2-label classification head
TENSORS = -(-N // 2**20)  # --params assumes tensors of at most 2**20 elements


@pytest.fixture(autouse=True)
def _columns(monkeypatch):
    """Tables as wide as with no terminal: their width follows COLUMNS or the terminal, which differ per worker."""
    monkeypatch.setenv("COLUMNS", "100")


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def rows_by_label(out: str) -> dict:
    return {r["label"]: r for r in json.loads(out)["rows"]}


def test_console_script_is_declared():
    eps = importlib.metadata.entry_points(group="console_scripts")
    assert any(ep.name == "hf-efficient" and ep.value == "_hf_efficient_cli:main" for ep in eps)


def _console_script(tmp_path, *argv) -> tuple[subprocess.CompletedProcess, set[str]]:
    """The console script's entry point (as setup.cfg declares it) run in a fresh interpreter: its result, and the
    modules it imported (``-X importtime``)."""
    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    scripts = dict(line.split(" = ") for line in cfg["options.entry_points"]["console_scripts"].strip().splitlines())
    module, func = scripts["hf-efficient"].split(":")
    code = f"import sys; from {module} import {func}; sys.exit({func}())"
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code, *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return proc, imported


@pytest.mark.parametrize("argv, rc, says", [
    (["--help"], 0, "usage: hf-efficient"),
    (["--version"], 0, f"hf-efficient {importlib.metadata.version('hf_efficient')}"),
    (["estimate", "--params", "banana"], 2, "'banana' is not a whole number of parameters"),
    (["estimate"], 2, "estimate needs exactly one of MODEL or --params N"),
    (["estimate", "--params", "1B", "--world-size", "0"], 2, "--world-size 0: the number of processes"),
    (["nonsense"], 2, "invalid choice: 'nonsense'"),
])
def test_help_version_and_refused_arguments_import_neither_torch_nor_transformers(tmp_path, argv, rc, says):
    """They answer at once: the console script parses before it imports the package (torch: seconds; transformers
    for a model: more)."""
    proc, imported = _console_script(tmp_path, *argv)
    assert proc.returncode == rc and says in proc.stdout + proc.stderr, (proc.stdout, proc.stderr[-2000:])
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "transformers", "hf_efficient"))
    assert not heavy, heavy[:10]


def test_a_command_that_runs_imports_the_package(tmp_path):
    proc, imported = _console_script(tmp_path, "estimate", "--params", "1M", "--device", "cpu", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["num_params"] == 10**6, proc.stderr[-2000:]
    assert {"torch", "hf_efficient.cli_commands"} <= imported


def test_list_names_backends_and_reasons(capsys):
    rc, out, _ = run(capsys, "list")
    assert rc == 0
    for name in ("hf_eff_adamw", "hf_eff_adam8bit", "hf_eff_paged_adam8bit", "hf_eff_adafactor", "hf_eff_auto"):
        assert name in out
    rc, out, _ = run(capsys, "list", "--json")
    rows = {(r["name"], r["device"]): r for r in json.loads(out)}
    assert rows[("hf_eff_adam8bit", "cpu")]["backend"] == "torch"  # our compiled kernel is first on CPU
    assert "torch > bnb usable" in rows[("hf_eff_adam8bit", "cpu")]["reason"]  # torchao only when forced
    assert rows[("hf_eff_paged_adam8bit", "cpu")]["runs_as"] == "hf_eff_adam8bit"
    assert rows[("hf_eff_auto", "cpu")]["backend"] is None


def test_estimate_params_table(capsys):
    rc, out, _ = run(capsys, "estimate", "--params", str(N), "--device", "cpu")
    assert rc == 0
    assert "assumed: 65,783,042 parameters counted as 2-D matrices of 1024 columns" in out
    lines = {line.split("  ")[0]: line for line in out.splitlines()}
    adamw, adam8bit = lines["hf_eff_adamw"], lines["hf_eff_adam8bit (default: 32-bit embeddings)"]
    assert "65,783,042 trainable parameters" in out.splitlines()[0]  # one count for every row: in the heading
    assert " 8.000 " in adamw and " 501.9 " in adamw and " 0.0% " in adamw
    assert " 2.031 " in adam8bit and " 127.4 " in adam8bit and " 74.6% " in adam8bit
    assert "hf_eff_auto here would choose" in out


def test_estimate_params_shows_one_row_where_options_change_nothing(capsys):
    """A bare count assumes no embeddings and no small tensors, so "every tensor 8-bit" and the default (32-bit
    embeddings) are the same figures: the table shows the default's row and says why the other is missing (the JSON
    keeps every row)."""
    rc, out, _ = run(capsys, "estimate", "--params", "1B", "--device", "cpu")
    words = " ".join(out.split())
    labels = [line.split("  ")[0] for line in out.splitlines()]
    assert rc == 0 and "hf_eff_adam8bit (default: 32-bit embeddings)" in labels
    assert "hf_eff_adam8bit, every tensor 8-bit" not in labels and "hf_eff_lion8bit, every tensor 8-bit" not in labels
    assert ("Not shown, the same figures as the row named: hf_eff_adam8bit, every tensor 8-bit = hf_eff_adam8bit "
            "(default: 32-bit embeddings);") in words and "--params assumes none" in words
    figures = [line.split()[-5:] for line in out.splitlines() if line.startswith("hf_eff_adam8bit")]
    assert len(figures) == len({tuple(f) for f in figures}), figures  # no two rows of one name alike
    rc, out, _ = run(capsys, "estimate", "--params", "1B", "--device", "cpu", "--json")
    assert "hf_eff_adam8bit, every tensor 8-bit" in rows_by_label(out)


def test_a_model_with_embeddings_shows_both_rows(capsys, tmp_path):
    from transformers import GPT2Config

    GPT2Config(vocab_size=256, n_embd=64, n_layer=1, n_head=2, n_positions=64,
               architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    rc, out, _ = run(capsys, "estimate", str(tmp_path), "--device", "cpu")
    labels = [line.split("  ")[0] for line in out.splitlines()]
    assert rc == 0 and "Not shown" not in out
    assert {"hf_eff_adam8bit, every tensor 8-bit", "hf_eff_adam8bit (default: 32-bit embeddings)"} <= set(labels)


def test_estimate_params_json(capsys):
    rc, out, _ = run(capsys, "estimate", "--params", str(N), "--device", "cpu", "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["num_params"] == N and "no embeddings" in data["assumption"]
    rows = rows_by_label(out)
    assert rows["hf_eff_adamw"]["state_bytes"] == 8 * N + 4 * TENSORS
    all8 = rows["hf_eff_adam8bit, every tensor 8-bit"]
    # CPU default (backend torch): uint8 m and v padded to whole 256-blocks, a float32 absmax per block for
    # each, and a float32 step per tensor (the code books are module constants)
    blocks = [-(-s // 256) for s in [2**20] * (TENSORS - 1) + [N % 2**20]]
    assert all8["state_bytes"] == sum(2 * 256 * b + 2 * 4 * b + 4 for b in blocks)
    assert all8["backend"] == "torch" and all8["saving"] == pytest.approx(0.746, abs=1e-3)
    assert rows["hf_eff_adam8bit (default: 32-bit embeddings)"]["state_bytes"] == all8["state_bytes"]  # none assumed
    assert rows["hf_eff_paged_adam8bit"]["name"] == "hf_eff_adam8bit"  # runs as adam8bit off CUDA
    assert rows["hf_eff_adafactor"]["state_bytes"] < N / 100


def test_estimate_local_config_directory(capsys, tmp_path):
    from transformers import DistilBertConfig

    DistilBertConfig(vocab_size=28996, architectures=["DistilBertForSequenceClassification"]).save_pretrained(tmp_path)
    rc, out, _ = run(capsys, "estimate", str(tmp_path), "--device", "cpu", "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["num_params"] == N and data["assumption"] is None and "DistilBertForSequenceClassification" in data["model"]
    rows = rows_by_label(out)
    assert round(rows["hf_eff_adamw"]["state_mb"]) == 502
    all8, default = rows["hf_eff_adam8bit, every tensor 8-bit"], rows["hf_eff_adam8bit (default: 32-bit embeddings)"]
    assert 125 < all8["state_mb"] < 128  # the reference: 125 MB at 2 B/param, 128 MB measured with bitsandbytes
    emb = 28996 * 768 + 512 * 768  # word + position embeddings: 32-bit state by default
    assert default["state_bytes"] - all8["state_bytes"] == pytest.approx(6 * emb, rel=0.01)
    rc, out, _ = run(capsys, "estimate", str(tmp_path), "--device", "cpu")
    words = " ".join(out.split())  # the heading wraps at 100 columns after a long path
    assert "DistilBertForSequenceClassification): 65,783,042 trainable parameters" in words and " 501.9 " in out


def test_estimate_measure_agrees_on_a_small_model(capsys, tmp_path):
    from transformers import GPT2Config

    GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=2, n_positions=64,
               architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    rc, out, _ = run(capsys, "estimate", str(tmp_path), "--device", "cpu", "--measure", "--json")
    assert rc == 0
    for row in json.loads(out)["rows"]:
        if "unavailable" in row:
            continue
        assert abs(row["measured_state_bytes"] - row["state_bytes"]) <= 0.03 * row["state_bytes"], row["label"]


def test_estimate_errors(capsys, tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["estimate"])
    with pytest.raises(SystemExit):
        cli.main(["estimate", "x", "--params", "10"])
    with pytest.raises(SystemExit):
        cli.main(["estimate", "--params", "10", "--measure"])
    rc, _, err = run(capsys, "estimate", str(tmp_path / "missing"))
    assert rc == 2 and "cannot load a config" in err and "--params N" in err
    rc, _, err = run(capsys, "estimate", "--params", "-5")
    assert rc == 2 and "positive" in err


def test_estimate_budget_decides_auto(capsys):
    picks = {}
    for budget in ("100", "12", "10"):  # 1e9 fp32 params: adamw needs 14.9 GB, adam8bit 9.3 GB, adafactor 7.5 GB
        rc, out, _ = run(capsys, "estimate", "--params", "1000000000", "--device", "cpu", "--budget-gb", budget, "--json")
        picks[budget] = json.loads(out)["auto"]["name"]
    assert picks == {"100": "hf_eff_adamw", "12": "hf_eff_adam8bit", "10": "hf_eff_adafactor"}


def test_absurd_numbers_are_refused_with_a_message(capsys):
    for budget in ("inf", "nan"):  # OverflowError before: int(inf * 2**30)
        rc, _, err = run(capsys, "estimate", "--params", "1000", "--device", "cpu", "--budget-gb", budget)
        assert rc == 2 and f"budget_gb' must be a finite number, got {budget}" in err
    rc, _, err = run(capsys, "estimate", "--params", "99999999999999999999")  # MemoryError before
    assert rc == 2 and "at most 1e+15" in err and "check the number" in err


def test_list_json_is_strict_json(capsys):
    rc, out, _ = run(capsys, "list", "--json")
    rows = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))  # hf_eff_auto printed NaN
    assert rc == 0 and {r["state_bytes_per_param"] for r in rows if r["name"] == "hf_eff_auto"} == {None}


def test_main_leaves_the_package_logger_as_it_found_it():
    """main() quiets hf_efficient's logger while it runs; a program (or test) that calls it keeps its own level."""
    import logging

    from hf_efficient.cli import main

    package_logger = logging.getLogger("hf_efficient")
    before = package_logger.level
    assert main(["list"]) == 0
    assert package_logger.level == before


@pytest.mark.parametrize("text, count", [("7e9", 7 * 10**9), ("7B", 7 * 10**9), ("350M", 350 * 10**6),
                                         ("1.3b", 1_300_000_000), ("65,783,042", N), ("125k", 125_000), ("2T", 2 * 10**12)])
def test_params_accepts_what_people_type(capsys, text, count):
    rc, out, _ = run(capsys, "estimate", "--params", text, "--device", "cpu", "--json")
    assert rc == 0 and json.loads(out)["num_params"] == count


@pytest.mark.parametrize("text", ["7x", "1.5", "B", "1e-3", ""])
def test_params_refuses_what_is_not_a_count(capsys, text):
    with pytest.raises(SystemExit):
        cli.main(["estimate", "--params", text])
    assert "is not a whole number of parameters" in capsys.readouterr().err


def test_a_missing_local_directory_says_so(capsys, tmp_path):
    """transformers reads a missing path as a malformed hub name ("Repo id must be in the form ...")."""
    for path in ("./no_such_model", str(tmp_path / "a" / "b"), "~/no_such_model_dir"):
        rc, _, err = run(capsys, "estimate", path)
        assert rc == 2 and "no such directory" in err and "Repo id" not in err, err
    rc, _, err = run(capsys, "estimate", str(tmp_path))  # exists, but holds no config
    assert rc == 2 and "has no config.json" in err, err


def test_dtype_leaves_no_identical_rows(capsys):
    """--dtype bf16 made "hf_eff_adamw" and "hf_eff_adamw (bf16 params)" (and every such pair) the same question."""
    rc, out, _ = run(capsys, "estimate", "--params", "1000000", "--device", "cpu", "--dtype", "bf16", "--json")
    rows = json.loads(out)["rows"]
    asked = [(r["label"].split()[0].rstrip(","), json.dumps(r["options"], sort_keys=True), r["param_dtype"])
             for r in rows]  # the name asked (paged runs as adam8bit: another question with the same answer)
    assert rc == 0 and len(asked) == len(set(asked)), asked
    assert "hf_eff_adamw" in rows_by_label(out) and "hf_eff_adamw (bf16 params)" not in rows_by_label(out)


@pytest.mark.parametrize("columns", [100, 80])
def test_tables_fit_the_terminal(capsys, tmp_path, monkeypatch, columns):
    """COLUMNS (a terminal's width; 100 where the output is no terminal): the tables were 100 wide in any terminal."""
    from transformers import GPT2Config

    monkeypatch.setenv("COLUMNS", str(columns))
    GPT2Config(vocab_size=256, n_embd=64, n_layer=1, n_head=2, n_positions=64,
               architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    for argv in (["list"], ["estimate", "--params", "7B", "--device", "cpu"],
                 ["estimate", "--params", "7B", "--device", "cpu", "--world-size", "8"],
                 ["estimate", str(tmp_path), "--device", "cpu", "--dtype", "bf16", "--measure"]):
        rc, out, _ = run(capsys, *argv)
        assert rc == 0 and not [line for line in out.splitlines() if len(line) > columns], (argv, out)
        assert "MB" not in out.replace("MiB", ""), out  # one unit: MiB / GiB


def test_list_says_what_adafactor_state_depends_on(capsys):
    rc, out, _ = run(capsys, "list")
    line = next(line for line in out.splitlines() if line.startswith("hf_eff_adafactor"))
    assert rc == 0 and "0.00" not in line and "<< 1" in line
    assert "depend on the shapes" in " ".join(out.split())
    rc, out, _ = run(capsys, "list", "--json")
    row = next(r for r in json.loads(out) if r["name"] == "hf_eff_adafactor")
    assert row["state_bytes_per_param"] is None and row["state_bytes_label"] == "<< 1"


def test_estimate_per_rank(capsys):
    rc, out, _ = run(capsys, "estimate", "--params", "1000000000", "--device", "cpu", "--world-size", "4", "--json")
    data, one = json.loads(out), rows_by_label(run(capsys, "estimate", "--params", "1000000000", "--device", "cpu",
                                                   "--json")[1])
    assert rc == 0 and (data["world_size"], data["sharding"]) == (4, "fsdp2")
    rows = {r["label"]: r for r in data["rows"]}
    assert rows["hf_eff_adamw"]["state_bytes"] < one["hf_eff_adamw"]["state_bytes"] / 3  # each rank a quarter
    assert not [label for label, r in rows.items() if "unavailable" in r]  # every name steps FSDP2 shards
    rc, out, _ = run(capsys, "estimate", "--params", "1000000000", "--device", "cpu", "--world-size", "4",
                     "--sharding", "zero2")
    assert rc == 0 and "bytes per rank of 4 (zero2)" in " ".join(out.split())
    rc, out, _ = run(capsys, "estimate", "--params", "1000000000", "--device", "cpu", "--world-size", "4",
                     "--sharding", "zero2", "--json")
    zero = {r["label"]: r for r in json.loads(out)["rows"]}
    assert "does not train under DeepSpeed ZeRO" in zero["hf_eff_adamw_bf16 (bf16 params)"]["unavailable"]
    with pytest.raises(SystemExit):
        run(capsys, "estimate", "--params", "1B", "--world-size", "0")
    assert "--world-size 0: the number of processes" in capsys.readouterr().err


def test_per_rank_legend_says_what_b_per_param_divides():
    """Under --world-size 4 the column is this rank's state over the whole model's parameters (a quarter of the
    one-process figure under FSDP2); the legend said "per parameter"."""
    import io
    from contextlib import redirect_stdout

    outs = {}
    for ranks in ("1", "4"):
        with redirect_stdout(io.StringIO()) as buf:
            assert cli.main(["estimate", "--params", "1B", "--device", "cpu", "--world-size", ranks]) == 0
        outs[ranks] = buf.getvalue()
    b_per_param = {k: float(next(line for line in v.splitlines() if line.startswith("hf_eff_adamw ")).split()[3])
                   for k, v in outs.items()}
    assert b_per_param["4"] == pytest.approx(b_per_param["1"] / 4, rel=0.01)
    assert "B/param: this rank's state bytes / the model's parameters" in " ".join(outs["4"].split())
    assert "B/param: state bytes per parameter" in outs["1"]


def test_sharding_without_world_size_is_refused(capsys):
    """--sharding zero2 alone was silently one unsharded process."""
    with pytest.raises(SystemExit):
        cli.main(["estimate", "--params", "1B", "--sharding", "zero2"])
    assert "--sharding zero2 splits the model among ranks: give their number, --world-size N" in capsys.readouterr().err
    rc, out, _ = run(capsys, "estimate", "--params", "1B", "--device", "cpu", "--sharding", "none", "--json")
    assert rc == 0 and json.loads(out)["world_size"] == 1


def test_an_unreachable_hub_name_says_so_in_one_sentence(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, _, err = run(capsys, "estimate", "hf-efficient-tests/no-such-model")
    assert rc == 2 and "cannot load a config for 'hf-efficient-tests/no-such-model'" in err, err
    assert ".." not in err and "\n" not in err.rstrip("\n") and err.rstrip().endswith(". Or give a count: --params N")


def test_estimate_with_gradient_release_counts_the_gradients_in_flight(capsys):
    """7B bf16 parameters, 4-bit state, gradients released: weights 2 B + state ~1.06 B per parameter, and of the
    gradients only a bucket and the largest tensor (the fit answer of the 24 GB recipe)."""
    rc, out, _ = run(capsys, "estimate", "--params", "7B", "--dtype", "bf16", "--device", "cpu", "--gradient-release",
                     "--json")
    row = rows_by_label(out)["hf_eff_adam4bit (default: 32-bit embeddings)"]
    assert rc == 0 and row["options"]["gradient_release"] is True
    assert row["grad_bytes"] == BUCKET_BYTES + 2 * 2**20  # --params assumes tensors of <= 1M elements
    assert 3.0 < row["total_bytes_per_param"] < 3.1 and row["total_bytes"] < 24 * 2**30
