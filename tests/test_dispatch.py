"""The one C-call path (:class:`hf_efficient.optim._dispatch.CKernel`): every declared C function's signature matches
its prototype in the .c file, values reach C as the kinds say, and a wrong value raises before C is called."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
import torch

import hf_efficient.optim
from hf_efficient import nonfinite  # noqa: F401 - declares the scan's C kernel
from hf_efficient.optim import _blockwise, _dispatch, adafactor, adamw, adamw8bit, adamw_bf16, lion8bit
from hf_efficient.optim.compensation import C_MODES

# every module of optim/ but the Triton ones (its C kernels are declared as it is imported), whatever the tests run
# before imported: a new family's module is found here without an edit
OPTIM_MODULES = [importlib.import_module(f"hf_efficient.optim.{m.name}")
                 for m in pkgutil.iter_modules(hf_efficient.optim.__path__) if "triton" not in m.name]

OPTIM = Path(_dispatch.__file__).parent
# the C type each kind stands for: the prototype's parameter, its name dropped and its spacing normalised
C_TYPES = {"count": r"int64_t", "int": r"int64_t", "threads": r"int", "mode": r"comp_mode_t",
           "ptr": r"(const )?\w+ \*", "ptrs": r"(const )?\w+ \*const \*", "i64s": r"const int64_t \*",
           "i32s": r"const int32_t \*", "f32s": r"const (float|\w+_coef_t) \*", "f64s": r"const double \*"}


@pytest.fixture(autouse=True)
def _own_registry(monkeypatch):
    """The test kernels below are declared in a copy of the registry, dropped afterwards."""
    monkeypatch.setattr(_dispatch, "C_KERNELS", dict(_dispatch.C_KERNELS))


def _families(cls=_blockwise.Blockwise8bit) -> list[type]:
    """Every quantized family class of optim/ (subclasses of subclasses too), from its modules, all imported above."""
    return [c for sub in cls.__subclasses__() for c in (sub, *_families(sub))
            if c.__module__.startswith("hf_efficient.optim.")]


def _kernels() -> dict:
    kernels = dict(_dispatch.C_KERNELS)
    for cls in _families():  # the quantized families with a C kernel declare it at first use
        if cls.C_KERNEL:
            kernels[(cls.c_kernel().source, cls.c_kernel().symbol)] = cls.c_kernel()
    return kernels


def _prototypes(source: str) -> dict[str, list[str]]:
    """The exported (non-static) functions of ``source``: name -> parameter types."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", "", (OPTIM / source).read_text(), flags=re.S)
    found = {}
    for m in re.finditer(r"^(?!static)[a-z_0-9]+\s+(\w+)\(([^)]*)\)\s*\{", text, flags=re.M):
        params = [" ".join(p.split()) for p in m.group(2).split(",")]
        found[m.group(1)] = [re.sub(r"\s*\w+$", "", p).replace("* ", "*").replace("*", " *").replace("  ", " ")
                             .strip() for p in params]
    return found


def test_every_c_kernel_is_declared_with_its_prototypes_arguments():
    """Each exported function of each *_cpu.c is a CKernel, one kind per C parameter, of that parameter's C type
    (a count off by one would shift every later argument)."""
    kernels = _kernels()
    exported = {(f.name, name): params for f in OPTIM.glob("*_cpu.c") for name, params in _prototypes(f.name).items()}
    assert set(kernels) == set(exported)
    for key, kernel in kernels.items():
        params = exported[key]
        kinds = [k for k, _, _ in kernel._kinds]
        assert len(kinds) == len(params), (key, kinds, params)
        for name, kind, param in zip(kernel.names, kinds, params):
            assert re.fullmatch(C_TYPES[kind], param), (key, name, kind, param)


def test_values_reach_c_as_their_kinds_say():
    """What C reads, while the call runs (the buffers live until it returned): each kind's values, a NULL slot for
    None among tensors, a NULL array for None in place of the list, and the split's start, end and threads."""
    kernel = _dispatch.CKernel("test.c", "test_values", "count t:ptrs n:i64s k:i32s*2 c:f32s=3 d:f64s* m:mode "
                               "x:ptr g:int", lambda fn: True)
    read = lambda ctype, address, size: list((ctype * size).from_address(address))  # noqa: E731
    seen = []

    def fn(count, t, n, k, c, d, m, x, g, start, end, threads):
        seen.append((count, None if t is None else read(ctypes.c_void_p, t, count), read(ctypes.c_int64, n, count),
                     read(ctypes.c_int32, k, 2 * count), read(ctypes.c_float, c, 3),
                     read(ctypes.c_double, d, 2 * count), m, x, g, start, end, threads))
        return 0

    fn.openmp = True
    ts = [torch.zeros(3), torch.zeros(5)]
    kernel.run(fn, 2, [ts[0], None], [3, 5], [1, -2, 3, -4], [0.5, 1.5, 2.5], [1.0, 2.0, 3.0, 4.0], "stochastic",
               ts[1], 7, n=8, threads=1)
    kernel.run(fn, 0, None, [], [], [0.5, 1.5, 2.5], [], "none", 0, 0, n=0, threads=1)
    assert seen == [(2, [ts[0].data_ptr(), None], [3, 5], [1, -2, 3, -4], [0.5, 1.5, 2.5], [1.0, 2.0, 3.0, 4.0],
                     C_MODES["stochastic"], ts[1].data_ptr(), 7, 0, 8, 1),
                    (0, None, [], [], [0.5, 1.5, 2.5], [], C_MODES["none"], 0, 0, 0, 0, 1)]


def _recorder():
    calls = []

    def fn(*args):
        calls.append(args)
        return 0

    fn.openmp = True
    return fn, calls


@pytest.mark.parametrize("change, error, says", [
    (dict(n=[3]), ValueError, "'n' (i64s) has 1 entries for 2 tensors; expected 1 per tensor"),
    (dict(k=[1, 2, 3]), ValueError, "'k' (i32s) has 3 entries for 2 tensors; expected 2 per tensor"),
    (dict(c=[0.5] * 4), ValueError, "'c' (f32s) has 4 entries for 2 tensors; expected 3"),
    (dict(d=[1.0] * 3), ValueError, "'d' (f64s) has 3 entries for 2 tensors; expected a whole number per tensor"),
    (dict(t=[1.0, 2.0]), TypeError, "argument 't' is not a ptrs value"),
    (dict(n=[3.0, 5.0]), TypeError, "argument 'n' is not a i64s value"),
    (dict(count=2.0), TypeError, "argument 'count' is not a count value"),
    (dict(m="fp32"), ValueError, "m='fp32' is not a compensation mode"),
    (dict(x=1.5), TypeError, "argument 'x' is not a ptr value"),
])
def test_a_wrong_value_raises_before_c_is_called(change, error, says):
    kernel = _dispatch.CKernel("test.c", "test_errors", "count t:ptrs n:i64s k:i32s*2 c:f32s=3 d:f64s* m:mode x:ptr",
                               lambda fn: True)
    fn, calls = _recorder()
    values = dict(count=2, t=[torch.zeros(1)] * 2, n=[1, 1], k=[0] * 4, c=[0.0] * 3, d=[0.0] * 4, m="none", x=0)
    kernel.run(fn, *values.values(), n=2)
    assert len(calls) == 1  # the unchanged values pass
    with pytest.raises(error, match=re.escape(says)):
        kernel.run(fn, *{**values, **change}.values(), n=2)
    with pytest.raises(TypeError, match="test_errors takes 8 values"):
        kernel.run(fn, *list(values.values())[:-1], n=2)
    assert len(calls) == 1


def test_a_signature_with_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown argument kind 'f16s' of 'x'"):
        _dispatch.CKernel("test.c", "test_kind", "count x:f16s", lambda fn: True)
    with pytest.raises(ValueError, match="a count must come before it"):
        _dispatch.CKernel("test.c", "test_count", "x:ptrs count", lambda fn: True)


def test_every_triton_site_is_admitted_by_probed(monkeypatch):
    """No Triton site keeps its own cache, probe or log: each asks :func:`_dispatch.probed`."""
    calls = []

    def probed(name, device, load, probe, reference):
        calls.append((name, str(device)))
        return "kernel"

    monkeypatch.setattr(_dispatch, "probed", probed)
    monkeypatch.setattr(nonfinite, "probed", probed)  # imported by name there
    monkeypatch.setattr(nonfinite._triton, "applies", lambda *tensors: True)
    cpu = torch.device("cpu")
    sites = [adamw8bit.AdamW8bit.triton_fn, lion8bit.Lion8bit.triton_fn, adafactor._triton_module, adamw._triton_kernel,
             adamw_bf16._triton_kernel, lambda device: nonfinite._triton_scan([torch.zeros(1, device=device)])]
    assert [site(cpu) for site in sites] == ["kernel"] * len(sites)
    assert calls == [(name, "cpu") for name in ("adamw8bit", "lion8bit", "adafactor", "adamw_fp32_state", "adamw_bf16",
                                                "nonfinite")]


def test_a_triton_probe_runs_on_its_device(monkeypatch):
    """Triton launches on the current CUDA device, which need not be the tensors': the probe runs under theirs."""
    current = []

    @contextlib.contextmanager
    def device(d):
        current.append(d)
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(_dispatch, "_COMPILED", {})
    seen, gpu = [], torch.device("cuda", 1)
    assert _dispatch.probed("test", gpu, lambda: "k", lambda k, d: seen.append((k, d, list(current))) or True,
                            "the reference") == "k"
    assert seen == [("k", gpu, [gpu])] and not current
