"""Gradient release on the device path (CUDA; here CPU under Triton's interpreter, with nonfinite's switch that sends
CPU tensors down the device path): each bucket is checked by the Triton scan and stepped by the families' Triton
kernels with the scan's flag, in one step call, with no host read in backward or step(); the result equals the
ordinary step bit for bit. A non-finite gradient voids its bucket (``skip``), or its bucket and every later one of that
backward (``raise``, raised at the next host read): see release.py's docstring, "inf/NaN on CUDA"."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from torch import nn

from triton_helpers import needs_interpreter, on_cpu, triton  # noqa: F401
from cases import cls_of, names, plain, triton_kernel
from helpers import no_host_read
from hf_efficient.registry import get_spec
import hf_efficient as hfe
from hf_efficient import nonfinite, release
from hf_efficient.optim import _triton

B = pytest.importorskip("hf_efficient.optim.blockwise_triton")
K = pytest.importorskip("hf_efficient.optim.nonfinite_triton")
pytestmark = needs_interpreter

# the quantized families with a Triton kernel: 8-bit weights and fp32-state biases, every tensor takes a Triton kernel
NAMES = names(triton_kernel)
KERNELS = {n: f"{cls_of(get_spec(n)).NAME}_kernel" for n in plain(NAMES)}


class Spy:
    """Counts a Triton kernel's launches (``kernel[grid](...)``) and passes them on."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.fixture
def device_path(on_cpu, monkeypatch):
    """CPU tensors take the device path, without the C scan (as on CUDA, where it never applies: a check per tensor
    would read each result on the host); the scan and the 8-bit kernels counted."""
    monkeypatch.setattr(nonfinite, "_DEVICE_FLAG_ON_CPU", True)
    monkeypatch.setattr(nonfinite, "_scan_kernel", lambda: None)
    spies = {"scan": Spy(K.scan_kernel), **{k: Spy(getattr(B, k)) for k in KERNELS.values()}}
    monkeypatch.setattr(K, "scan_kernel", spies["scan"])
    for k in KERNELS.values():
        monkeypatch.setattr(B, k, spies[k])
    return spies


def _model(bad: bool = False):
    """Two 64x64 layers and a 64x1 one (4096-element weights: 8-bit state; the rest fp32 state). ``bad``: the middle weight's gradient is NaN;
    backward completes 2.bias, 2.weight, 1.bias, 1.weight (bad), 0.bias, 0.weight."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 1))
    if bad:
        model[1].weight.register_hook(lambda g: g * float("nan"))
    return model


def _opt(model, name, policy, bucket_bytes=None):
    sizes = {"min_8bit_size": 1000} if "8bit" in name else {}
    opt = hfe.create_optimizer(model, name, lr=1e-2, weight_decay=0.1, nonfinite=policy, **sizes)
    if bucket_bytes is not None:
        release.attach(opt, bucket_bytes=bucket_bytes)
    return opt


def _batches(n):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, 64, generator=gen) for _ in range(n)]


def _snapshot(model, opt):
    return {n: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
            for n, p in model.named_parameters()}


def _changed(a, b):
    """Names of the parameters whose weight or state differ between two snapshots (a state made by a voided first
    step, step count 0, counts as unchanged from none)."""
    def same(x, y):
        if not x:
            return not y or float(y["step"]) == 0
        return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)

    return {n for n in a if not (torch.equal(a[n][0], b[n][0]) and same(a[n][1], b[n][1]))}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bucket_bytes", [0, release.BUCKET_BYTES])
def test_release_on_the_device_path_equals_the_ordinary_step_and_reads_nothing(device_path, monkeypatch, name,
                                                                               bucket_bytes):
    """Bit for bit the ordinary step (itself checked on the device); no host read in backward or step(), under
    "skip" and "raise"; one scan launch and one 8-bit launch per bucket (the whole model is one 4 MiB bucket)."""
    ref = _model()
    ref_opt = _opt(ref, name, "skip")
    for x in _batches(2):
        ref(x).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for policy in ("skip", "raise"):
        model = _model()
        opt = _opt(model, name, policy, bucket_bytes)
        scans, steps = device_path["scan"].launches, device_path[KERNELS[name]].launches
        for x in _batches(2):
            loss = model(x).sum()
            with no_host_read(monkeypatch):
                loss.backward()
                opt.step()
            opt.zero_grad()
        buckets = 6 if bucket_bytes == 0 else 1
        assert device_path["scan"].launches - scans == 2 * buckets  # the check ran on the device, per bucket
        assert device_path[KERNELS[name]].launches - steps == 2 * (2 if bucket_bytes == 0 else 1)  # 8-bit weights
        assert not _changed(_snapshot(ref, ref_opt), _snapshot(model, opt)), policy
        assert release.release_info(opt).skipped_tensors == 0 and opt.hf_efficient.steps == 2


@pytest.mark.parametrize("name", ["adamw", "adamw_bf16"])
def test_release_checks_bf16_weights_on_the_device_once_their_state_exists(device_path, monkeypatch, name):
    """bf16 weights under AdamW (fp32 moments) and AdamWBF16: from the second step on (the first makes the state
    the Triton kernel's takes_found_inf() looks at) each bucket is scanned on the device and nothing is read on the
    host in backward or step(); bit for bit the ordinary step."""
    assert nonfinite._triton_scan([torch.zeros(1)]) is not None  # probed here: a probe reads its results
    runs = []
    for bucket_bytes in (None, 0):
        model = _model().to(torch.bfloat16)
        opt = _opt(model, name, "skip", bucket_bytes)
        scans = None
        for i, x in enumerate(_batches(3)):
            if i == 1:
                scans = device_path["scan"].launches
            with no_host_read(monkeypatch) if i else contextlib.nullcontext():
                loss = model(x.to(torch.bfloat16)).sum()
                loss.backward()
                opt.step()
            opt.zero_grad()
        assert device_path["scan"].launches - scans == 2 * (1 if bucket_bytes is None else 6)
        runs.append(_snapshot(model, opt))
    assert not _changed(*runs)


@pytest.mark.parametrize("bucket_bytes, voided", [(0, {"1.weight"}), (release.BUCKET_BYTES, "all")])
def test_skip_voids_the_bucket_holding_the_bad_gradient(device_path, monkeypatch, caplog, bucket_bytes, voided):
    """One tensor per bucket: exactly the bad tensor is not stepped (as the per-tensor check on CPU); one bucket:
    none is. Nothing read in backward; counted and said when read (release_info, or the next backward)."""
    model = _model(bad=True)
    opt = _opt(model, "adam8bit", "skip", bucket_bytes)
    before = None
    for i, x in enumerate(_batches(2)):
        if i == 1:
            before = _snapshot(model, opt)
        loss = model(x).sum()
        with no_host_read(monkeypatch):
            loss.backward()
            opt.step()
        opt.zero_grad()
    names = {n for n, _ in model.named_parameters()}
    changed = _changed(before, _snapshot(model, opt))
    assert names - changed == (names if voided == "all" else voided)
    with caplog.at_level(logging.WARNING, logger="hf_efficient.release"):
        info = release.release_info(opt)
    n = 1 if voided != "all" else len(names)
    assert info.skipped_tensors == 2 * n and opt.hf_efficient.skipped_steps == 2
    assert info.stepped_tensors == 2 * len(names) - 2 * n
    assert f"non-finite gradient in '1.weight', found on the device: the {n} tensor(s)" in caplog.text


@pytest.mark.parametrize("bucket_bytes", [0, release.BUCKET_BYTES])
def test_raise_voids_from_the_bad_bucket_on_and_raises_at_the_next_read(device_path, monkeypatch, bucket_bytes):
    """The buckets before the bad one are stepped, the bad one and every later one of that backward are not; the
    backward and step() read nothing and do not raise; the next backward raises at its first hook (nothing of it
    stepped), naming the parameter."""
    model = _model(bad=True)
    opt = _opt(model, "adam8bit", "raise", bucket_bytes)
    before = _snapshot(model, opt)
    x, y = _batches(2)
    loss = model(x).sum()
    with no_host_read(monkeypatch):
        loss.backward()
        opt.step()
    opt.zero_grad()
    after = _snapshot(model, opt)
    stepped = _changed(before, after)
    assert stepped == ({"2.weight", "2.bias", "1.bias"} if bucket_bytes == 0 else set())
    with pytest.raises(FloatingPointError, match=r"'1\.weight' at step 1, found on the device and read at the next "
                                                 r"backward: under gradient release, the buckets stepped before the one "
                                                 r"holding it were applied; that bucket and every later one"):
        model(y).sum().backward()
    assert not _changed(after, _snapshot(model, opt)) and all(p.grad is None for p in model.parameters())
    opt.zero_grad()
    model[1].weight._backward_hooks.clear()
    model(y).sum().backward()  # raised once: the next backward steps again
    opt.step()
    assert _changed(after, _snapshot(model, opt)) == {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize("bucket_bytes", [None, 0, release.BUCKET_BYTES])
def test_raise_takes_the_voided_step_back_as_without_release(device_path, bucket_bytes):
    """A step voided under "raise" is not counted once the flag is read, with release (None: without), as on CPU where
    the backward raises and step() is refused (issue 30: under release it stayed counted); the next one is."""
    model = _model(bad=True)
    opt = _opt(model, "adam8bit", "raise", bucket_bytes)
    x, y = _batches(2)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    with pytest.raises(FloatingPointError, match=r"'1\.weight' at step 1"):  # at backward (release) or step()
        model(y).sum().backward()
        opt.step()
    assert opt.hf_efficient.steps == 0
    opt.zero_grad()
    model[1].weight._backward_hooks.clear()
    model(y).sum().backward()
    opt.step()
    assert opt.hf_efficient.steps == 1


def test_raise_is_read_by_state_dict_too(device_path, monkeypatch):
    model = _model(bad=True)
    opt = _opt(model, "adam8bit", "raise", 0)
    model(_batches(1)[0]).sum().backward()
    opt.step()
    with pytest.raises(FloatingPointError, match=r"'1\.weight'.*read at state_dict\(\)"):
        opt.state_dict()


@pytest.mark.parametrize("name", ["adam8bit", "adafactor"])
def test_each_bucket_keeps_its_own_scan_tables(device_path, monkeypatch, name):
    """A pointer table per bucket (the same tensors each step), the scan's and the step's: no table is rebuilt because
    another bucket used it (one table per dtype or kind for the whole backward would be rebuilt at every bucket, an
    upload each)."""
    seen: dict = {}  # table (held: no id reused) -> the shapes it was given
    real = _triton.PointerTable.get

    def get(self, lists, sizes, device):
        seen.setdefault(self, set()).add(tuple(tuple(t.shape) for ts in lists for t in ts))
        return real(self, lists, sizes, device)

    monkeypatch.setattr(_triton.PointerTable, "get", get)
    model = _model()
    opt = _opt(model, name, "skip", 0)
    for x in _batches(2):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    rel = release._ATTACHED[opt]
    assert len(seen) > len(rel.tables)  # the step's tables were seen too
    assert len(rel.tables) == 6  # one per bucket (one tensor each)
    assert all(len(shapes) == 1 for shapes in seen.values())


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_backend_without_the_flag_checks_each_bucket_with_one_read(monkeypatch, policy):
    """The device path's devices, a backend that takes no flag (here the C kernels: no interpreter): one host read
    per bucket, and each bad tensor handled as its hook would have (raise: earlier ones stepped, raised at once;
    skip: that tensor alone not stepped)."""
    monkeypatch.setattr(nonfinite, "_DEVICE_FLAG_ON_CPU", True)
    reads = []
    real = nonfinite.bad_grads
    monkeypatch.setattr(nonfinite, "bad_grads", lambda grads: reads.append(len(grads)) or real(grads))
    model = _model(bad=True)
    opt = _opt(model, "adam8bit", policy, 0)
    before = _snapshot(model, opt)
    with pytest.raises(FloatingPointError, match="'1.weight'.*were stepped") if policy == "raise" else \
            contextlib.nullcontext():
        model(_batches(1)[0]).sum().backward()
    stepped = _changed(before, _snapshot(model, opt))
    if policy == "raise":
        assert stepped == {"2.weight", "2.bias", "1.bias"} and reads == [1, 1, 1, 1]
        assert model[1].weight.grad is not None  # left for inspection, as the per-tensor check leaves it
    else:
        assert stepped == {n for n, _ in model.named_parameters()} - {"1.weight"} and reads == [1] * 6
        assert release.release_info(opt).skipped_tensors == 1 and model[1].weight.grad is None


def test_a_pointer_table_is_one_upload_rebuilt_only_when_an_address_moves(monkeypatch):
    """Both arrays (addresses, then sizes) in one copy to the device, made again only when an address changes."""
    uploads = []
    real = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: uploads.append(self.numel()) or real(self, *a, **k))
    a, b, c = torch.zeros(8), torch.zeros(3), torch.zeros(5)
    table = _triton.PointerTable()
    ptrs, sizes = table.get([[a, b], [c, a]], [8, 3, 7, 9], torch.device("cpu"))
    assert ptrs.tolist() == [[a.data_ptr(), b.data_ptr()], [c.data_ptr(), a.data_ptr()]]
    assert sizes.tolist() == [8, 3, 7, 9] and uploads == [8]
    assert table.get([[a, b], [c, a]], [8, 3, 7, 9], torch.device("cpu"))[0] is ptrs and uploads == [8]
    d = torch.zeros(3)
    ptrs, _ = table.get([[a, d], [c, a]], [8, 3, 7, 9], torch.device("cpu"))
    assert ptrs[0, 1] == d.data_ptr() and uploads == [8, 8]
    empty, none = _triton.PointerTable().get([[], []], [], torch.device("cpu"))
    assert empty.shape == (2, 0) and none.numel() == 0
