"""Optional dependencies: installed versions (read from metadata, no import), and imports that name the pip extra."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from functools import lru_cache

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
    """The pip command that installs ``package`` the way this project declares it."""
    extra = _EXTRAS.get(package)
    return f'pip install "hf_efficient[{extra}]"' if extra else f"pip install {package}"


def require(package: str, why: str):
    """Import ``package`` or raise ImportError saying how to install it."""
    if version_of(package) is None:
        raise ImportError(f"{why} needs the optional package {package!r}, which is not installed: "
                          f"{install_hint(package)}")
    return importlib.import_module(package)
