"""The C kernels and their cache (hf_efficient/optim/_native.py, native.h): every element done whatever OpenMP team
the kernels get, probes that refuse a kernel splitting its range wrongly, the gradient scan's limits, and a kernel
cache that heals itself.

CI runs this file again under other OpenMP settings (each test then checks the kernels under that setting too):

    OMP_THREAD_LIMIT=1 python -m pytest -q tests/test_native.py
    OMP_DYNAMIC=true python -m pytest -q tests/test_native.py
    OMP_NUM_THREADS=3 python -m pytest -q tests/test_native.py

The subprocess tests below run the same check under each setting within one ordinary run.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hf_efficient import nonfinite
from hf_efficient.optim import _dispatch, _native
from hf_efficient.optim import adamw8bit as m8
from hf_efficient.optim import adamw_bf16 as mbf
from hf_efficient.optim import muon8bit

needs_compiler = pytest.mark.skipif(_native.c_compiler() is None, reason="no C compiler: the C kernels are not built")
CPU = torch.device("cpu")
# 2**20 + 1 elements: 4097 blocks of the 8-bit kernel, and a range whose halves are multiples of 64 but for one
# item, which a split rounding the share down (and not up) leaves undone
N = (1 << 20) + 1


def _bound(kernel: _dispatch.CKernel):
    """``kernel``'s C function, bound but not probed (None without a C compiler)."""
    lib = _native.load(kernel.source)
    return None if lib is None else _native.bind(lib, kernel.symbol, kernel.argtypes, kernel.restype)


def _bound_8bit():
    return _bound(m8.AdamW8bit.c_kernel())


def _bound_bf16():
    return _bound(mbf._NATIVE)


def _bound_scan():
    return _bound(nonfinite._SCAN)


def _scan(fn, grads, threads=None) -> int:
    return nonfinite._scan(fn, grads, threads)


def check_every_element_done() -> None:
    """The C kernels called directly (no probe in between), on torch's thread count and on 2, 3 and 4 threads asked
    for: every weight of a 2**20 + 1 element tensor moves (8-bit and bf16 kernels), and the scan finds a NaN and
    a 2**64 in its last element. Runs here and, under other OpenMP settings, in subprocesses."""
    f8, fb, scan = _bound_8bit(), _bound_bf16(), _bound_scan()
    for threads in (None, 2, 3, 4):
        p = torch.zeros(N)
        m8.AdamW8bit.native_step(f8, [(p, torch.ones(N), m8.AdamW8bit.zero_state(N, CPU), m8.AdamW8bit.coefficients(
            dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0), 1), 0)], threads=threads)
        assert (p != 0).all(), f"8-bit kernel, {threads} threads: {(p == 0).sum().item()} of {N} weights not updated"
        p = torch.ones(N, dtype=torch.bfloat16)
        state = [torch.zeros(N, dtype=torch.bfloat16) for _ in range(3)]
        coef = mbf._coefficients(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
        mbf._native_path(fb, "kahan", [p], [torch.ones_like(p)], *([s] for s in state), [7], coef, threads=threads)
        assert (p != 1).all(), f"bf16 kernel, {threads} threads: {(p == 1).sum().item()} of {N} weights not updated"
        for dtype, value in ((torch.float32, float("nan")), (torch.bfloat16, float("nan")), (torch.float32, 2.0**64),
                             (torch.bfloat16, 2.0**64), (torch.float16, float("inf"))):
            g = torch.zeros(N, dtype=dtype)
            g[-1] = value
            assert _scan(scan, [torch.zeros(5, dtype=dtype), g], threads) == 1, (dtype, value, threads)
    assert m8.AdamW8bit.native_fn() is not None, "the 8-bit probe refused a correct kernel"
    assert mbf._native_fn() is not None, "the bf16 probe refused a correct kernel"


@needs_compiler
def test_every_element_done_under_this_openmp_setting():
    check_every_element_done()


@needs_compiler
@pytest.mark.parametrize("env", [{"OMP_THREAD_LIMIT": "1"}, {"OMP_DYNAMIC": "true"}, {"OMP_NUM_THREADS": "3"}],
                         ids=["OMP_THREAD_LIMIT=1", "OMP_DYNAMIC=true", "OMP_NUM_THREADS=3"])
def test_every_element_done_under_other_openmp_settings(env):
    """OpenMP may give a team smaller than asked (a thread limit, dynamic teams on a loaded machine) or an odd one:
    the kernels split by the team they got."""
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_native; " \
           "test_native.check_every_element_done(); print('done')"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-3000:]


def _first_share_only(real):
    """``real`` as a kernel splitting by the team size it asked for would run when OpenMP gives it one thread:
    only the first thread's share of the range is done."""
    def fake(*args):
        *rest, start, end, threads = args
        per = -(-((end - start) // threads) // 64) * 64
        return real(*rest, start, min(start + per, end), 1)
    fake.openmp = True
    return fake


@needs_compiler
def test_probes_refuse_a_kernel_that_splits_wrongly(monkeypatch, caplog):
    """The probes run the kernels on 3 threads over a range that splits: a kernel that leaves a share undone is
    refused (and the optimizers keep their other paths)."""
    monkeypatch.setattr(_dispatch, "_COMPILED", {})
    monkeypatch.setattr(_dispatch, "_LOGGED", set())  # each refusal is logged once per process: an earlier test's
    real_bind = _native.bind
    monkeypatch.setattr(_native, "bind", lambda *a, **k: _first_share_only(real_bind(*a, **k)))
    assert m8.AdamW8bit.native_fn() is None
    assert mbf._native_fn() is None
    assert muon8bit._ENCODE.fn() is None and muon8bit._DECODE.fn() is None  # the codec alone (quant8_cpu.c)
    assert "disagrees" in caplog.text


@needs_compiler
def test_scan_flags_values_whose_square_overflows():
    """The guard's scan: inf, NaN and, in fp32 and bf16, any |g| >= 2**64 (g * g overflows fp32); just below passes."""
    scan = _bound_scan()
    below = {torch.float32: torch.tensor(2.0**64).view(torch.int32).sub(1).view(torch.float32).item(),
             torch.bfloat16: torch.tensor(2.0**64, dtype=torch.bfloat16).view(torch.int16).sub(1)
             .view(torch.bfloat16).item(), torch.float16: 65504.0}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for value, bad in ((below[dtype], False), (-below[dtype], False), (float("inf"), True), (float("nan"), True),
                           (2.0**64, True), (-3e38, True)):  # fp16: those are inf
            g = torch.zeros(1000, dtype=dtype)
            g[999] = value
            assert _scan(scan, [torch.zeros(3, dtype=dtype), g]) == (1 if bad else -1), (dtype, value)


# --- the kernel cache -------------------------------------------------------------------------------------------

_STEP = """
import logging, sys, torch
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
from hf_efficient.optim import adamw8bit as m, _native
assert m.AdamW8bit.native_fn() is not None, "no C kernel"
p = torch.nn.Parameter(torch.zeros(8192)); p.grad = torch.ones(8192)
m.AdamW8bit([p], lr=1e-3, weight_decay=0.0).step()
assert torch.allclose(p, torch.full_like(p, -1e-3)), p
print("stepped")
"""


def _python(code: str, cache: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_EFF_CACHE": str(cache), **env})


@needs_compiler
def test_truncated_cached_kernel_is_rebuilt(tmp_path):
    """A truncated .so in the cache (a full disk, a killed copy) would end the process with SIGBUS in ctypes.CDLL:
    it does not match its build record, so it is rebuilt, with a warning, and the step is right."""
    built = Path(_native.load("adamw8bit_cpu.c")._name)  # this process's build and its record, copied
    for path in (built, built.with_name(built.name + ".sha256")):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    lib = tmp_path / built.name
    lib.write_bytes(built.read_bytes()[:4096])
    out = _python(_STEP, tmp_path)
    assert out.returncode == 0 and "stepped" in out.stdout, (out.returncode, out.stderr[-3000:])
    assert "does not match its build record" in out.stdout
    assert lib.stat().st_size > 4096 and _native._recorded(lib)


@needs_compiler
def test_compiler_given_as_a_command_line(tmp_path):
    """CC holds a command line ("ccache gcc"): it is split as a shell would."""
    out = _python(_STEP, tmp_path, CC=f"env {_native.c_compiler()}")
    assert out.returncode == 0 and "stepped" in out.stdout and "could not build" not in out.stdout, out.stderr[-3000:]


@needs_compiler
def test_concurrent_builds_make_one_good_library(tmp_path):
    """Two processes (ranks of one machine) starting on an empty cache: one builds while the other waits for the
    lock, and both load the same, recorded library."""
    wrapper = tmp_path / "cc.sh"  # a compiler that logs its builds, and is slow enough for the two to meet
    wrapper.write_text(f"#!/bin/sh\ncase \"$*\" in *--version*) ;; *) echo build >> {tmp_path}/builds.log; "
                       f"sleep 1;; esac\nexec {_native.c_compiler()} \"$@\"\n")
    wrapper.chmod(0o755)
    cache = tmp_path / "cache"
    env = {**os.environ, "HF_EFF_CACHE": str(cache), "CC": str(wrapper)}
    procs = [subprocess.Popen([sys.executable, "-c", _STEP], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 and "stepped" in o for p, (o, _) in zip(procs, outs)), [e[-2000:] for _, e in outs]
    builds = (tmp_path / "builds.log").read_text().split()
    assert len(builds) == 1, builds  # the 8-bit kernel was built once (the grad scan is not used here)
    assert len(list(cache.glob("adamw8bit_cpu-*.so"))) == 1 and not list(cache.glob("tmp*"))


@pytest.mark.parametrize("value", ["", ".", "kernels", "~/k"])
def test_cache_dir_is_absolute_and_empty_means_the_default(monkeypatch, tmp_path, value):
    """HF_EFF_CACHE="." or a relative path handed ctypes a bare file name, which the loader looks up on its search
    path, not in the working directory: the load failed and every run rebuilt. Empty means unset (the default)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_EFF_CACHE", value)
    expected = {"": tmp_path / "home" / ".cache" / "hf_efficient", ".": tmp_path, "kernels": tmp_path / "kernels",
                "~/k": tmp_path / "home" / "k"}[value]
    assert _native.cache_dir() == expected and _native.cache_dir().is_absolute()


@needs_compiler
def test_relative_cache_builds_once_and_loads(tmp_path):
    """HF_EFF_CACHE=. in a fresh directory: the first run says, before building, what it compiles and that it
    happens once per machine; the second run loads that build (no rebuild, no fallback, no notice)."""
    runs = [subprocess.run([sys.executable, "-c", _STEP], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                           env={**os.environ, "HF_EFF_CACHE": "."}) for _ in range(2)]
    for out in runs:
        assert out.returncode == 0 and "stepped" in out.stdout, out.stderr[-3000:]
        assert "does not match" not in out.stdout and "could not build" not in out.stdout, out.stdout
    first, second = (out.stdout.splitlines() for out in runs)
    notice = [line for line in first if "compiling the C kernel adamw8bit_cpu.c" in line]
    assert len(notice) == 1 and notice[0].startswith("WARNING") and "once per machine" in notice[0], first
    assert first.index(notice[0]) < first.index("stepped")
    assert not [line for line in second if "compiling" in line], second
    assert len(list(tmp_path.glob("adamw8bit_cpu-*.so"))) == 1


_OPTIM = Path(_native.__file__).parent


@needs_compiler
@pytest.mark.parametrize("header", sorted(p.name for p in _OPTIM.glob("*.h")))
@pytest.mark.parametrize("flags", [[], ["-mno-avx512vbmi"], ["-mno-avx512f"]],
                         ids=["as built here", "AVX-512 without VBMI", "plain C"])
def test_each_header_compiles_alone(header, flags, tmp_path):
    """Each kernel header includes what it uses: a file that includes it alone compiles, with the kernels' flags and
    OpenMP, on every instruction set the kernels branch on (quant8.h once needed native.h first)."""
    cc = [*shlex.split(_native.c_compiler()), *_native._FLAGS, _native._OPENMP]
    if "-march=native" not in cc and flags:
        pytest.skip("not an x86 build: the AVX-512 branches are not compiled here")
    src = tmp_path / "alone.c"
    src.write_text(f'#include "{header}"\n')
    out = subprocess.run([*cc, *flags, "-Werror=implicit-function-declaration", "-I", str(_OPTIM), "-fsyntax-only",
                          str(src)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


@needs_compiler
def test_c_compensation_modes_are_the_python_numbers(tmp_path):
    """native.h's named modes are compensation.C_MODES's numbers (which the Triton kernels use too)."""
    from hf_efficient.optim.compensation import C_MODES

    src, lib = tmp_path / "modes.c", tmp_path / "modes.so"
    src.write_text('#include "native.h"\nconst int modes[3] = {KAHAN, STOCHASTIC, NONE};\n')
    cc = [*shlex.split(_native.c_compiler()), *_native._FLAGS]
    subprocess.run([*cc, "-I", str(_OPTIM), str(src), "-o", str(lib)], check=True, capture_output=True, timeout=120)
    modes = (ctypes.c_int * 3).in_dll(ctypes.CDLL(str(lib)), "modes")
    assert list(modes) == [C_MODES["kahan"], C_MODES["stochastic"], C_MODES["none"]]


# docs/contributing.md's example family (tests/example_family.py: a torch step only) given the C kernel the guide
# describes: its coefficient struct, its update of one element, its family_t, and the two functions that hand them to
# blockwise.h (which walks the tensors, splits the blocks over threads, decodes, encodes and dispatches on dtype and
# compensation mode).
SGDM8BIT_C = r"""
#include "blockwise.h"

/* SGDM8bit.coefficients, in order. */
typedef struct {
    float momentum, decay, lr;
} sgdm_coef_t;

/* SGDM8bit.update on one element: m = m * momentum + g; p * decay - m * lr. */
ALWAYS_INLINE float sgdm_update(float p, float g, float *s, const void *coef, int64_t i, int64_t n) {
    const sgdm_coef_t *k = coef;
    s[0] = s[0] * k->momentum + g;
    return p * k->decay - s[0] * k->lr;
}

static const family_t SGDM8BIT = {sgdm_update, 1, sizeof(sgdm_coef_t) / sizeof(float), {1}};

static void sgdm8bit_range(const void *args, int64_t lo, int64_t hi) { blockwise_range(args, &SGDM8BIT, lo, hi); }

void sgdm8bit_step(int64_t count, void *const *p, const void *const *g, uint32_t *const *codes, float *const *absmax,
                   const int64_t *numel, const int32_t *bf16, uint16_t *const *c, const int32_t *keys,
                   comp_mode_t mode, const float *maps, const sgdm_coef_t *coef, int64_t start, int64_t end,
                   int threads) {
    blockwise_step(sgdm8bit_range, (blockwise_t){count, p, g, codes, absmax, numel, bf16, c, keys, mode, maps,
                                                 (const float *)coef, NULL}, start, end, threads);
}
"""


@needs_compiler
@pytest.mark.parametrize("update", ["s[0] * k->momentum + g", "s[0] * k->momentum + g * 1.0001f"],
                         ids=["as the family's math", "one operation off"])
def test_a_family_kernel_is_its_update_and_blockwise_h_does_the_rest(update, tmp_path):
    """The guide's ~25-line C kernel of the example family passes the probe every 8-bit C kernel passes (three steps,
    codes and absmaxes exactly the eager kernel's, fp32 and bf16 weights under each compensation, 3 threads, a
    partial block); the same kernel with its update one operation off fails it."""
    from example_family import SGDM8bit

    src, lib = tmp_path / "sgdm8bit_cpu.c", tmp_path / "sgdm8bit_cpu.so"
    src.write_text(SGDM8BIT_C.replace("s[0] * k->momentum + g;", update + ";"))
    cc = [*shlex.split(_native.c_compiler()), *_native._FLAGS, _native._OPENMP]
    out = subprocess.run([*cc, "-I", str(_OPTIM), str(src), "-o", str(lib), "-lm"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    declared = "_c_kernel" in SGDM8bit.__dict__
    saved = dict(_dispatch.C_KERNELS)  # the family is no name of the package: its declaration is dropped after
    try:
        handle = ctypes.CDLL(str(lib))
        handle.openmp = True
        fn = _native.bind(handle, "sgdm8bit_step", SGDM8bit.c_kernel().argtypes)
        assert SGDM8bit._probe(fn) is (update == "s[0] * k->momentum + g")
    finally:
        _dispatch.C_KERNELS.clear()
        _dispatch.C_KERNELS.update(saved)
        if not declared:
            del SGDM8bit._c_kernel
