"""The ``hf-efficient`` console script: ``hf_efficient/cli.py`` loaded by path, without the package.

Imported the usual way, ``hf_efficient.cli`` would first run ``hf_efficient/__init__``, which imports torch (seconds),
so ``--help``, ``--version`` and a refused argument would wait for it. cli.py parses with the standard library alone
and imports the package for a command that will run; loaded here under its own name, its relative imports still
resolve (they import the package then). Like ``_hf_efficient_autoload``, this module sits beside the package in every
install (wheel: site-packages; editable: the project root).
"""

import os
import sys
from importlib.util import module_from_spec, spec_from_file_location


def main() -> int:
    name = "hf_efficient.cli"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_efficient", "cli.py")
        spec = spec_from_file_location(name, path)
        module = module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name].main()
