"""What ``hf_efficient-autoload.pth`` runs when Python starts: ``hf_efficient/_autoload.py``, without the package.

Importing ``hf_efficient._autoload`` the usual way would run ``hf_efficient/__init__`` (torch: over a second) in
every Python process. Loaded by path under its own name it costs a file read; ``import hf_efficient`` later
finds it in ``sys.modules`` and shares its hook. This module sits beside the package in every install (wheel:
site-packages; editable: the project root), so the path is known without importing anything. It never
raises: Python prints any error from a .pth line at every start-up.

``HF_EFF_AUTOLOAD=0`` (or false / no / off) switches the hook off: nothing is loaded then.
"""

import os
import sys


def _load() -> None:
    name = "hf_efficient._autoload"
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_efficient", "_autoload.py")
    if name in sys.modules or not os.path.isfile(path):
        return
    # importlib.machinery, not importlib.util: util pulls in contextlib & co., milliseconds at every start-up
    from importlib.machinery import ModuleSpec, SourceFileLoader

    loader = SourceFileLoader(name, path)
    module = type(sys)(name)
    module.__spec__, module.__loader__, module.__file__ = ModuleSpec(name, loader, origin=path), loader, path
    module.__spec__.has_location = True
    sys.modules[name] = module
    try:
        loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    module.install()


try:
    if os.environ.get("HF_EFF_AUTOLOAD", "1").strip().lower() not in {"0", "false", "no", "off"}:
        _load()
except Exception:  # noqa: BLE001
    pass
