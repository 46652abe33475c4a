"""What ``hf_efficient-autoload.pth`` runs when Python starts: ``hf_efficient/_autoload.py``, without the package.

Importing ``hf_efficient._autoload`` the usual way would run ``hf_efficient/__init__`` (torch: over a second) in
every Python process. Loaded by path under its own name it costs a file read; ``import hf_efficient`` later
finds it in ``sys.modules`` and shares its hook. This module sits beside the package in every install (wheel:
site-packages; editable: the project root), so the path is known without importing anything. It never
raises: Python prints any error from a .pth line at every start-up.

``HF_EFF_AUTOLOAD=0`` (or false / no / off) switches the hook off: the names are not registered, and the hook only
makes transformers' refusal of an ``hf_eff_*`` name say why and what to do. Any other value but 1 / true / yes / on
(or empty) is warned about once, naming those values, and leaves the hook on.
"""

import os
import sys


_ON, _OFF = ("1", "true", "yes", "on", ""), ("0", "false", "no", "off")


def _enabled() -> bool:
    """Whether ``HF_EFF_AUTOLOAD`` leaves the hook on; an unknown value is warned about (logging is imported then
    only: this runs at every start-up) and counts as on, the default."""
    value = os.environ.get("HF_EFF_AUTOLOAD", "1").strip().lower()
    if value not in _ON + _OFF:
        import logging

        logging.getLogger("hf_efficient.autoload").warning(
            "hf_efficient: HF_EFF_AUTOLOAD=%r is not understood; the start-up hook stays on. Use one of %s (on) or "
            "%s (off)", os.environ["HF_EFF_AUTOLOAD"], ", ".join(_ON[:-1]), ", ".join(_OFF))
    return value not in _OFF


def _load(enabled: bool) -> None:
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
    module.install(hint_only=not enabled)


try:
    _load(_enabled())
except Exception:  # noqa: BLE001
    pass
