"""The environment the code runs in: thread counts and OMP settings. The C gradient scan agrees with the torch check
for any team size and is refused when its probe finds it wrong; an OMP_THREAD_LIMIT below torch's thread count is
warned about once. .ci/run re-runs this file under OMP settings.
"""

import pytest
import torch

import hf_efficient as hfe

from helpers import NAN, Net


@pytest.mark.parametrize("threads", [1, 2])
def test_the_c_scan_and_the_torch_check_agree(threads):
    """On CPU the check scans the gradients' bits in C (one call for all); elsewhere it sums them in torch. Both
    name the same first bad gradient, wherever its inf, NaN or overflowing value (|g| >= 2**64) sits (both halves
    of a split over 2 threads), and neither flags the largest values whose square is finite."""
    from hf_efficient import nonfinite

    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        grads = [torch.randn(300_001, generator=g).to(dt) for dt in (torch.float32, torch.bfloat16, torch.float16)]
        grads += [torch.randn(7, 5, generator=g), torch.zeros(0), torch.full((999,), 65504.0, dtype=torch.float16),
                  torch.full((999,), 1.8e19, dtype=torch.bfloat16)]  # just below 2**64: finite square
        native = nonfinite._first_bad_native(grads)
        if native is None:
            pytest.skip("no C compiler: the C scan is not built here")
        assert native == nonfinite._first_bad_torch(grads) == -1
        for i, pos, value in [(0, 300_000, float("inf")), (1, 0, float("nan")), (2, 150_000, -float("inf")),
                              (3, 34, float("nan")), (6, 998, float("inf")), (0, 7, 2e19), (1, 299_999, -3e38)]:
            bad = [t.clone() for t in grads]
            bad[i].view(-1)[pos] = value
            bad[-1].view(-1)[0] = float("nan")  # a later bad gradient: the first one is named
            assert nonfinite._first_bad_native(bad) == nonfinite._first_bad_torch(bad) == i
        strided = [grads[3].t()]  # not contiguous: the torch check
        assert nonfinite._first_bad_native(strided) is None and nonfinite._first_bad_torch(strided) == -1
    finally:
        torch.set_num_threads(n)


def test_a_c_scan_that_misses_values_is_not_used(monkeypatch, caplog):
    """The C gradient scan is admitted by a probe over 3 threads on a range that splits unevenly: a scan that does
    only part of the range (the old split under OMP_THREAD_LIMIT=1) is refused, and the torch check is used."""
    from hf_efficient import nonfinite
    from hf_efficient.optim import _native

    if _native.load("grad_check_cpu.c") is None:
        pytest.skip("no C compiler: the C scan is not built here")
    real_bind = _native.bind

    def half_scan(lib, symbol, argtypes, restype=None):
        fn = real_bind(lib, symbol, argtypes, restype)

        def first_half(*args):  # scans only the first half of its range, as a team of 1 did with 2 asked for
            *rest, start, end, threads = args
            return fn(*rest, start, start + (end - start) // 2, threads)
        first_half.openmp = fn.openmp
        return first_half

    from hf_efficient.optim import _dispatch

    monkeypatch.setattr(_native, "bind", half_scan)
    monkeypatch.setattr(_dispatch, "_COMPILED", {})  # the scan is cached, probed and logged by the dispatcher
    monkeypatch.setattr(_dispatch, "_LOGGED", set())
    with caplog.at_level("WARNING", logger="hf_efficient.optim._dispatch"):
        assert nonfinite._scan_kernel() is None
    assert "grad_check_cpu.c disagrees with the eager kernel on its probe" in caplog.text
    grads = [torch.zeros(300_000)]
    grads[0][-1] = NAN
    assert nonfinite._first_bad_native(grads) is None and nonfinite._first_bad_torch(grads) == 0


def test_a_thread_limit_below_torchs_thread_count_is_warned(monkeypatch, caplog):
    """OMP_THREAD_LIMIT below torch's thread count makes some of torch's own kernels wrong (oneDNN's bf16 linear
    backward gives NaN there): creating an optimizer says so once, with the cure."""
    from hf_efficient.optim import _native

    monkeypatch.setattr(_native, "_THREAD_LIMIT_WARNED", set())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setenv("OMP_THREAD_LIMIT", "1")
        with caplog.at_level("WARNING", logger="hf_efficient.optim._native"):
            hfe.create_optimizer(Net(), "adamw")
            hfe.create_optimizer(Net(), "adamw")
        assert caplog.text.count("OMP_THREAD_LIMIT=1 is below torch's thread count (2)") == 1
        assert "torch.set_num_threads(1)" in caplog.text
        monkeypatch.setenv("OMP_THREAD_LIMIT", "2")
        assert _native.check_thread_limit() is None
    finally:
        torch.set_num_threads(threads)
