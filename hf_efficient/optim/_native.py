"""This package's C kernels: compiled once per machine with the system C compiler, loaded with ctypes.

Why ctypes and plain C rather than a torch extension: a C file of one loop compiles in under a second
with no torch headers and no ninja. Built with OpenMP, a kernel splits its elements over torch's own thread
pool: the libgomp torch loaded has the soname the library asks for, so the loader hands it that one. (Python
threads, the fallback where the compiler lacks OpenMP, compete for the cores with torch's threads, which
spin for a while after every parallel op: a step right after the backward pass runs markedly slower.)
The library is cached under ``$HF_EFF_CACHE`` (default ``~/.cache/hf_efficient``; see :func:`cache_dir`), keyed by source, headers,
flags, compiler, CPU flags (``-march=native`` code must not meet another CPU), OS and libc. A build is made
under a file lock (N ranks of one machine build once), renamed into place, and recorded (its sha256, beside it)
only once it loaded; a cached file that does not match its record is rebuilt, never loaded. Any failure returns
None, logged once at WARNING, and the caller keeps its other path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import shlex
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch

__all__ = ["cache_dir", "check_thread_limit", "c_compiler", "load", "bind", "plain", "run_split"]

logger = logging.getLogger(__name__)

# -ffp-contract=off: no fused multiply-add, every fp32 operation rounds as torch's eager ops do. -fno-math-errno and
# -fno-trapping-math (exception flags only, never results) let gcc vectorize sqrtf and floorf.
# -mprefer-vector-width=512 (x86 only): gcc 12 picks 256-bit vectors on Zen 4, and the bf16 kernel's hash runs
# slower in them. The CPU's own instructions: -march=native on x86, -mcpu=native on Arm (its instructions and tuning).
_X86 = ["-march=native", "-mprefer-vector-width=512"]
_ARM = ["-mcpu=native"]
_ARCH = {"x86_64": _X86, "AMD64": _X86, "aarch64": _ARM, "arm64": _ARM}.get(platform.machine(), [])
_FLAGS = ["-O3", *_ARCH, "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]
_OPENMP = "-fopenmp"
_MIN_PER_THREAD = 1 << 16  # elements below which one more thread costs more than it saves


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


_WARNED: set = set()


def _warn_once(key, msg: str, *args) -> None:
    """Log a fallback at WARNING, once per process and ``key``."""
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(msg, *args)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _recorded(lib: Path) -> bool:
    """``lib`` exists and its bytes are those recorded beside it after it was built and loaded. A file that is not
    (truncated by a full disk or a killed copy, another build's) must never reach ``ctypes.CDLL``: the loader maps
    it, and reading past a truncated file's end ends the process with SIGBUS."""
    record = lib.with_name(lib.name + ".sha256")
    try:
        return record.read_text().strip() == _sha256(lib)
    except OSError:
        return False


@contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` (created), so that N processes of one machine (ranks) build a library once
    while the others wait for it. Where the file system has no locks, building still works: the rename is atomic."""
    with open(path, "a") as f:
        try:
            import fcntl

            fcntl.flock(f, fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass
        yield  # closing the file releases the lock


def cache_dir() -> Path:
    """Where built kernels are kept: ``$HF_EFF_CACHE`` as an absolute path, or ``~/.cache/hf_efficient`` when it is
    unset or empty. Absolute because ``ctypes.CDLL`` looks a bare file name ("x.so", from ``HF_EFF_CACHE=.``) up on
    the loader's search path, not in the working directory: the load fails and every run would rebuild."""
    value = os.environ.get("HF_EFF_CACHE", "").strip()
    return (Path(value).expanduser() if value else Path.home() / ".cache" / "hf_efficient").absolute()


def _announce_build(src: Path, cache: Path) -> None:
    """Say that a kernel is being compiled, before it is: a first step that pauses for the build with no word looks
    hung. The first build of a process logs at WARNING (INFO is hidden unless logging is configured, and
    transformers' default verbosity hides its own INFO too); further files at INFO."""
    first = "build notice" not in _WARNED
    _WARNED.add("build notice")
    logger.log(logging.WARNING if first else logging.INFO, "hf_efficient: compiling the C kernel %s for this CPU, "
               "once per machine (cached in %s; set HF_EFF_CACHE to move it); the first step waits for it",
               src.name, cache)


def _build(cc: list[str], src: Path, flags: list[str], version: str) -> ctypes.CDLL:
    """The loaded library of ``src`` built with ``flags``: from the cache if its file matches its record, else
    built (under a lock, into a temporary file renamed into place), loaded, and only then recorded."""
    headers = "".join(h.read_text() for h in sorted(src.parent.glob("*.h")))
    key = hashlib.sha256("\0".join([src.read_text(), headers, *flags, *cc, version, _cpu_flags(), platform.machine(),
                                    platform.system(), *platform.libc_ver()]).encode()).hexdigest()[:16]
    cache = cache_dir()
    lib = cache / f"{src.stem}-{key}.so"
    if _recorded(lib):
        return ctypes.CDLL(str(lib))
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / f"{lib.name}.lock"):
        if _recorded(lib):  # another process built it while this one waited
            return ctypes.CDLL(str(lib))
        if lib.exists():
            _warn_once(("bad cache", str(lib)), "hf_efficient: the cached kernel %s does not match its build record "
                       "(truncated or foreign); rebuilding it", lib)
        _announce_build(src, cache)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # build beside, then rename: atomic
            out = Path(tmp) / lib.name
            subprocess.run([*cc, *flags, str(src), "-o", str(out), "-lm"], check=True, capture_output=True,
                           text=True, timeout=120)
            digest = _sha256(out)
            os.replace(out, lib)
        handle = ctypes.CDLL(str(lib))
        record = cache / f"{lib.name}.sha256.tmp{os.getpid()}"
        record.write_text(digest)
        os.replace(record, lib.with_name(lib.name + ".sha256"))
        return handle


def c_compiler() -> str | None:
    """The C compiler the kernels are built with: ``$CC`` (a command line, split as a shell would: "ccache gcc"),
    else the first of cc, gcc, clang on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@lru_cache(maxsize=None)
def load(source: str) -> ctypes.CDLL | None:
    """The compiled library of ``source`` (a file beside this module), or None with a reason logged once at
    WARNING. Its attribute ``openmp`` says whether it was built with OpenMP (else :func:`run_split` uses Python
    threads)."""
    cc = c_compiler()
    if cc is None or platform.system() == "Windows":
        _warn_once("no compiler", "hf_efficient: no C compiler found (set CC, or install gcc or clang); the C kernels "
                   "are not used and the slower paths run instead")
        return None
    src = Path(__file__).with_name(source)
    try:
        argv = shlex.split(cc)
        version = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=30).stdout
        try:
            lib = _build(argv, src, [*_FLAGS, _OPENMP], version)
            lib.openmp = True
        except (OSError, subprocess.SubprocessError):  # no OpenMP with this compiler (Apple clang): without
            lib = _build(argv, src, _FLAGS, version)
            lib.openmp = False
        return lib
    except (OSError, ValueError, subprocess.SubprocessError) as e:  # ValueError: CC that shlex cannot split
        detail = getattr(e, "stderr", "") or e
        _warn_once(("build", source, cc), "hf_efficient: could not build %s (%s); using the slower path", source,
                   detail)
        return None


def bind(lib: ctypes.CDLL, symbol: str, argtypes: list, restype=None):
    """``lib``'s function ``symbol`` with its C signature, for :func:`run_split` (which reads its ``openmp``)."""
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype, fn.openmp = argtypes, restype, lib.openmp
    return fn


def plain(*tensors: torch.Tensor) -> bool:
    """No tensor subclass among ``tensors``: a subclass (an FSDP2 DTensor shard, whose ``numel()`` is global) is
    not memory a kernel may address."""
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


@lru_cache(maxsize=None)
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hf_eff_native")


def run_split(fn, args: tuple, n: int, unit: int = 1, align: int = 64, threads: int | None = None) -> list:
    """``fn(*args, start, end, threads)`` (a :func:`bind` result) over ``[0, n)`` (items of ``unit`` elements) on up
    to torch's thread count: one call that splits the range over its OpenMP threads, or (a library without
    OpenMP) one call per Python thread on disjoint ranges. Returns what the calls returned. ``threads`` forces the
    count (probes: a kernel must split any range right, over any team OpenMP gives it)."""
    if threads is None:
        threads = max(1, min(torch.get_num_threads(), n * unit // _MIN_PER_THREAD))
    if fn.openmp or threads == 1:
        return [fn(*args, 0, n, threads)]
    per = -(-n // threads // align) * align
    futures = [_pool(threads).submit(fn, *args, a, min(a + per, n), 1) for a in range(0, n, per)]
    return [f.result() for f in futures]


_THREAD_LIMIT_WARNED: set = set()


def check_thread_limit() -> str | None:
    """Warn once if ``OMP_THREAD_LIMIT`` is below torch's thread count, and return the warning.

    Our kernels split by the team OpenMP really gives them, but torch's own are not all so careful: with
    ``OMP_THREAD_LIMIT=1`` and 2 threads asked for, torch 2.13's oneDNN bf16 linear backward returns NaN input
    gradients (seen on this project's CI machine). The guard then refuses the step; the cure is to ask torch
    for no more threads than the limit allows.
    """
    limit = os.environ.get("OMP_THREAD_LIMIT", "").strip()
    if not limit.isdigit() or int(limit) >= torch.get_num_threads():
        return None
    msg = (f"OMP_THREAD_LIMIT={limit} is below torch's thread count ({torch.get_num_threads()}): some of torch's own "
           f"CPU kernels then compute wrong results (NaN bf16 gradients seen with torch 2.13). Call "
           f"torch.set_num_threads({limit}) (or set OMP_NUM_THREADS={limit}) before training.")
    if msg not in _THREAD_LIMIT_WARNED:
        _THREAD_LIMIT_WARNED.add(msg)
        logger.warning("hf_efficient: %s", msg)
    return msg
