"""The hf_eff_* names reach transformers in any process, with no import in user code, from a real install.

The package is built from a copy of this checkout and installed into two fresh virtual environments that see
this interpreter's site-packages (torch, transformers): one from a wheel, one editable (``pip install -e``).
Every script below imports transformers only, never hf_efficient; each checks that the start-up hook that
served it is the one of the environment under test (not the checkout's own editable install).
"""

from __future__ import annotations

import configparser
import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PTH = "hf_efficient-autoload.pth"
SUBPROCESS_TIMEOUT = 300

# Prints what the test checks: optim accepted, which install served it, what got imported.
PLAIN = """
import json, sys
from transformers import TrainingArguments
args = TrainingArguments(sys.argv[1], optim="hf_eff_adam8bit", optim_args="embedding_state=8bit", report_to=[])
print(json.dumps({"optim": args.optim.value, "hf_efficient": sys.modules["hf_efficient"].__file__,
                  "hook": sys.modules["_hf_efficient_autoload"].__file__}))
"""
PARSER = """
import json, sys, torch
from transformers import HfArgumentParser, TrainingArguments
(args,) = HfArgumentParser((TrainingArguments,)).parse_args_into_dataclasses()
torch.save(args, args.output_dir + "/training_args.bin")  # what Trainer writes beside its checkpoints
print(json.dumps({"optim": args.optim.value, "optim_args": args.optim_args}))
"""
UNPICKLE = """
import json, sys, torch
args = torch.load(sys.argv[1], weights_only=False)  # how transformers' own scripts read training_args.bin
print(json.dumps({"optim": args.optim.value, "hf_efficient": "hf_efficient" in sys.modules}))
"""
TRAIN = """
import json, sys, torch
from transformers import Trainer, TrainingArguments

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}

data = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(8)]
args = TrainingArguments(sys.argv[1], optim="hf_eff_adafactor", max_steps=2, per_device_train_batch_size=4,
                         report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
trainer = Trainer(model=Tiny(), args=args, train_dataset=data)
trainer.train()
opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # Accelerate's wrapper
print(json.dumps({"optim": args.optim.value, "runs": opt.hf_efficient.resolution.name,
                  "hook": sys.modules["_hf_efficient_autoload"].__file__}))
"""
UNRELATED = """
import json, sys
print(json.dumps({"loaded": sorted(m for m in ("torch", "hf_efficient", "transformers") if m in sys.modules),
                  "hook": "_hf_efficient_autoload" in sys.modules}))
"""


def _copy_source(dest: Path) -> Path:
    dest.mkdir()
    for name in ("setup.py", "setup.cfg", "README.md", "_hf_efficient_autoload.py", "_hf_efficient_cli.py"):
        shutil.copy(REPO / name, dest / name)
    shutil.copytree(REPO / "hf_efficient", dest / "hf_efficient",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.o"))
    return dest


def _run(cmd, *, cwd=None, env=None, check=True, timeout=SUBPROCESS_TIMEOUT) -> subprocess.CompletedProcess:
    # no inherited PYTHONPATH: a checkout on it would serve the imports instead of the install under test
    full_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    full_env.update({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})})
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


def _last_json(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _venv(path: Path) -> Path:
    """A fresh venv that sees this interpreter's packages (torch, transformers, pip) but none of its .pth files.

    ``--system-site-packages`` would show the base interpreter's packages, not those of the venv the tests
    may run in; plain path lines in a .pth add this interpreter's site-packages without processing the .pth
    files there (this checkout's own editable install and hook stay out).
    """
    _run([sys.executable, "-m", "venv", "--without-pip", path])
    python = path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    (_site_packages(python) / "parent_site_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def _site_packages(python: Path) -> Path:
    return Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())


@pytest.fixture(scope="module")
def installs(tmp_path_factory):
    """``{"wheel": python, "editable": python}``: interpreters of two fresh installs of this checkout."""
    try:  # built offline with this interpreter's setuptools; >= 70.1 has bdist_wheel and editable_wheel
        import setuptools
    except ImportError:
        pytest.fail("tests/test_autoload.py builds the package offline: pip install 'setuptools>=70.1'")
    if tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (70, 1):
        pytest.fail(f"setuptools {setuptools.__version__} is too old to build offline: pip install 'setuptools>=70.1'")
    root = tmp_path_factory.mktemp("autoload")
    pip = ["-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation"]
    wheel_src = _copy_source(root / "wheel_src")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index", "--no-build-isolation",
          "-w", root / "dist", wheel_src])
    (wheel,) = (root / "dist").glob("hf_efficient-*.whl")
    out = {"wheel": _venv(root / "venv_wheel"), "editable": _venv(root / "venv_editable")}
    _run([out["wheel"], *pip, wheel])
    _run([out["editable"], *pip, "-e", _copy_source(root / "editable_src")])
    (root / "scripts").mkdir()
    for name, text in {"plain": PLAIN, "parser": PARSER, "unpickle": UNPICKLE, "train": TRAIN,
                       "unrelated": UNRELATED}.items():
        (root / "scripts" / f"{name}.py").write_text(textwrap.dedent(text))
    out["root"] = root
    return out


def _script(installs, name) -> Path:
    return installs["root"] / "scripts" / f"{name}.py"


def _assert_served_by(installs, kind, hook_file):
    """The hook that ran is the one of the install under test, not of the checkout's own install."""
    expected = _site_packages(installs[kind]) if kind == "wheel" else installs["root"] / "editable_src"
    assert Path(hook_file).resolve().is_relative_to(expected.resolve()), (hook_file, expected)


@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_plain_python_script(installs, kind, tmp_path):
    python = installs[kind]
    assert (_site_packages(python) / PTH).is_file(), f"the {kind} install lacks {PTH}"
    out = _last_json(_run([python, _script(installs, "plain"), tmp_path], cwd=tmp_path))
    assert out["optim"] == "hf_eff_adam8bit"
    _assert_served_by(installs, kind, out["hook"])


@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_console_script_answers_without_torch(installs, kind, tmp_path):
    """The installed ``hf-efficient`` finds cli.py beside its entry module (site-packages, or the checkout) and
    answers --version without importing the package; a command that runs imports it."""
    script = installs[kind].parent / "hf-efficient"
    proc = _run([script, "--version"], cwd=tmp_path, env={"PYTHONPROFILEIMPORTTIME": "1"})
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    assert proc.stdout.strip() == f"hf-efficient {cfg['metadata']['version']}", proc.stdout
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "_hf_efficient_cli" in imported and not {"torch", "hf_efficient"} & imported, sorted(imported)
    assert "hf_eff_adam8bit" in _run([script, "list"], cwd=tmp_path).stdout


def test_unrelated_program_imports_nothing_of_ours(installs, tmp_path):
    out = _last_json(_run([installs["wheel"], _script(installs, "unrelated")], cwd=tmp_path))
    assert out == {"loaded": [], "hook": True}  # the hook is there, and brought neither torch nor us


def test_hf_eff_autoload_0_switches_the_hook_off(installs, tmp_path):
    """The names are not registered, and transformers' refusal says whose name it is and what to do."""
    proc = _run([installs["wheel"], _script(installs, "plain"), tmp_path], cwd=tmp_path,
                env={"HF_EFF_AUTOLOAD": "0"}, check=False)
    assert proc.returncode != 0 and "'hf_eff_adam8bit' is an hf_efficient optimizer name" in proc.stderr
    assert "HF_EFF_AUTOLOAD=0" in proc.stderr and "`import hf_efficient` before" in proc.stderr, proc.stderr[-2000:]


def test_an_unknown_hf_eff_autoload_value_is_warned_about_once(installs, tmp_path):
    """HF_EFF_AUTOLOAD=garbage was silently "on": it still is (the default), with one warning naming the values."""
    proc = _run([installs["wheel"], _script(installs, "plain"), tmp_path], cwd=tmp_path,
                env={"HF_EFF_AUTOLOAD": "garbage"})
    assert _last_json(proc)["optim"] == "hf_eff_adam8bit"
    assert proc.stderr.count("HF_EFF_AUTOLOAD='garbage' is not understood") == 1, proc.stderr[-2000:]
    assert "1, true, yes, on (on) or 0, false, no, off (off)" in proc.stderr


def test_pickled_training_args_name_hf_efficient(installs, tmp_path):
    """training_args.bin pickles an hf_eff_* optim through hf_efficient: it loads with the hook off (unpickling
    imports hf_efficient, which registers the names), and where hf_efficient is missing the error names it, not
    transformers' "is not a valid OptimizerNames"."""
    python = installs["editable"]
    _run([python, _script(installs, "parser"), "--output_dir", tmp_path, "--report_to", "none", "--optim",
          "hf_eff_lion8bit"], cwd=tmp_path)
    unpickle = [_script(installs, "unpickle"), tmp_path / "training_args.bin"]
    out = _last_json(_run([python, *unpickle], cwd=tmp_path, env={"HF_EFF_AUTOLOAD": "0"}))
    assert out == {"optim": "hf_eff_lion8bit", "hf_efficient": True}
    bare = _venv(installs["root"] / "venv_without_hf_efficient")  # sees torch and transformers, not us
    proc = _run([bare, *unpickle], cwd=tmp_path, check=False)
    assert proc.returncode != 0 and "No module named 'hf_efficient'" in proc.stderr, proc.stderr[-2000:]
    assert "is not a valid OptimizerNames" not in proc.stderr


def test_hf_argument_parser_and_unpickled_training_args(installs, tmp_path):
    python = installs["editable"]
    cli = [python, _script(installs, "parser"), "--output_dir", tmp_path, "--report_to", "none"]
    out = _last_json(_run([*cli, "--optim", "hf_eff_adam8bit", "--optim_args", "embedding_state=8bit"],
                          cwd=tmp_path))
    assert out == {"optim": "hf_eff_adam8bit", "optim_args": "embedding_state=8bit"}
    # a fresh process reads the pickled arguments: unpickling imports transformers.training_args, and the hook
    out = _last_json(_run([python, _script(installs, "unpickle"), tmp_path / "training_args.bin"], cwd=tmp_path))
    assert out == {"optim": "hf_eff_adam8bit", "hf_efficient": True}
    # argparse lists the names as choices and refuses others; a bad optim_args fails in the parser already
    bad = _run([*cli, "--optim", "hf_eff_nope"], cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "invalid choice: 'hf_eff_nope'" in bad.stderr and "hf_eff_adam8bit" in bad.stderr
    bad = _run([*cli, "--optim", "hf_eff_adam8bit", "--optim_args", "bta1=0.9"], cwd=tmp_path, check=False)
    assert bad.returncode != 0 and "unknown option 'bta1'" in bad.stderr


def test_accelerate_launch(installs, tmp_path):
    out = _last_json(_run([installs["editable"], "-m", "accelerate.commands.launch", "--cpu", "--num_processes",
                           "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           _script(installs, "train"), tmp_path], cwd=tmp_path))
    assert out["optim"] == "hf_eff_adafactor" and out["runs"] == "adafactor"
    _assert_served_by(installs, "editable", out["hook"])


def test_torchrun(installs, tmp_path):
    out = _last_json(_run([installs["editable"], "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "1", _script(installs, "train"), tmp_path], cwd=tmp_path))
    assert out["optim"] == "hf_eff_adafactor" and out["runs"] == "adafactor"
    _assert_served_by(installs, "editable", out["hook"])


def test_notebook_kernel(installs, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    # a kernel spec that runs the editable environment's interpreter, found through JUPYTER_PATH
    spec_dir = tmp_path / "jupyter" / "kernels" / "hfeff"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [str(installs["editable"]), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "hf_efficient test", "language": "python"}))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import sys\nfrom transformers import TrainingArguments\n"
        f"args = TrainingArguments({str(tmp_path)!r}, optim='hf_eff_adam8bit', report_to=[])\n"
        "print(args.optim.value, sys.modules['_hf_efficient_autoload'].__file__)")])
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = str(tmp_path / "jupyter")
    try:
        nbclient.NotebookClient(nb, kernel_name="hfeff", timeout=SUBPROCESS_TIMEOUT,
                                resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        os.environ.pop("JUPYTER_PATH") if old is None else os.environ.__setitem__("JUPYTER_PATH", old)
    text = "".join(o.get("text", "") for o in nb.cells[0].outputs if o.get("name") == "stdout")
    optim, hook = text.strip().splitlines()[-1].split()
    assert optim == "hf_eff_adam8bit"
    _assert_served_by(installs, "editable", hook)


def test_broken_package_never_breaks_transformers(installs, tmp_path):
    # an hf_efficient that fails to import, first on the path: transformers must work, with one warning
    broken = tmp_path / "broken" / "hf_efficient"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise RuntimeError('broken on purpose')\n")
    script = tmp_path / "uses_transformers.py"
    script.write_text("from transformers import Trainer, TrainingArguments\n"
                      f"print(TrainingArguments({str(tmp_path)!r}, optim='adamw_torch', report_to=[]).optim.value)\n")
    proc = _run([installs["wheel"], script], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "broken")})
    assert proc.stdout.strip().splitlines()[-1] == "adamw_torch"
    assert proc.stderr.count("hf_efficient could not register its optimizer names") == 1, proc.stderr
    assert "RuntimeError: broken on purpose" in proc.stderr


# --- in this interpreter: the import itself ---------------------------------------------------------------

def _python(code: str, cwd: Path, **env) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env)


def test_import_loads_no_transformers(tmp_path):
    out = _python("""
        import json, sys
        import hf_efficient
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "accelerate"))))
        """, tmp_path)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("first", ["hf_efficient", "transformers"])
def test_import_registers_even_with_the_hook_off(first, tmp_path):
    # HF_EFF_AUTOLOAD=0 switches off the start-up hook only: an explicit import still registers the names,
    # whether transformers is imported before it or after
    order = ["import hf_efficient", "from transformers import Trainer, TrainingArguments"]
    out = _python("\n".join(order if first == "hf_efficient" else order[::-1]) + """
import json
args = TrainingArguments("out", optim="hf_eff_adamw", report_to=[])
print(json.dumps([args.optim.value, getattr(Trainer, "_hf_eff_patched", False)]))
""", tmp_path, HF_EFF_AUTOLOAD="0")
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["hf_eff_adamw", True]
