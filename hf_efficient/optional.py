"""Optional dependencies: installed versions (read from metadata, no import), and imports that name the pip extra."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from functools import lru_cache

from packaging.requirements import Requirement
from packaging.version import Version

__all__ = ["version_of", "require", "install_hint"]

# package -> pip extra of hf_efficient that installs it
_EXTRAS = {"bitsandbytes": "bnb", "torchao": "torchao"}


@lru_cache(maxsize=None)
def version_of(package: str) -> Version | None:
    """Installed version of ``package``, or None; reads metadata only, never imports the package."""
    if importlib.util.find_spec(package) is None:
        return None
    try:
        return Version(importlib.metadata.version(package))
    except importlib.metadata.PackageNotFoundError:
        return None


def install_hint(package: str) -> str:
    """The pip command that installs ``package`` as this project's extra declares it (its version bound, read from the
    installed metadata), by the package's own name: hf_efficient is not on PyPI (it is installed from a checkout or
    a wheel built there), so an extra named through it would not be found."""
    extra = _EXTRAS.get(package)
    for req in _declared() if extra else ():
        if req.name == package and req.marker is not None and req.marker.evaluate({"extra": extra}):
            return f'pip install "{package}{req.specifier}" (the [{extra}] extra of hf_efficient)'
    return f"pip install {package}"


@lru_cache(maxsize=None)
def _declared() -> tuple[Requirement, ...]:
    """hf_efficient's requirements, extras included, from its installed metadata."""
    try:
        return tuple(Requirement(r) for r in importlib.metadata.requires("hf_efficient") or ())
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return ()


def require(package: str, why: str):
    """Import ``package`` or raise ImportError saying how to install it."""
    if version_of(package) is None:
        raise ImportError(f"{why} needs the optional package {package!r}, which is not installed: "
                          f"{install_hint(package)}")
    return importlib.import_module(package)
