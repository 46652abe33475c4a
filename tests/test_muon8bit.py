"""``hf_eff_muon8bit`` (hf_efficient/optim/muon8bit.py) against ``hf_eff_muon`` and ``hf_eff_adam8bit``.

Muon8bit is two known steps on one split: :func:`.muon.muon` with the momentum in the 8-bit codec on the matrices,
AdamW8bit's kernels on the rest. So:

* with every tensor under ``min_8bit_size`` (fp32 momentum) its Muon half is ``hf_eff_muon``'s, bit for bit: the
  same function on the same numbers;
* its AdamW half is ``hf_eff_adam8bit``'s, bit for bit, on fp32 weights (no rounding noise, whose stream is keyed
  by a tensor's position, which differs between the two splits);
* with 8-bit momentum its Muon weights stay within 2**-5 of a step bound (``STEPS * lr * scale``) of the fp32
  momentum's (measured: 0.006 on tiny_llama, 4 steps): the codec's error (~1/254 of a block's absmax per entry) goes
  through Newton-Schulz, whose normalisation keeps it relative.

Checkpoints, resume, gradient release, the guard, compensation, FSDP2 and the Trainer are the cross-cutting tests'
(they take every name from tests/cases.py).
"""

from __future__ import annotations

import pytest
import torch

import hf_efficient as hfe
from conftest import tiny_llama
from hf_efficient.optim import quant8
from hf_efficient.optim.muon import update_scale
from hf_efficient.optim.muon8bit import QuantizedMomentum
from test_muon import LR, STEPS, WD, _llama_grads, _set_grads, _split_names

EIGHT_BIT_TOL = 2**-5


def _pair(other: str, **kw):
    """tiny_llama stepped ``STEPS`` times by ``other`` and by muon8bit (options ``kw``) on the same gradients."""
    a, b = tiny_llama(), tiny_llama()
    opt_a = hfe.create_optimizer(a, other, lr=LR, weight_decay=WD)
    opt_b = hfe.create_optimizer(b, "muon8bit", lr=LR, weight_decay=WD, **kw)
    for grads in _llama_grads(a, STEPS):
        for model, opt in ((a, opt_a), (b, opt_b)):
            _set_grads(model, grads)
            opt.step()
    return dict(a.named_parameters()), dict(b.named_parameters()), opt_b


def test_fp32_momentum_is_hf_eff_muon_bit_for_bit():
    ref, ours, opt = _pair("muon", min_8bit_size=10**9)
    muon_names, adamw_names = _split_names(opt)
    assert all(opt.state[ours[n]]["momentum_buffer"].dtype == torch.float32 for n in muon_names)
    for n in muon_names | adamw_names:
        assert torch.equal(ref[n], ours[n]), n


def test_adamw_half_is_hf_eff_adam8bit_bit_for_bit():
    ref, ours, opt = _pair("adam8bit")
    _, adamw_names = _split_names(opt)
    assert any(opt.state[ours[n]]["exp_avg"].dtype == torch.uint8 for n in adamw_names)
    for n in adamw_names:
        assert torch.equal(ref[n], ours[n]), n


def test_8bit_momentum_tracks_fp32_momentum():
    ref, ours, opt = _pair("muon")
    muon_names, _ = _split_names(opt)
    for n in muon_names:  # every matrix of tiny_llama has >= 4096 elements: all 8-bit
        state = opt.state[ours[n]]
        assert state["momentum_buffer"].dtype == torch.uint8 and "momentum_buffer_absmax" in state, n
        assert "exp_avg" not in state, n  # a Muon matrix keeps Muon's state only
        bound = STEPS * LR * update_scale(ours[n].shape) * EIGHT_BIT_TOL
        assert (ref[n] - ours[n]).abs().max() <= bound, n


def test_c_codec_steps_as_the_eager_codec(monkeypatch):
    """On CPU the momentum's blocks go through quant8_cpu.c (probed): the same weights and codes, bit for bit, as
    through quant8.pack / unpack."""
    from hf_efficient.optim import _native
    from hf_efficient.optim.muon8bit import _DECODE, _ENCODE

    if _native.c_compiler() is None:
        pytest.skip("no C compiler")
    assert _ENCODE.fn() is not None and _DECODE.fn() is not None
    _, c_path, c_opt = _pair("muon")
    monkeypatch.setattr(QuantizedMomentum, "_c", lambda self, kernel: None)
    _, eager, eager_opt = _pair("muon")
    for n, p in c_path.items():
        assert torch.equal(p, eager[n]), n
        for key, value in c_opt.state[p].items():
            assert torch.equal(value, eager_opt.state[eager[n]][key]), (n, key)


def test_quantized_momentum_round_trips_through_the_codec():
    """decode() gives the codec's values of what encode_() stored, for a matrix whose size is no multiple of a
    block (its padding is written as zeros and never read back)."""
    p = torch.zeros(37, 300)
    blocks = -(-p.numel() // quant8.BLOCK)
    codes, absmax = quant8.zero_codes(p.numel(), True, p.device)
    state = {"momentum_buffer": codes, "momentum_buffer_absmax": absmax}
    buf = QuantizedMomentum(p, state, quant8)
    values = torch.randn(p.shape, generator=torch.Generator().manual_seed(3))
    buf.encode_(values)
    decoded = buf.decode()
    assert decoded.shape == p.shape
    words, absmax = quant8.pack(torch.nn.functional.pad(values.view(-1), (0, blocks * quant8.BLOCK - p.numel()))
                                .view(-1, quant8.BLOCK), True)
    assert torch.equal(decoded.view(-1), quant8.unpack(words, absmax, True).view(-1)[:p.numel()])
    assert (decoded - values).abs().max() <= values.abs().max() / 100  # 8 bits: about 1/254 of a block's absmax
