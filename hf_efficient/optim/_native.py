"""This package's C kernels: compiled once per machine with the system C compiler, loaded with ctypes.

Why ctypes and plain C rather than a torch extension: a C file of one loop compiles in under a second
with no torch headers and no ninja, and a ctypes call releases the GIL, so a few Python threads run it in
parallel on disjoint ranges. The library is cached under ``$HF_EFF_CACHE`` (default
``~/.cache/hf_efficient``), keyed by source, flags, compiler and CPU flags (``-march=native`` code must not
meet another CPU). Any failure returns None and the caller keeps its other path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import torch

__all__ = ["load", "parallel_ranges"]

logger = logging.getLogger(__name__)

_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
_MIN_PER_THREAD = 1 << 16  # elements below which one more thread costs more than it saves


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


@lru_cache(maxsize=None)
def load(source: str) -> ctypes.CDLL | None:
    """The compiled library of ``source`` (a file beside this module), or None with a logged reason."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None or platform.system() == "Windows":
        logger.info("hf_efficient: no C compiler found; %s is not used", source)
        return None
    src = Path(__file__).with_name(source)
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([src.read_text(), *_FLAGS, version, _cpu_flags(), platform.machine()])
                             .encode()).hexdigest()[:16]
        cache = Path(os.environ.get("HF_EFF_CACHE", Path.home() / ".cache" / "hf_efficient"))
        lib = cache / f"{src.stem}-{key}.so"
        if not lib.exists():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:  # build beside, then rename: atomic
                out = Path(tmp) / lib.name
                subprocess.run([cc, *_FLAGS, str(src), "-o", str(out), "-lm"], check=True, capture_output=True,
                               text=True, timeout=120)
                os.replace(out, lib)
        return ctypes.CDLL(str(lib))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("hf_efficient: could not build %s (%s); using the slower path", source, detail)
        return None


@lru_cache(maxsize=None)
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hf_eff_native")


def parallel_ranges(fn, n: int, align: int = 64) -> None:
    """Call ``fn(start, end)`` on disjoint ranges covering ``[0, n)``, on up to torch's thread count."""
    threads = max(1, min(torch.get_num_threads(), n // _MIN_PER_THREAD))
    if threads == 1:
        fn(0, n)
        return
    per = -(-n // threads // align) * align
    futures = [_pool(threads).submit(fn, a, min(a + per, n)) for a in range(0, n, per)]
    for f in futures:
        f.result()
