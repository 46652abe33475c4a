"""Builds hf_efficient; ships ``hf_efficient-autoload.pth`` into site-packages for wheel and editable installs.

transformers has no plugin entry point for optimizer names, so a .pth file (run by ``site`` at every start-up)
installs a cheap hook that registers them when transformers is imported (``hf_efficient/_autoload.py``).
setuptools has no option for a file at the root of site-packages, so two commands put it there:

- ``build_py`` writes it at the root of ``build_lib``, which becomes the root of the wheel;
- ``editable_wheel`` (``pip install -e``) runs no ``build_py`` copy and writes only its own .pth, so it adds
  ours to the files it puts in the editable wheel.

Its name sorts after setuptools' ``__editable__.*.pth``, so in an editable install the finder that locates
``_hf_efficient_autoload`` is in place when our line runs.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "hf_efficient-autoload.pth"
# One line: site.py executes lines starting with "import"; the module never raises (see its docstring).
PTH_TEXT = "import _hf_efficient_autoload\n"


def _write_pth(directory) -> str:
    path = Path(directory, PTH_NAME)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(PTH_TEXT)
    return str(path)


class build_py_with_pth(build_py):
    """build_py, plus the .pth file at the root of the build directory (hence of the wheel)."""

    def run(self):
        super().run()
        if not self.editable_mode:
            _write_pth(self.build_lib)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, str(Path(self.build_lib, PTH_NAME))]


cmdclass = {"build_py": build_py_with_pth}
try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64: `pip install -e` runs `develop`, which this does not cover
    editable_wheel = None

if editable_wheel is not None and hasattr(editable_wheel, "_run_build_commands"):

    class editable_wheel_with_pth(editable_wheel):
        """editable_wheel, plus the .pth file among the files it writes into the editable wheel.

        ``_run_build_commands`` fills the directory whose every file goes into the wheel (headers, scripts,
        data); there is no public hook for a file at the wheel's root. tests/test_autoload.py checks it.
        """

        def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
            result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
            _write_pth(unpacked_wheel)
            return result

    cmdclass["editable_wheel"] = editable_wheel_with_pth

setup(cmdclass=cmdclass)
