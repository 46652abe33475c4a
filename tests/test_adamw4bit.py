"""AdamW4bit (hf_eff_adam4bit's torch backend): AdamW's math on 4-bit moments (the codec is tests/test_quant4.py's).

Tolerances, and why:
- One step against float64 AdamW from the same decoded moments: the weights are float64's within rtol 1e-6 / atol
  4e-9 (4 ulp of an lr=1e-2 update: fp32 rounding; eager torch's fp32 sqrt may be an ulp off); the stored moments decode
  to float64's new moments within the codec's rounding: a first moment within 0.1125 of its block's largest
  (half the widest gap of the signed map, 0.6625 .. 0.8875), a second moment's root within 1/32 of its block's
  largest root (half a level) of the root raised to the lowest level, 1/16 of the largest: never below it (never 0
  beside a non-zero first moment).
- Without re-synchronisation (100 steps of 0.01 * randn + 0.003 gradients, lr 1e-3, 64 x 256 weights) the distance to
  fp32 AdamW's weights is under 30% of fp32 AdamW's own distance travelled (measured 17.2%; 8-bit: 1.1%): the 4-bit
  first moment's rounding is coarse step by step. On a small regression MLP trained 200 steps, the final loss is
  within 15% of fp32 AdamW's (measured 0.928 of it; 8-bit 0.987).
- Compiled vs eager: state bitwise equal, weights within atol 1e-8 / rtol 1e-6 (adamw8bit's tolerance and reason).
- Resume: bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import io
import logging
import shutil

import pytest
from helpers import fixed_grad_steps, mixed_params
import torch

import hf_efficient as hfe
from hf_efficient.optim import quant4
from hf_efficient.optim.adamw4bit import AdamW4bit
from hf_efficient.optim.adamw8bit import AdamW8bit

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="torch.compile on CPU needs a C++ compiler")
KERNELS = [pytest.param(False, id="eager"), pytest.param(None, id="compiled (automatic)", marks=needs_compiler)]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's


def _moments(opt, p) -> list[torch.Tensor]:
    """Decoded (exp_avg, exp_avg_sq) of ``p`` from the canonical state dict."""
    params = [q for g in opt.param_groups for q in g["params"]]
    st = opt.state_dict()["state"][next(i for i, q in enumerate(params) if q is p)]
    return [quant4.dequantize_blockwise(st[k], st[f"{k}_absmax"], k == "exp_avg", p.shape)
            for k in ("exp_avg", "exp_avg_sq")]


def _params(seed=0):
    """4-bit (one with a partial last block, one non-contiguous), fp32-state (small) and a scalar."""
    return mixed_params(seed)


def _run(params, steps, start=0, opt=None, **kw):
    """Steps ``start`` to ``start + steps`` of a fixed sequence of random gradients; returns the optimizer."""
    return fixed_grad_steps(opt or AdamW4bit(params, lr=1e-2, weight_decay=0.1, **kw), params, steps, start)


def _blockmax(x: torch.Tensor) -> torch.Tensor:
    """Each element's block's largest ``|x|`` (blocks of 128 in element order)."""
    b = quant4.blocks_of(x.abs())
    return b.amax(1, keepdim=True).expand_as(b).reshape(-1)[: x.numel()].view(x.shape)


@pytest.mark.parametrize("compile", KERNELS)
def test_a_step_is_float64_adamw_on_the_decoded_moments(compile):
    lr, wd, (b1, b2), eps = 1e-2, 0.1, (0.9, 0.999), 1e-8
    p = torch.nn.Parameter(torch.randn(64, 256, generator=torch.Generator().manual_seed(0)))
    opt = AdamW4bit([p], lr=lr, weight_decay=wd, compile=compile)
    gen = torch.Generator().manual_seed(1)
    for t in range(1, 6):
        m, v = (x.double() for x in _moments(opt, p)) if t > 1 else (torch.zeros(p.shape, dtype=torch.float64),) * 2
        w, g = p.detach().double(), torch.randn(p.shape, generator=gen) * 10.0 ** -(t % 3)
        m, v = b1 * m + (1 - b1) * g.double(), b2 * v + (1 - b2) * g.double() ** 2
        want = w * (1 - lr * wd) - lr / (1 - b1**t) * m / (v.sqrt() / (1 - b2**t) ** 0.5 + eps)
        p.grad = g
        opt.step()
        torch.testing.assert_close(p.detach().double(), want, rtol=1e-6, atol=4e-9)
        dm, dv = (x.double() for x in _moments(opt, p))
        assert ((dm - m).abs() <= 0.1125 * _blockmax(m) * (1 + 1e-5)).all()
        root, top = v.sqrt(), _blockmax(v.sqrt())
        assert ((dv.sqrt() - root.clamp_min(top / 16)).abs() <= top / 32 * (1 + 1e-5)).all()
        assert (dv.sqrt() >= top / 16 * (1 - 1e-6)).all()  # never 0 beside a non-zero first moment


def _zero_then_small_moves(opt_factory) -> float:
    """adamw8bit's issue-12 repro: 4096 zero weights, a gradient of 1e-4 everywhere but 1.0 on one element, then a
    zero gradient: the largest move of the small elements (lr * m / eps where v decoded as 0)."""
    p = torch.nn.Parameter(torch.zeros(4096))
    opt = opt_factory([p])
    for value in (1e-4, 0.0):
        p.grad = torch.full_like(p, value)
        if value:
            p.grad[0] = 1.0
        opt.step()
    return p.detach()[1:].abs().max().item()


@pytest.mark.parametrize("compile", KERNELS)
def test_small_second_moment_is_never_decoded_as_zero(compile):
    fp32 = _zero_then_small_moves(lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0))
    ours = _zero_then_small_moves(lambda ps: AdamW4bit(ps, lr=1e-3, weight_decay=0.0, compile=compile))
    assert fp32 / 2 < ours < 2 * fp32, (ours, fp32)


def test_tracks_fp32_adamw_without_resynchronising():
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(64, 256, generator=gen) * 0.1
    p, r = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt, ref = AdamW4bit([p], lr=1e-3, weight_decay=0.01, compile=False), torch.optim.AdamW([r], lr=1e-3,
                                                                                              weight_decay=0.01)
    for _ in range(100):
        grad = torch.randn(p.shape, generator=gen) * 0.01 + 0.003
        p.grad, r.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    assert (p - r).norm() < 0.3 * (r - w0).norm()


def test_trains_a_small_model_like_fp32_adamw():
    def train(factory):
        torch.manual_seed(0)
        x, w = torch.randn(512, 32), torch.randn(32, 1)
        y = (x @ w).tanh() + 0.05 * torch.randn(512, 1)
        model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64),
                                    torch.nn.Tanh(), torch.nn.Linear(64, 1))
        opt = factory(model.parameters())
        for _ in range(200):
            i = torch.randint(0, 512, (64,))
            loss = torch.nn.functional.mse_loss(model(x[i]), y[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
        return torch.nn.functional.mse_loss(model(x), y).item()

    fp32 = train(lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    ours = train(lambda ps: AdamW4bit(ps, lr=3e-3, min_8bit_size=1, compile=False))
    assert abs(ours / fp32 - 1) < 0.15, (ours, fp32)


@needs_compiler
def test_compiled_equals_eager():
    pe, pc = _params(), _params()
    eager, compiled = _run(pe, 4, compile=False), _run(pc, 4, compile=True)
    for a, b in zip(pe, pc):
        for key, value in eager.state[a].items():
            assert torch.equal(value, compiled.state[b][key]), key
        torch.testing.assert_close(a, b, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("compile", KERNELS)
def test_resume_equals_uninterrupted(compile):
    ps = _params()
    full = _run(ps, 6, fp32_state_params=[ps[0]], compile=compile)
    ps2 = _params()
    first = _run(ps2, 3, fp32_state_params=[ps2[0]], compile=compile)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = AdamW4bit(ps2, lr=1.0, weight_decay=0.0, compile=compile)  # the saved groups and state decide
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    _run(ps2, 3, start=3, opt=resumed)
    for a, b in zip(ps, ps2):
        assert torch.equal(a, b)
        x, y = full.state[a], resumed.state[b]
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) and x[k].dtype == y[k].dtype for k in x)


def test_state_dict_is_canonical_and_bytes_are_the_codecs():
    ps = _params()
    opt = _run(ps, 2)
    sd = opt.state_dict()["state"]
    assert sd[0]["exp_avg"].dtype == torch.uint8 and tuple(sd[0]["exp_avg"].shape) == (64, 40)  # two codes a byte
    assert tuple(sd[0]["exp_avg_absmax"].shape) == (40,)  # 5120 / 128
    assert tuple(sd[1]["exp_avg_sq"].shape) == (3450,)  # 300 x 23: odd rows, flat
    assert sd[3]["exp_avg"].dtype == torch.float32  # a scalar keeps fp32 state
    n = ps[0].numel()
    assert hfe.optimizer_state_bytes(opt) > 0
    assert sum(opt.state[ps[0]][k].numel() * opt.state[ps[0]][k].element_size()
               for k in opt.state[ps[0]] if k != "step") == 2 * (n // 2 + 4 * n // 128)  # 1.0625 bytes a parameter
    assert hfe.registry.get_spec("adam4bit").state_bytes == 1.06


@pytest.mark.parametrize("compensation", ["stochastic", "kahan", "none"])
def test_bf16_weights_under_each_compensation(compensation):
    """bf16 weights whose updates are far below half a bf16 ulp: rounded to nearest (``none``) they never move;
    stochastic rounding and Kahan summation move them as the fp32-weight run moves its weights, on average."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.full((64, 256), 1.0) + torch.rand(64, 256, generator=gen) * 0.5
    p32, p16 = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.to(torch.bfloat16))
    kw = dict(lr=1e-4, weight_decay=0.0, compile=False)
    o32, o16 = AdamW4bit([p32], **kw), AdamW4bit([p16], compensation=compensation, **kw)
    assert AdamW4bit([torch.nn.Parameter(torch.zeros(1))]).defaults["compensation"] == "stochastic"
    for _ in range(30):
        g = torch.randn(p32.shape, generator=gen) * 0.01 + 0.01  # a steady direction: the weights go down
        p32.grad, p16.grad = g.clone(), g.to(torch.bfloat16)
        o32.step()
        o16.step()
    moved32 = (w0 - p32.detach()).mean().item()
    w16 = p16.detach().float() + (o16.state[p16]["kahan_comp"].float() if compensation == "kahan" else 0)
    moved16 = (w0.to(torch.bfloat16).float() - w16).mean().item()  # Kahan: the weight and what it is still owed
    if compensation == "none":
        assert moved16 == 0.0
    else:
        assert abs(moved16 / moved32 - 1) < 0.1, (moved16, moved32)
    assert ("kahan_comp" in o16.state[p16]) == (compensation == "kahan")


# --- checkpoints: tagged, converted between the families of AdamW's math, torchao's AdamW4bit ---------------------


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 128))


def _create(name, model):
    """``name`` on ``model``, every tensor of a quantized name in its codec (the model's are small)."""
    kw = {"min_8bit_size": 1} if hfe.registry.get_spec(name).facts.quantized else {}
    return hfe.create_optimizer(model, name, lr=1e-2, weight_decay=0.01, **kw)


def _trained(name, model, steps=3):
    opt = _create(name, model)
    for _ in range(steps):
        model(torch.randn(4, 128)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def test_tagged_checkpoint_round_trips_through_create_optimizer():
    model = _model()
    opt = _trained("hf_eff_adam4bit", model)
    sd = opt.state_dict()
    assert sd["hf_efficient"]["family"] == "adamw4bit"
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    again = _create("adam4bit", model)
    again.load_state_dict(torch.load(buf, weights_only=True))
    for p in model.parameters():
        assert all(torch.equal(opt.state[p][k], again.state[p][k]) for k in opt.state[p])


@pytest.mark.parametrize("source", ["adam8bit", "adamw"])
def test_8bit_and_fp32_state_load_into_4bit_quantized_with_a_warning(source, caplog):
    model = _model()
    src = _trained(source, model)
    dst = _create("adam4bit", model)
    with caplog.at_level(logging.WARNING):
        dst.load_state_dict(src.state_dict())
    assert "quantized to 4-bit (lossy" in caplog.text, caplog.text
    w = model[0].weight
    assert dst.state[w]["exp_avg"].dtype == torch.uint8
    ours = _moments(dst, w)
    theirs = [quant4.dequantize_blockwise(*quant4.quantize_blockwise(x, s), s, w.shape)
              for x, s in zip(_decoded(src, w), (True, False))]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))  # the source's values, quantized once


def _decoded(opt, p):
    st = opt.state[p]
    if st["exp_avg"].dtype != torch.uint8:
        return [st["exp_avg"].float(), st["exp_avg_sq"].float()]
    from hf_efficient.optim import quant8

    sd = opt.state_dict()["state"][[q for g in opt.param_groups for q in g["params"]].index(p)]
    return [quant8.dequantize_blockwise(sd[k], sd[f"{k}_absmax"], k == "exp_avg") for k in ("exp_avg", "exp_avg_sq")]


@pytest.mark.parametrize("target", ["adam8bit", "adamw"])
def test_4bit_state_loads_into_8bit_and_fp32_families(target, caplog):
    model = _model()
    src = _trained("adam4bit", model)
    dst = _create(target, model)
    with caplog.at_level(logging.WARNING):
        dst.load_state_dict(src.state_dict())
    assert "dequantized" in caplog.text
    w = model[0].weight
    if target == "adamw":  # exact: the values the codes stand for
        assert all(torch.equal(a, b) for a, b in zip(_moments(src, w), _decoded(dst, w)))
    else:
        assert "(lossy" in caplog.text


class _TorchaoState4bit:
    """torchao's documented ``OptimState4bit`` fields (torchao/optim/subclass_4bit.py): ``codes`` (uint8, two codes
    a byte, element 2i high), ``scale`` (one per block), ``qmap`` (16 values), ``signed``, ``shape``. Hand-built:
    the test needs no torchao."""

    def __init__(self, x: torch.Tensor, signed: bool, block: int = 128):
        qmap = quant4.signed_map() if signed else torch.linspace(0, 1, 17)[1:]  # torchao: its unsigned linear map
        xb = x.reshape(-1, block)
        self.scale = xb.abs().amax(1).clamp_min(1e-12)
        idx = ((xb / self.scale[:, None])[..., None] - qmap).abs().argmin(-1).reshape(-1).to(torch.uint8)
        self.codes = (idx[0::2] << 4) | idx[1::2]
        self.qmap, self.signed, self.shape = qmap, signed, x.shape

    def values(self) -> torch.Tensor:
        """What torchao's ``dequantize()`` gives: each code's map value times its block's scale."""
        idx = torch.stack([self.codes >> 4, self.codes & 15], -1).reshape(-1).long()
        return (self.qmap[idx].view(self.scale.numel(), -1) * self.scale[:, None]).reshape(self.shape)


def test_torchaos_adamw4bit_state_loads_decoded_then_quantized(caplog):
    model = _model()
    src = _trained("adamw", model)  # moments to hand torchao's layout
    torchao_sd = {"state": {}, "param_groups": src.state_dict()["param_groups"]}
    for i, p in enumerate(q for g in src.param_groups for q in g["params"]):
        st = src.state[p]
        if p.numel() >= 4096:  # torchao quantizes tensors of 4096+ elements in whole blocks
            st = {"step": st["step"], "exp_avg": _TorchaoState4bit(st["exp_avg"], True),
                  "exp_avg_sq": _TorchaoState4bit(st["exp_avg_sq"], False)}
        torchao_sd["state"][i] = dict(st)
    for g in torchao_sd["param_groups"]:
        g.pop("hf_efficient", None)
    dst = _create("adam4bit", model)
    with caplog.at_level(logging.WARNING):
        dst.load_state_dict(torchao_sd)
    assert "torchao" in caplog.text and "(lossy" in caplog.text, caplog.text
    w = model[0].weight
    given = torchao_sd["state"][0]
    want = [quant4.dequantize_blockwise(*quant4.quantize_blockwise(given[k].values(), k == "exp_avg"),
                                        k == "exp_avg", w.shape) for k in ("exp_avg", "exp_avg_sq")]
    assert all(torch.equal(a, b) for a, b in zip(_moments(dst, w), want))


# --- everywhere the other names work: hf_eff_auto, embedding_state -------------------------------------------------


def test_auto_picks_adam4bit_where_8bit_state_does_not_fit():
    from hf_efficient.auto import AUTO_MARGIN, choose_auto

    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    totals = {n: hfe.estimate_memory(model, n).total_bytes for n in ("adam8bit", "adam4bit", "adafactor")}
    assert totals["adam4bit"] < totals["adam8bit"]
    budget = (totals["adam4bit"] + totals["adam8bit"]) / 2 / (1 - AUTO_MARGIN) / 2**30
    assert choose_auto(model, {"budget_gb": budget}).name == "adam4bit"
    # embeddings quantized like the rest: the 8-bit names' word, in the chosen name's codec
    choice = choose_auto(model, {"budget_gb": budget, "embedding_state": "8bit"})
    assert choice.name == "adam4bit" and choice.options["embedding_state"] == "4bit"


def test_embedding_state_4bit_quantizes_the_embeddings_and_8bit_is_refused():
    def opt_for(**kw):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(64, 128), torch.nn.Linear(128, 64))
        opt = hfe.create_optimizer(model, "adam4bit", lr=1e-2, **kw)
        model(torch.tensor([[1, 2]])).sum().backward()
        opt.step()
        return opt.state[model[0].weight]["exp_avg"].dtype

    assert opt_for() == torch.float32  # the default: embeddings keep 32-bit state
    assert opt_for(embedding_state="4bit") == torch.uint8
    with pytest.raises(ValueError, match="4bit"):
        opt_for(embedding_state="8bit")


def test_the_lowest_memory_example_runs_at_its_bytes_per_parameter(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "lowest_memory.py"
    spec = importlib.util.spec_from_file_location("lowest_memory", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = example.main(steps=1)
    assert out["weights_bpp"] == 2.0 and 1.06 < out["state_bpp"] < 1.07  # 2 x (0.5 + 4 / 128), norms in fp32
    assert "B/param" in capsys.readouterr().out
