"""The 4-bit codec (``optim/quant4.py``, its C twin ``quant4.h`` and Triton twin ``quant4_triton.py``).

The reference here is independent of the codec's code: the nearest map value found by float64 distances to every
map value (ties as the codec documents them), on normalized values computed in fp32 as the codec promises. The C
header is built twice by this file (with the AVX-512 paths where the CPU has them, and without), the Triton
functions run under the interpreter and compile for sm_90; all must give the torch codec's codes, scales and values
bit for bit.
"""

from __future__ import annotations

import ctypes
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_efficient.optim import _native, quant4

Q = quant4
INF = torch.tensor(float("inf"))
OPTIM = Path(quant4.__file__).parent


def _near(anchors: torch.Tensor, ulps: int = 2) -> torch.Tensor:
    """``anchors`` (fp32) and their ``ulps`` fp32 neighbours on each side."""
    out, up, down = [anchors], anchors, anchors
    for _ in range(ulps):
        up, down = torch.nextafter(up, INF), torch.nextafter(down, -INF)
        out += [up, down]
    return torch.cat(out)


def signed_inputs() -> torch.Tensor:
    """Normalized values where a signed encoder can go wrong: every map value, every threshold and every exact
    midpoint of neighbouring magnitudes with two fp32 neighbours each side, both signs, zeros, subnormals, 1 and a
    little above (a normalized value's rounding), random values and log-uniform magnitudes."""
    mags = Q.signed_map()[7:].double()
    mids = ((mags[1:] + mags[:-1]) / 2).float()  # the representable ones are exact ties
    anchors = torch.cat([Q.signed_map().abs(), torch.tensor(Q.THRESHOLDS), mids,
                         torch.tensor([0.0, 1.0, 1e-45, 1e-39, 2.0**-126])])
    g = torch.Generator().manual_seed(0)
    x = torch.cat([_near(anchors), 10.0 ** (torch.rand(20000, generator=g) * 8 - 8), torch.rand(5000, generator=g)])
    x = x.clamp(0, 1.0000001)
    return torch.cat([x, -x])


def unsigned_inputs() -> torch.Tensor:
    """Normalized roots where the unsigned encoder can go wrong: every level and every exact tie between two
    (``(2c + 1) / 32``) with two fp32 neighbours each side, 0, -0, subnormals, 1 and above, random ones."""
    levels = torch.arange(0, 34, dtype=torch.float32) / 32  # levels (even) and ties (odd), 0 .. 1 + 1/32
    g = torch.Generator().manual_seed(1)
    x = torch.cat([_near(torch.cat([levels, torch.tensor([1e-45, 1e-39, 2.0**-126])])), torch.tensor([-0.0]),
                   torch.rand(20000, generator=g), 10.0 ** (torch.rand(5000, generator=g) * 8 - 8)])
    return x


def reference_signed(y: torch.Tensor) -> torch.Tensor:
    """The signed map's nearest value to each ``y`` by float64 distance; at a tie, the larger magnitude; NaN: 7."""
    m = Q.signed_map().double()
    d = (y.double()[:, None] - m[None]).abs()
    tie = d == d.min(1, keepdim=True).values
    code = torch.where(tie, m.abs()[None] + 1, torch.zeros_like(d)).argmax(1)
    return torch.where(y.isnan(), 7, code)


def reference_unsigned(r: torch.Tensor) -> torch.Tensor:
    """The nearest level ``(c + 1) / 16`` to each normalized root by float64 distance; at a tie, the even level
    (``c`` odd); below the first level, the first; NaN: 0."""
    levels = torch.arange(1, 17, dtype=torch.float64)
    d = (r.double()[:, None] * 16 - levels[None]).abs()
    tie = d == d.min(1, keepdim=True).values
    code = torch.where(tie, 2 - levels[None] % 2, torch.zeros_like(d)).argmax(1)
    return torch.where(r.isnan(), 0, code)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """IEEE's fp32 square root, by numpy (torch's fp32 sqrt on CPU can be an ulp off)."""
    return torch.from_numpy(np.sqrt(x.numpy()))


def reference_blocks(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``(nb, 128)`` and scales of values ``(nb, 128)``: the scale is the largest ``|x|`` (raised to 2**-126
    where below it), the normalized value ``x * fl32(1 / scale)`` (signed) or the root ``fl32(sqrt(x)) *
    fl32(1 / fl32(sqrt(scale)))`` (unsigned), rounded to fp32 as the codec promises; then the nearest code."""
    a = x.abs().amax(1, keepdim=True)
    a = torch.where((a > 0) & (a < 2.0**-126), torch.full_like(a, 2.0**-126), a)
    if signed:
        y = x * (1 / torch.where(a > 0, a, torch.ones_like(a)))
        return reference_signed(y.flatten()).view(x.shape), a.flatten()
    r = sqrt_rn(a)
    y = sqrt_rn(x) * (1 / torch.where(r > 0, r, torch.ones_like(r)))
    return reference_unsigned(y.flatten()).view(x.shape), a.flatten()


def reference_values(codes: torch.Tensor, a: torch.Tensor, signed: bool) -> torch.Tensor:
    """Decoded values: ``map * scale`` (signed), ``((c + 1) / 16 * sqrt(scale))**2`` (unsigned), fp32."""
    if signed:
        return Q.signed_map()[codes] * a[:, None]
    root = ((codes + 1).float() / 16) * sqrt_rn(a)[:, None]
    return root * root


def value_blocks(signed: bool) -> torch.Tensor:
    """Blocks ``(nb, 128)`` of values whose normalized values are the encoder's hard cases, at scales from tiny to
    huge: each input list in blocks led by 1.0 (normalized values exact), scaled by powers of two (still exact) and
    by random factors; blocks of wide dynamic range; a zero block, a block of one tiny value, one of subnormals."""
    if signed:
        x = signed_inputs()
    else:
        r = unsigned_inputs().clamp_min(0)
        x = torch.cat([r * r, r])  # second moments whose roots are the hard cases (exact for the ties), and others
    x = torch.nn.functional.pad(x, (0, -x.numel() % 127)).view(-1, 127).clamp(-1, 1)
    x = torch.cat([torch.ones(x.shape[0], 1), x], 1)
    g = torch.Generator().manual_seed(2)
    scales = [1.0, 2.0**-60, 2.0**60, 2.0**-126, 2.0**120]
    blocks = [x * s for s in scales] + [x * torch.rand(x.shape[0], 1, generator=g) * 10.0 ** float(e)
                                        for e in (-30, -5, 0, 5, 30)]
    wide = torch.randn(64, 128, generator=g) * 10.0 ** (torch.rand(64, 128, generator=g) * 30 - 20)
    special = torch.zeros(4, 128)
    special[1, 5] = 1e-40  # a lone subnormal: scale raised to 2**-126
    special[2] = 1e-44 * torch.arange(128)  # subnormals
    special[3, :64] = 3e38  # near fp32's largest
    out = torch.cat(blocks + [wide, special])
    return out if signed else out.abs()


# --------------------------------------------------------------------------------------------- maps and encoder


def test_signed_map_is_torchaos():
    subclass_4bit = pytest.importorskip("torchao.optim.subclass_4bit")
    get_qmap_signed, get_qmap_unsigned = subclass_4bit.get_qmap_signed, subclass_4bit.get_qmap_unsigned

    assert torch.equal(Q.signed_map(), torch.tensor(get_qmap_signed(), dtype=torch.float32))
    assert torch.equal(Q.unsigned_map(), torch.tensor(get_qmap_unsigned(), dtype=torch.float32))  # as roots here


@pytest.mark.parametrize("signed", [True, False])
def test_every_code_decodes_to_its_map_value_and_encodes_back(signed):
    codes = torch.arange(16)
    values = Q.decode(codes, signed)
    assert torch.equal(values, Q.signed_map() if signed else (codes + 1).float() / 16)
    assert torch.equal(Q.encode(values, signed), codes.int())


def test_signed_encoder_is_the_nearest_value_ties_away_from_zero():
    x = signed_inputs()
    got, want = Q.encode(x, True).long(), reference_signed(x)
    assert torch.equal(got, want), x[got != want][:8]
    mags = Q.signed_map()[7:].double()
    mids = ((mags[1:] + mags[:-1]) / 2)
    exact = mids[mids.float().double() == mids].float()  # representable midpoints: exact ties
    assert exact.numel() >= 3 and torch.equal(Q.encode(exact, True), Q.encode(torch.nextafter(exact, INF), True))
    assert torch.equal(Q.encode(-exact, True), Q.encode(-torch.nextafter(exact, INF), True))
    assert Q.encode(torch.tensor([float("nan"), -1.0, 1.0, -0.0]), True).tolist() == [7, 0, 15, 7]


def test_unsigned_encoder_is_the_nearest_level_ties_to_even_never_zero():
    r = unsigned_inputs()
    got, want = Q.encode(r, False).long(), reference_unsigned(r)
    assert torch.equal(got, want), r[got != want][:8]
    ties = (2 * torch.arange(16) + 1).float() / 32  # between levels c and c + 1 (c + 1 / 2 sixteenths)
    assert Q.encode(ties, False).tolist() == [0, 1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15]
    assert Q.encode(torch.tensor([float("nan"), 0.0, -0.0, 1e-45, 2.0]), False).tolist() == [0, 0, 0, 0, 15]


# --------------------------------------------------------------------------------------------- blocks


@pytest.mark.parametrize("signed", [True, False])
def test_pack_gives_the_reference_codes_scales_and_values(signed):
    x = value_blocks(signed)
    words, scales = Q.pack(x, signed)
    codes, a = reference_blocks(x, signed)
    assert torch.equal(scales, a)
    w = words.view(torch.int32)
    unpacked = torch.stack([(w[:, j] >> (4 * k)) & 15 for k in range(8) for j in range(16)], 1)  # element 16k + j
    assert torch.equal(unpacked.long(), codes)
    values = Q.unpack(words, scales, signed)
    assert torch.equal(values, reference_values(codes, a, signed))


def test_the_second_moment_is_never_decoded_as_zero_beside_a_nonzero_value():
    """The floor: in a block with any positive second moment every element decodes positive, zeros included, down
    to second moments of 1e-30 beside 1 (8-bit's map floors at ~1e-7 of the absmax: 1e-30 would decode as 0 there),
    and the smallest level is 1/256 of the absmax."""
    g = torch.Generator().manual_seed(3)
    v = 10.0 ** (torch.rand(512, 128, generator=g) * 30 - 30)
    v[:, 0] = 1.0
    v[::2, 1::3] = 0.0
    words, scales = Q.pack(v, False)
    out = Q.unpack(words, scales, False)
    assert (out > 0).all()
    assert torch.equal(out.amin(1), torch.full((512,), 1.0 / 256))
    m = torch.randn(512, 128, generator=g)  # the worst case the rule prevents: lr * m / eps moves of a weight
    assert ((m / (out.sqrt() + 1e-8)).abs() <= 16 * m.abs() + 1e-6).all()


def test_blocks_of_large_and_non_finite_values_keep_their_shape():
    """A NaN wins its block's scale (every value decodes NaN, as 8-bit's); an inf makes every value of its block
    non-finite (NaN signed: 0 * inf; inf unsigned: the roots' levels times inf); other blocks are untouched."""
    x = torch.randn(3, 128)
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    for signed in (True, False):
        xs = x if signed else x.abs()
        words, scales = Q.pack(xs, signed)
        out = Q.unpack(words, scales, signed)
        assert out[1].isnan().all() and not out[2].isfinite().any()
        assert torch.equal(out[0], Q.unpack(*Q.pack(xs[:1], signed), signed)[0])


# --------------------------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("shape", [(128,), (7,), (300, 2), (5, 3), (1000,), (4, 32, 6), (130, 129)])
@pytest.mark.parametrize("signed", [True, False])
def test_canonical_and_in_memory_layouts_round_trip(shape, signed):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(shape, generator=g)
    x = x if signed else x * x
    p = torch.empty(shape)
    codes, scales = Q.quantize_blockwise(x, signed)
    assert codes.shape == Q.canonical_shape(shape) and codes.dtype == torch.uint8
    assert scales.shape == (Q.blocks(x.numel()),)
    words, a = Q.pack(Q.blocks_of(x), signed)  # the kernels' form
    mem = words.view(torch.uint8).reshape(-1)
    assert torch.equal(a, scales)
    assert torch.equal(Q.to_canonical(mem, p), codes)
    assert torch.equal(Q.from_canonical(codes, p, signed), mem)
    back = Q.dequantize_blockwise(codes, scales, signed, shape)
    assert back.shape == x.shape
    assert torch.equal(back.reshape(-1), Q.unpack(words, a, signed).reshape(-1)[: x.numel()])
    # element order, two per byte, element 2i in the high nibble
    flat = reference_blocks(Q.blocks_of(x), signed)[0].reshape(-1)[: x.numel()]
    flat = torch.nn.functional.pad(flat, (0, x.numel() % 2), value=Q.ZERO_CODE[signed])
    assert torch.equal(codes.reshape(-1), (flat[0::2] << 4 | flat[1::2]).to(torch.uint8))


def test_canonical_shape_keeps_rows_where_it_can():
    assert Q.canonical_shape((4096, 1024)) == (4096, 512)
    assert Q.canonical_shape((8, 3, 6)) == (8, 9)  # rows kept, each row's codes two per byte
    assert Q.canonical_shape((4, 256, 1)) == (4, 128)
    assert Q.canonical_shape((4, 3, 1)) == (6,)  # odd rows: flat
    assert Q.canonical_shape((5, 3)) == (8,)
    assert Q.canonical_shape((7,)) == (4,)
    assert Q.canonical_shape((4096,)) == (2048,)


def test_zero_codes_decode_to_zero_and_are_what_zeros_encode_to():
    for signed in (True, False):
        codes, scales = Q.zero_codes(300, signed)
        assert codes.numel() == 3 * 64 and scales.numel() == 3
        words, a = Q.pack(torch.zeros(3, 128), signed)
        assert torch.equal(words.view(torch.uint8).reshape(-1), codes) and torch.equal(a, scales)
        assert (Q.unpack(codes.view(torch.int32).view(-1, 16), scales, signed) == 0).all()


def test_quantize_moments_validates_and_converts():
    m, v = torch.randn(10, 30), torch.rand(10, 30)
    out = Q.quantize_moments(m, v)
    assert torch.equal(out["exp_avg"], Q.quantize_blockwise(m, True)[0])
    assert torch.equal(out["exp_avg_sq_absmax"], Q.quantize_blockwise(v, False)[1])
    with pytest.raises(ValueError, match="negative"):
        Q.quantize_moments(m, -v)
    with pytest.raises(ValueError, match="shape"):
        Q.quantize_moments(m, v[:5])


# --------------------------------------------------------------------------------------------- torchao


def _torchao_state(x: torch.Tensor, signed: bool):
    OptimState4bit = pytest.importorskip("torchao.optim.subclass_4bit").OptimState4bit

    state = OptimState4bit.zeros(x.shape, signed=signed, block_size=128)
    state.copy_(x)  # torchao's own quantizer (the one its step uses)
    return state


@pytest.mark.parametrize("shape", [(4096,), (64, 256)])
def test_torchaos_first_moment_decodes_and_quantizes_within_half_the_maps_widest_gap(shape):
    """Its values are torchao's; quantized again (its map, new scales: a block led by a negative value had been
    stored as -0.8875 of it, and torchao floors scales at 1e-12) they move by at most half the widest gap."""
    g = torch.Generator().manual_seed(5)
    m = torch.randn(shape, generator=g) * 10.0 ** (torch.rand(shape, generator=g) * 4 - 4)
    state = _torchao_state(m, True)
    values = Q.torchao_values(state)
    assert torch.equal(values, state.dequantize())
    codes, scales = Q.quantize_blockwise(values, True)
    back = Q.dequantize_blockwise(codes, scales, True, shape)
    assert ((back - values).abs() <= 0.1125 * scales.repeat_interleave(128).view(shape) * 1.0001).all()


def test_torchaos_second_moment_quantizes_within_half_a_level_of_its_root():
    g = torch.Generator().manual_seed(6)
    v = torch.rand(64, 256, generator=g) ** 6
    state = _torchao_state(v, False)
    values = Q.torchao_values(state)
    assert torch.equal(values, state.dequantize())
    codes, scales = Q.quantize_blockwise(values, False)
    back = Q.dequantize_blockwise(codes, scales, False, v.shape)
    assert (back > 0).all() and ((back.sqrt() - values.sqrt()).abs() <= scales.sqrt().repeat_interleave(128)
                                 .view(v.shape) / 32 * 1.0001).all()  # half a level of the root


def test_torchaos_adamw4bit_state_decodes():
    """A real ``AdamW4bit`` state after steps (its compiled step on CPU): both moments decode as torchao decodes."""
    AdamW4bit = pytest.importorskip("torchao.optim").AdamW4bit

    torch.manual_seed(7)
    p = torch.nn.Parameter(torch.randn(32, 128))
    opt = AdamW4bit([p], lr=1e-3)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(Q.torchao_values(opt.state[p][key]), opt.state[p][key].dequantize())


def test_torchao_values_refuses_what_is_not_4bit():
    class Fake:
        codes, scale, qmap, signed, shape = torch.zeros(10, dtype=torch.uint8), torch.ones(1), torch.zeros(16), \
            True, (128,)

    with pytest.raises(ValueError, match="do not describe"):
        Q.torchao_values(Fake)


# --------------------------------------------------------------------------------------------- C


def _build_harness(tmp: Path, extra: list[str]) -> ctypes.CDLL:
    cc = _native.c_compiler()
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp / f"harness{len(extra)}.so"
    flags = [f for f in _native._FLAGS if f != "-shared"] + ["-shared", *extra, f"-I{OPTIM}"]
    subprocess.run([*shlex.split(cc), *flags, str(Path(__file__).with_name("quant4_harness.c")), "-o", str(out),
                    "-lm"], check=True, capture_output=True, text=True, timeout=120)
    lib = ctypes.CDLL(str(out))
    lib.q4_test_store.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                  ctypes.c_void_p]
    lib.q4_test_load.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_void_p]
    return lib


@pytest.fixture(scope="module", params=["native", "plain"])
def harness(request, tmp_path_factory):
    """The C harness built with the kernels' flags (AVX-512 where the CPU has it), and without AVX-512."""
    lib = _build_harness(tmp_path_factory.mktemp("q4c"), [] if request.param == "native" else ["-mno-avx512f"])
    if request.param == "plain":
        assert lib.q4_test_avx512() == 0
    return lib


@pytest.mark.parametrize("signed", [True, False])
def test_c_codec_gives_the_torch_codecs_codes_scales_and_values(harness, signed):
    x = value_blocks(signed).contiguous()
    nb, tables = x.shape[0], Q.c_tables()
    words, scales = torch.zeros(nb, 16, dtype=torch.int32), torch.zeros(nb)
    harness.q4_test_store(x.data_ptr(), nb, tables.data_ptr(), int(signed), words.data_ptr(), scales.data_ptr())
    want_words, want_scales = Q.pack(x, signed)
    assert torch.equal(scales.view(torch.int32), want_scales.view(torch.int32))
    bad = (words != want_words.view(torch.int32)).any(1)
    assert not bad.any(), x[bad][:2]
    out = torch.zeros(nb, 128)
    harness.q4_test_load(words.data_ptr(), scales.data_ptr(), nb, tables.data_ptr(), int(signed), out.data_ptr())
    want = Q.unpack(want_words, want_scales, signed)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))  # bits: NaN blocks too


# --------------------------------------------------------------------------------------------- Triton

triton = pytest.importorskip("triton", reason="the Triton codec's tests need triton")
from triton_helpers import compile_for_hopper, needs_interpreter  # noqa: E402

NB = 64  # blocks per program: the interpreter runs a program at a time, each one vectorized


@needs_interpreter
@pytest.mark.parametrize("signed", [True, False])
def test_triton_codec_gives_the_torch_codecs_codes_scales_and_values(signed):
    import _quant4_test_kernels as K
    from hf_efficient.optim import quant4_triton

    x = value_blocks(signed)
    x = torch.cat([x, torch.zeros(-x.shape[0] % NB + 1, 128)]).contiguous()  # a last program of one block
    nb = x.shape[0]
    words, scales = torch.zeros(nb, 16, dtype=torch.int32), torch.full((nb,), -1.0)
    grid = (triton.cdiv(nb, NB),)
    K.store_kernel[grid](x, words, scales, nb, SIGNED=signed, NB=NB)
    want_words, want_scales = Q.pack(x, signed)
    assert torch.equal(scales.view(torch.int32), want_scales.view(torch.int32))
    bad = (words != want_words.view(torch.int32)).any(1)
    assert not bad.any(), x[bad][:2]
    out = torch.zeros(nb, 128)
    K.load_kernel[grid](words, scales, out, quant4_triton.tables("cpu"), nb, SIGNED=signed, NB=NB)
    assert torch.equal(out.view(torch.int32), Q.unpack(want_words, want_scales, signed).view(torch.int32))


@needs_interpreter
def test_triton_moments_update_in_place_as_torch():
    """Both moments decoded, updated and stored again by one program, in place: torch's unpack, arithmetic, pack."""
    import _quant4_test_kernels as K
    from hf_efficient.optim import quant4_triton

    g = torch.Generator().manual_seed(8)
    nb = 2 * NB + 1
    m0, v0 = torch.randn(nb, 128, generator=g), torch.rand(nb, 128, generator=g) ** 4
    (wm, am), (wv, av) = Q.pack(m0, True), Q.pack(v0, False)
    grad = torch.randn(nb, 128, generator=g)
    b1, b2 = 0.9, 0.999
    m = Q.unpack(wm, am, True) * b1 + grad * (1 - b1)
    v = Q.unpack(wv, av, False) * b2 + (grad * grad) * (1 - b2)
    (em, eam), (ev, eav) = Q.pack(m, True), Q.pack(v, False)
    wm, wv = wm.view(torch.int32).clone(), wv.view(torch.int32).clone()
    K.moments_kernel[(triton.cdiv(nb, NB),)](wm, am, wv, av, grad, quant4_triton.tables("cpu"), b1, 1 - b1, b2,
                                             1 - b2, nb, NB=NB)
    assert torch.equal(wm, em.view(torch.int32)) and torch.equal(am, eam)
    assert torch.equal(wv, ev.view(torch.int32)) and torch.equal(av, eav)


# Instructions per element of the codec for both moments (moments_kernel, scripts/quant4_sass.py's measure): 84.5 with
# triton on this branch's venv, bound ~5% over. Raise it only with a reason; lower it when a change cuts instructions.
SASS_BOUND = 89


def test_triton_codec_compiles_for_hopper_within_its_instruction_bound():
    """The codec compiles ahead of time for sm_90 (the interpreter accepts what the compiler refuses), in each
    kernel here, and its instructions per element stay within :data:`SASS_BOUND`."""
    import importlib.util

    for name, SIGNED in (("store_kernel", True), ("store_kernel", False), ("load_kernel", True),
                         ("load_kernel", False)):
        sig = {"x_ptr": "*fp32", "words_ptr": "*i32", "scale_ptr": "*fp32", "nblocks": "i32"} \
            if name == "store_kernel" else {"words_ptr": "*i32", "scale_ptr": "*fp32", "out_ptr": "*fp32",
                                            "map_ptr": "*fp32", "nblocks": "i32"}
        compile_for_hopper("_quant4_test_kernels", name, {**sig, "SIGNED": "constexpr", "NB": "constexpr"},
                           {"SIGNED": SIGNED, "NB": 8})
    spec = importlib.util.spec_from_file_location("quant4_sass", Path(__file__).parents[1] / "scripts" /
                                                  "quant4_sass.py")
    sass = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass)
    row = sass.count()
    assert row["per_element"] <= SASS_BOUND, row
