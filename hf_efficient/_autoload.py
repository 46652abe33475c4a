"""Registers hf_efficient's ``hf_eff_*`` names with transformers in every process, at no cost until it matters.

``hf_efficient-autoload.pth`` (installed into site-packages by wheels and editable installs alike) loads
this module when Python starts, through ``_hf_efficient_autoload``. It only puts a finder on
``sys.meta_path`` that watches for two module names; when ``transformers.training_args`` or
``transformers.trainer`` has been imported, it applies hf_efficient's patches to it
(``hf_efficient.integrations.transformers``). A process that never imports transformers pays one
dictionary lookup per import and never imports hf_efficient or torch.

The start-up hook loads this file by path, without running ``hf_efficient/__init__`` (torch: over a
second); ``import hf_efficient`` later finds it in ``sys.modules`` and uses the same hook. So this file
imports nothing but ``sys``, which every interpreter has loaded already.

Never breaks the program that imports transformers: a failure to patch is logged once, as a warning, and
transformers carries on without the names. ``HF_EFF_AUTOLOAD=0`` (or false / no / off) switches the
start-up hook off (``_hf_efficient_autoload`` reads it): it then installs this hook with ``hint_only``, which
registers nothing and only makes transformers' refusal of an ``hf_eff_*`` name say why and what to do;
``import hf_efficient`` still installs the full hook.
"""

import sys

__all__ = ["install", "patched"]

# module transformers imports -> function of hf_efficient.integrations.transformers that patches it.
# training_args first: trainer imports it, and a module already loaded is patched in this order.
_TARGETS = {"transformers.training_args": "patch_training_args", "transformers.trainer": "patch_trainer"}
_INTEGRATION = "hf_efficient.integrations.transformers"
_applied = set()  # modules patched so far
_busy = set()  # modules being patched: patching imports hf_efficient, whose import calls install() again
_reported = []  # the one failure logged, if any
_hint_only = []  # [True] while only the hint is installed (HF_EFF_AUTOLOAD=0, hf_efficient not imported)


def patched() -> list:
    """Names of the transformers modules patched so far in this process (for tests and diagnostics)."""
    return sorted(_applied)


def _initializing(module) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _apply(name: str, module) -> None:
    """Patch ``module`` (the patches are idempotent); any error is logged (once per process) and swallowed."""
    if name in _busy:
        return
    _busy.add(name)
    try:
        if _hint_only:
            if name == "transformers.training_args":
                _explain_unknown_names(module)
            return
        from importlib import import_module

        getattr(import_module(_INTEGRATION), _TARGETS[name])(module)
        _applied.add(name)
    except Exception as exc:  # noqa: BLE001 (a broken plugin must not break the user's program)
        if not _reported:
            _reported.append(exc)
            import logging

            logging.getLogger("hf_efficient.autoload").warning(
                "hf_efficient could not register its optimizer names with %s (%s: %s); transformers works "
                "without them (the hf_eff_* names are unknown). Reinstall hf_efficient, or set HF_EFF_AUTOLOAD=0 "
                "to skip this hook.", name, type(exc).__name__, exc, exc_info=True)
    finally:
        _busy.discard(name)


def _explain_unknown_names(module) -> None:
    """With the hook off, make ``OptimizerNames``' refusal of an ``hf_eff_*`` name say that hf_efficient owns it
    and how to register it, instead of transformers' bare "is not a valid OptimizerNames"."""
    names = module.OptimizerNames
    original = names._missing_

    def _missing_(cls, value):
        if isinstance(value, str) and value.startswith("hf_eff_"):
            raise ValueError(f"{value!r} is an hf_efficient optimizer name, and hf_efficient's start-up hook is off "
                             f"(HF_EFF_AUTOLOAD=0), so transformers does not know it: `import hf_efficient` before "
                             f"making TrainingArguments, or unset HF_EFF_AUTOLOAD")
        return original(value)

    names._missing_ = classmethod(_missing_)


class _Loader:
    """The real loader of a watched module, with our patch run right after the module's body."""

    def __init__(self, loader, name: str):
        self._loader, self._name = loader, name

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        # the module keeps its real loader (inspect, importlib.resources and reload ask it)
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _apply(self._name, module)

    def __getattr__(self, attr):  # get_source, get_resource_reader, is_package...: the real loader's
        if attr == "_loader":  # not set yet (a copy): no recursion
            raise AttributeError(attr)
        return getattr(self._loader, attr)


class _Finder:
    """A ``sys.meta_path`` finder that finds nothing itself: it wraps the loader of the watched modules."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _TARGETS:
            return None
        for finder in sys.meta_path:  # the finder that would have found it without us
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, fullname)
        return spec

    def __repr__(self):
        return "<hf_efficient autoload finder>"


_FINDER = _Finder()


def install(hint_only: bool = False) -> None:
    """Watch for transformers' modules, and patch those already imported; safe to call again. ``hint_only`` (the
    start-up hook under HF_EFF_AUTOLOAD=0) registers no names; a later full install still registers them."""
    if hint_only and not _applied:
        _hint_only[:] = [True]
    else:
        _hint_only.clear()
    if not any(f is _FINDER for f in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)
    for name in _TARGETS:
        module = sys.modules.get(name)
        if module is not None and not _initializing(module):  # one being imported is patched by the finder
            _apply(name, module)
