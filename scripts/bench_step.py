"""Optimizer step time, parameters per second, state bytes per parameter and share of memory bandwidth
for every hf_eff name and backend, beside the optimizers a user would pick instead, in one run.

    python scripts/bench_step.py                          # 4 layers of hidden 768 (28M parameters)
    python scripts/bench_step.py --quick --out /tmp/bench # smoke-test sizes
    python scripts/bench_step.py --device cuda            # on a GPU: scripts/bench_cuda.py (1.23B parameters)

Writes ``bench_step.json`` (the measurements) into ``--out`` (default ``docs/results``), then renders
``bench_step.md`` (tables, machine and load) and ``bench_step.png`` (step time and state bytes bars) from it:
``python scripts/render_results.py docs/results/bench_step.json`` renders them again without measuring.

Method. One parameter set shaped like transformer layers (fused QKV, output projection, 4x MLP, two
LayerNorms, biases; weight-decay groups from ``hf_efficient.build_param_groups``) with fixed random
gradients; every optimizer holds the same parameters of its dtype (fp32, or bf16 for the bf16 family) and
its own state. After ``--warmup`` steps each, ``--reps`` repetitions run one step of every optimizer in turn,
in a new (seeded) random order each repetition, with an in-place update of a ``--probe-mb`` tensor among them
that measures the memory bandwidth under the same load. Reported: medians; ratios to torch's fused fp32 AdamW as the
median of each repetition's ratio (both steps of the same repetition).

Physical limit: a step must read each parameter, gradient and state byte once and write each parameter
and state byte once, so ``bytes = 2 * params + grads + 2 * state`` (fp32 AdamW: 28 B/param) and the step
cannot be faster than ``bytes / bandwidth``; "% of limit" is that bound over the measured time.

The gradients are set once through a backward pass (``torch.autograd.backward`` on the parameters), as training
sets them: the inf/NaN check of ``nonfinite=raise|skip`` scans large CPU gradients in backward, in its
post-accumulate-grad hooks (``hf_efficient.nonfinite``), so a step row holds only what ``step()`` itself does. What the
check costs in backward is measured by ``--backward-reps``: forward + backward + step of a model made of the same
layers, per optimizer, with the check's time inside backward timed on its own.

``--trainer-reps`` adds the Trainer overhead of the plugin: the same small BERT trained by Trainer with an
``hf_eff_*`` name and with the backend's optimizer passed in directly, interleaved, median step time.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import render_results  # noqa: E402
from _bench_common import RESULTS, command_line, machine, median  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import hf_efficient as hfe  # noqa: E402
from hf_efficient import nonfinite  # noqa: E402
from hf_efficient.info import unwrap  # noqa: E402
from hf_efficient.registry import SPECS  # noqa: E402

LR, WD = 1e-4, 0.01
BASELINE = "torch AdamW fused"
# state format of each family's rows (registry family name): rows of one format are alternatives to each other
MUON_FP32, MUON_8BIT = "Muon + AdamW, fp32", "Muon + AdamW, 8-bit"  # another math: compared with each other
FORMATS = {"adamw": "fp32", "adamw8bit": "8-bit blockwise", "adamw4bit": "4-bit blockwise",
           "lion8bit": "8-bit blockwise", "adafactor": "factored",
           "adamw_bf16": "bf16 + Kahan", "muon": MUON_FP32, "muon8bit": MUON_8BIT}
BF16_8BIT = "8-bit, bf16 weights"  # 8-bit state on bf16 weights, compensated
FP32_BF16 = "fp32, bf16 weights"  # hf_eff_adamw's fp32 moments on bf16 weights, compensated
FORMAT_ORDER = ["fp32", "8-bit blockwise", "4-bit blockwise", "factored", "bf16 + Kahan", "bf16 stochastic",
                "bf16 nearest", FP32_BF16, BF16_8BIT, "factored, bf16 weights", MUON_FP32, MUON_8BIT]


# ------------------------------------------------------------------------------------------ parameters

class Block(nn.Module):
    """The parameters of one transformer layer (no forward: only the optimizer step is timed)."""

    def __init__(self, h: int):
        super().__init__()
        self.qkv, self.attn_out, self.norm1 = nn.Linear(h, 3 * h), nn.Linear(h, h), nn.LayerNorm(h)
        self.ff_in, self.ff_out, self.norm2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h), nn.LayerNorm(h)


def grads_through_backward(model: nn.Module) -> None:
    """Set ``model``'s gradients again, to the same values, through a backward pass: every post-accumulate-grad hook
    on its parameters runs, as in training (the guard's inf/NaN scan runs in those hooks)."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    torch.autograd.backward(params, grads)


def make_layers(hidden: int, layers: int, dtype: torch.dtype, device: str, seed: int = 0) -> nn.Module:
    """``layers`` transformer layers of width ``hidden``, with fixed random gradients set."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[Block(hidden) for _ in range(layers)]).to(device=device, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g, device=device) * 1e-3).to(dtype)
    return model


# ------------------------------------------------------------------------------------------ candidates

@dataclass
class Candidate:
    label: str
    fmt: str  # state format: rows of one format are alternatives to each other
    dtype: torch.dtype  # parameter dtype
    build: Callable[[nn.Module], torch.optim.Optimizer]
    hf_eff: str | None = None  # our Trainer name
    backend: str | None = None
    pick: bool = False  # the backend the registry picks on this device
    private: bool = False  # writes into its gradients: gets its own parameters (and gradients)
    note: str = ""
    error: str | None = None
    opt: torch.optim.Optimizer | None = None
    times: list[float] = field(default_factory=list)
    first_step_s: float | None = None
    params: int = 0
    param_bytes: int = 0
    grad_bytes: int = 0
    state_bytes: int = 0


def _groups(model):
    return hfe.build_param_groups(model, weight_decay=WD)


class TorchMuonAdamW:
    """What a user assembles from torch alone: ``torch.optim.Muon`` (``adjust_lr_fn="match_rms_adamw"``, as ours) on
    the package's Muon split, torch's fused AdamW on the rest; one ``step()`` steps both."""

    def __init__(self, model: nn.Module):
        groups = hfe.build_muon_param_groups(model, weight_decay=WD)
        plain = lambda g: {"params": g["params"], "weight_decay": g["weight_decay"]}  # noqa: E731
        self.muon = torch.optim.Muon([plain(g) for g in groups if g["muon"]], lr=LR, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW([plain(g) for g in groups if not g["muon"]], lr=LR, fused=True)
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    @property
    def state(self) -> dict:
        return {**self.muon.state, **self.adamw.state}

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()


def peers(device: str) -> list[Candidate]:
    """The optimizers a user would pick instead of ours (built lazily: a missing package is a row's error)."""
    def torch_adamw(**kw):
        return lambda m: torch.optim.AdamW(_groups(m), lr=LR, **kw)

    def bnb(cls):
        def build(m):
            import bitsandbytes as bnb_
            return getattr(bnb_.optim, cls)(_groups(m), lr=LR)
        return build

    def torchao(cls):
        def build(m):
            import torchao.optim
            return getattr(torchao.optim, cls)(_groups(m), lr=LR)
        return build

    def hf_adafactor(m):
        from transformers.optimization import Adafactor
        return Adafactor(_groups(m), lr=LR, scale_parameter=False, relative_step=False, warmup_init=False)

    def optimi_kahan(m):
        from optimi import AdamW
        return AdamW(_groups(m), lr=LR, kahan_sum=True)

    def torchao_bf16_sr(m):
        from torchao.optim import _AdamW
        return _AdamW(_groups(m), lr=LR, bf16_stochastic_round=True)

    def adamw_bf16_pkg(m):
        from adamw_bf16 import AdamWBF16
        return AdamWBF16(_groups(m), lr=LR)

    bf16 = torch.bfloat16
    return [
        Candidate("torch AdamW single-tensor", "fp32", torch.float32, torch_adamw(foreach=False, fused=False)),
        Candidate("torch AdamW foreach", "fp32", torch.float32, torch_adamw(foreach=True)),
        Candidate(BASELINE, "fp32", torch.float32, torch_adamw(fused=True)),
        Candidate("bitsandbytes AdamW 32-bit", "fp32", torch.float32, bnb("AdamW32bit")),
        Candidate("bitsandbytes AdamW8bit", "8-bit blockwise", torch.float32, bnb("AdamW8bit")),
        Candidate("torchao AdamW8bit", "8-bit blockwise", torch.float32, torchao("AdamW8bit")),
        Candidate("torchao AdamW4bit", "4-bit blockwise", torch.float32, torchao("AdamW4bit")),
        Candidate("transformers Adafactor", "factored", torch.float32, hf_adafactor,
                  note="scale_parameter=False, relative_step=False"),
        Candidate("torch Adafactor", "factored", torch.float32,
                  lambda m: torch.optim.Adafactor(_groups(m), lr=LR)),
        Candidate("torch-optimi AdamW kahan_sum", "bf16 + Kahan", bf16, optimi_kahan, private=True,
                  note="writes into its gradients"),
        Candidate("adamw-bf16 AdamWBF16", "bf16 + Kahan", bf16, adamw_bf16_pkg, private=True,
                  note="zeroes the gradients in its step; weight decay applied every ~n steps"),
        Candidate("torchao _AdamW bf16_stochastic_round", "bf16 stochastic", bf16, torchao_bf16_sr),
        Candidate("torch AdamW fused on bf16 params", "bf16 nearest", bf16, torch_adamw(fused=True),
                  note="stale weights: updates below half a bf16 ulp are lost"),
        Candidate("torch Muon + torch AdamW fused", MUON_FP32, torch.float32, TorchMuonAdamW,
                  note="the package's split"),
    ]


def ours(device: str) -> list[Candidate]:
    """Every hf_eff name with each of its backends (forced), the registry's pick marked, plus option rows."""
    out = []
    for spec in SPECS.values():
        if not spec.backends:  # hf_eff_auto chooses one of the others
            continue
        dtype, fmt_ = spec.facts.param_dtype, FORMATS.get(spec.facts.name, spec.facts.name)

        def build(name, **kw):
            return lambda m: hfe.create_optimizer(m, name, lr=LR, weight_decay=WD, **kw)

        if spec.fallback and torch.device(device).type != spec.fallback[0]:
            res = _resolve(spec.name, device)
            out.append(Candidate(spec.trainer_name, fmt_, dtype, build(spec.name), spec.trainer_name,
                                 res.backend if res else None, pick=True,
                                 note=f"runs hf_eff_{spec.fallback[1]} on {torch.device(device).type}"))
            continue
        res = _resolve(spec.name, device)
        for b in spec.backends:
            why_not = spec.backends[b].why_not(torch.device(device).type)
            c = Candidate(spec.trainer_name, fmt_, dtype, build(spec.name, backend=b), spec.trainer_name, b,
                          pick=res is not None and res.backend == b)
            if why_not:
                c.error = why_not
            out.append(c)
        if res is not None and "nonfinite" in spec.options:  # the inf/NaN gradient check off, to show its cost
            out.append(Candidate(spec.trainer_name, fmt_, dtype, build(spec.name, backend=res.backend, nonfinite="ignore"),
                                 spec.trainer_name, res.backend, note="nonfinite=ignore"))
        if res is not None and "ns_dtype" in spec.options:  # Newton-Schulz in fp32: CPUs without bf16 GEMMs
            out.append(Candidate(spec.trainer_name, fmt_, dtype, build(spec.name, backend=res.backend, ns_dtype="fp32"),
                                 spec.trainer_name, res.backend, note="ns_dtype=fp32"))
        if dtype == torch.bfloat16 and "compensation" in spec.options:
            out.append(Candidate(spec.trainer_name, "bf16 stochastic", dtype,
                                 build(spec.name, compensation="stochastic"), spec.trainer_name, "torch",
                                 note="compensation=stochastic"))
    return out


def bf16_weights(device: str) -> list[Candidate]:
    """fp32 and 8-bit state (and Adafactor) on bf16 weights under each compensation, beside
    bitsandbytes' 8-bit AdamW on bf16 weights (rounds to nearest) and torchao's with ``bf16_stochastic_round=True``."""
    bf16 = torch.bfloat16

    def ours_(name, mode, fmt_):
        return Candidate(f"hf_eff_{name}", fmt_, bf16, lambda m: hfe.create_optimizer(
            m, name, lr=LR, weight_decay=WD, compensation=mode), f"hf_eff_{name}", "torch",
            note=f"compensation={mode}")

    def torchao_sr(m):
        import torchao.optim
        return torchao.optim.AdamW8bit(_groups(m), lr=LR, bf16_stochastic_round=True)

    def bnb8(m):
        import bitsandbytes
        return bitsandbytes.optim.AdamW8bit(_groups(m), lr=LR)

    return ([ours_("adamw", mode, FP32_BF16) for mode in ("kahan", "stochastic")]
            + [ours_("adam8bit", mode, BF16_8BIT) for mode in ("kahan", "stochastic", "none")]
            + [ours_("lion8bit", mode, BF16_8BIT) for mode in ("kahan", "stochastic")]
            + [Candidate("torchao AdamW8bit bf16_stochastic_round", BF16_8BIT, bf16, torchao_sr),
               Candidate("bitsandbytes AdamW8bit on bf16 params", BF16_8BIT, bf16, bnb8,
                         note="stale weights: rounds to nearest")]
            + [ours_("adafactor", mode, "factored, bf16 weights") for mode in ("kahan", "stochastic", "none")])


def inductor_kernels(device: str) -> list[Candidate]:
    """Our optimizers with ``compile=True``: the torch.compile'd kernel that the C kernels replace on CPU (no inf/NaN
    check in these rows: compare them with the ``nonfinite=ignore`` ones)."""
    if torch.device(device).type != "cpu":
        return []
    from hf_efficient.optim.adamw8bit import AdamW8bit
    from hf_efficient.optim.adamw_bf16 import AdamWBF16

    note = "compile=True (inductor kernel), no check"
    return [Candidate("hf_efficient AdamW8bit", FORMATS["adamw8bit"], torch.float32,
                      lambda m: AdamW8bit(_groups(m), lr=LR, compile=True), note=note),
            Candidate("hf_efficient AdamWBF16", FORMATS["adamw_bf16"], torch.bfloat16,
                      lambda m: AdamWBF16(_groups(m), lr=LR, compile=True), note=note)]


def _resolve(name, device):
    try:
        return hfe.resolve(name, device, log=False)
    except Exception:  # noqa: BLE001  no backend here: the rows say why
        return None


# ------------------------------------------------------------------------------------------ measuring

def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run(args) -> dict:
    device = args.device
    order = {f: i for i, f in enumerate(FORMAT_ORDER)}  # a family's format not listed there: after them
    cands = sorted(peers(device) + ours(device) + bf16_weights(device) + inductor_kernels(device),
                   key=lambda c: order.get(c.fmt, len(order)))
    if args.only:  # the rows whose label or format names one of these, and the baseline (every ratio's)
        words = [w.strip() for w in args.only.split(",")]
        cands = [c for c in cands if c.label == BASELINE and c.fmt == "fp32" and c.dtype == torch.float32
                 or any(w in c.label or w in c.fmt for w in words)]
    shared = {dt: make_layers(args.hidden, args.layers, dt, device) for dt in (torch.float32, torch.bfloat16)}
    for c in cands:
        if c.error:
            continue
        model = make_layers(args.hidden, args.layers, c.dtype, device) if c.private else shared[c.dtype]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                c.opt = c.build(model)
                _sync(device)
                t0 = time.perf_counter()
                c.opt.step()
                _sync(device)
                c.first_step_s = time.perf_counter() - t0
                for _ in range(args.warmup - 1):
                    c.opt.step()
        except Exception as e:  # noqa: BLE001  an optimizer that cannot run here is a row saying why
            c.error, c.opt = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}", None
            print(f"[bench_step] {c.label} {c.backend or ''} {c.note}: {c.error}", file=sys.stderr)
            continue
        params = [p for g in c.opt.param_groups for p in g["params"]]
        c.params = sum(p.numel() for p in params)
        c.param_bytes = c.grad_bytes = sum(p.numel() * p.element_size() for p in params)
        c.state_bytes = hfe.optimizer_state_bytes(c.opt)
        print(f"[bench_step] ready: {c.label} {c.backend or ''} {c.note} (first step {c.first_step_s:.2f} s)",
              file=sys.stderr)

    live = [c for c in cands if c.opt is not None]
    for model in shared.values():  # as training sets them: the guard's hooks scan them in backward
        grads_through_backward(model)
    n_probe = args.probe_mb * 2**20 // 4
    src = torch.randn(n_probe, device=device)
    dst = src.clone()
    copy_times, inplace_times = [], []
    gc.collect()
    gc.disable()
    try:
        for rep in range(args.reps):
            # shuffled: in a rotation each row would always follow the same neighbour, whose traffic (a slow peer's,
            # a large state's) it would inherit every time
            order = random.Random(rep).sample(live, len(live))
            for i, c in enumerate(order):
                if i == rep % max(len(order), 1):  # the bandwidth probes sit at a different place each time
                    for probe, times in ((lambda: dst.mul_(-1.0), inplace_times), (lambda: dst.copy_(src), copy_times)):
                        _sync(device)
                        t0 = time.perf_counter()
                        probe()
                        _sync(device)
                        times.append(time.perf_counter() - t0)
                _sync(device)
                t0 = time.perf_counter()
                c.opt.step()
                _sync(device)
                c.times.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    nbytes = 2 * src.numel() * src.element_size()  # read and write every byte, in both probes
    large = [p.grad for m in shared.values() for p in m.parameters() if p.grad.numel() >= nonfinite._HOOK_MIN]
    return {"cands": cands, "bandwidth": nbytes / median(inplace_times), "copy_bandwidth": nbytes / median(copy_times),
            "probes": len(inplace_times), "vouched": all(nonfinite._scanned_clean(g) for g in large)}


def _paired_ratio(times: list[float], base: list[float]) -> float:
    """Median over repetitions of a step's time over the baseline's in the same repetition: a load or bandwidth shift
    that lasts a repetition moves both (the baseline's own steps here fell into two groups, ~8 and ~12 ms, so a ratio of
    medians depended on which group its median landed in)."""
    return median([t / b for t, b in zip(times, base)])


def rows_of(result: dict) -> list[dict]:
    cands, bw = result["cands"], result["bandwidth"]
    base = next((c for c in cands if c.label == BASELINE and c.times), None)
    rows = []
    for c in cands:
        r = {"optimizer": c.label, "backend": c.backend, "pick": c.pick, "note": c.note, "format": c.fmt,
             "param_dtype": str(c.dtype).removeprefix("torch."), "error": c.error}
        if c.times:
            t = median(c.times)
            moved = 2 * c.param_bytes + c.grad_bytes + 2 * c.state_bytes
            r.update(step_ms=t * 1e3, q1_ms=_quantile(c.times, 0.25) * 1e3, q3_ms=_quantile(c.times, 0.75) * 1e3,
                     mparams_per_s=c.params / t / 1e6, state_bytes_per_param=c.state_bytes / c.params,
                     ratio_to_fused=_paired_ratio(c.times, base.times) if base else float("nan"),
                     bytes_moved_per_param=moved / c.params,
                     limit_ms=moved / bw * 1e3, share_of_limit=moved / bw / t, first_step_s=c.first_step_s,
                     params=c.params, samples=len(c.times))
        rows.append(r)
    return rows


def _quantile(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def annotate(rows: list[dict]) -> list[dict]:
    """Set on each measured row ``fastest_of_format`` (the least step time among the rows of its state format that
    are alternatives to each other: not an option row of ``nonfinite=ignore``, nor a fallback that runs another name)
    and ``check_cost``: on a row with a ``nonfinite=ignore`` twin (same optimizer and backend), its step time over the
    twin's - 1, what the inf/NaN check costs the step (None elsewhere). Returns ``rows``."""
    ok = [r for r in rows if "step_ms" in r]
    alternatives = [r for r in ok if r["note"] != "nonfinite=ignore" and not r["note"].startswith("runs ")]
    twins = {(r["optimizer"], r["backend"]): r for r in ok if r["note"] == "nonfinite=ignore"}
    for r in ok:
        twin = None if r["note"] else twins.get((r["optimizer"], r["backend"]))
        r["fastest_of_format"] = False
        r["check_cost"] = r["step_ms"] / twin["step_ms"] - 1 if twin else None
    for fmt_ in {r["format"] for r in alternatives}:
        min((r for r in alternatives if r["format"] == fmt_), key=lambda r: r["step_ms"])["fastest_of_format"] = True
    return rows


# ------------------------------------------------------------------------------------------ Trainer overhead

def trainer_overhead(args) -> list[dict]:
    """Median Trainer step with an hf_eff name vs the same backend passed in, interleaved runs."""
    import tempfile

    from transformers import BertConfig, BertForMaskedLM, PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    class StepClock(TrainerCallback):
        """Times whole Trainer steps, and the optimizer's ``step`` within them (where the plugin's work is)."""

        def __init__(self):
            self.marks, self.opt_times = [], []

        def on_train_begin(self, args, state, control, optimizer=None, **k):
            optimizer = unwrap(optimizer, until=None)  # Accelerate's wrapper: time the optimizer it wraps
            inner = optimizer.step  # ours: the guarded step; either way, the LR scheduler's counting wrapper

            def timed(*a, **kw):
                t = time.perf_counter()
                out = inner(*a, **kw)
                self.opt_times.append(time.perf_counter() - t)
                return out

            optimizer.step = timed

        def on_step_end(self, *a, **k):
            self.marks.append(time.perf_counter())

    h = args.trainer_hidden
    cfg = BertConfig(vocab_size=2048, hidden_size=h, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=4 * h, max_position_embeddings=128)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, cfg.vocab_size, (256, 64), generator=g)
    data = [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x} for x in ids]

    def new_model():
        torch.manual_seed(0)
        return BertForMaskedLM(cfg)

    res8 = hfe.resolve("adam8bit", "cpu", log=False)
    if res8.backend == "bnb":  # the package's own class, as a user would pass it
        import bitsandbytes
        cls8 = bitsandbytes.optim.AdamW8bit
    elif res8.backend == "torchao":
        import torchao.optim
        cls8 = torchao.optim.AdamW8bit
    else:
        cls8 = res8.optimizer_cls
    nonfinite = "nonfinite" in SPECS["adamw"].options
    direct32 = "torch AdamW fused, passed in"
    direct8 = f"{res8.backend} {cls8.__name__}, passed in"
    arms = [  # (label, optim, optim_args, optimizer passed in, the arm it is compared with)
        ("hf_eff_adamw", "hf_eff_adamw", None, None, direct32),
        ("hf_eff_adamw nonfinite=ignore", "hf_eff_adamw", "nonfinite=ignore", None, direct32),
        (direct32, None, None, lambda m: torch.optim.AdamW(_groups(m), lr=LR, fused=True), None),
        ("hf_eff_adam8bit", "hf_eff_adam8bit", "embedding_state=8bit", None, direct8),
        ("hf_eff_adam8bit nonfinite=ignore", "hf_eff_adam8bit", "embedding_state=8bit,nonfinite=ignore", None, direct8),
        (direct8, None, None, lambda m: cls8(_groups(m), lr=LR, weight_decay=WD), None),
    ]
    if not nonfinite:
        arms = [a for a in arms if "nonfinite" not in a[0]]
    times = {a[0]: [] for a in arms}  # per arm: one list of step times per repetition
    opt_times = {a[0]: [] for a in arms}  # the same, for the time inside optimizer.step
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.trainer_reps):
            for label, optim, optim_args, make, _ in (arms if rep % 2 == 0 else arms[::-1]):
                model = new_model()
                targs = TrainingArguments(tmp, optim=optim or "adamw_torch", optim_args=optim_args,
                                          learning_rate=LR, weight_decay=WD, per_device_train_batch_size=16,
                                          max_steps=args.trainer_steps, save_strategy="no", report_to="none",
                                          logging_steps=args.trainer_steps, disable_tqdm=True, seed=0,
                                          dataloader_num_workers=0, use_cpu=True)
                clock = StepClock()
                trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[clock],
                                  optimizers=(make(model), None) if make else (None, None))
                trainer.remove_callback(PrinterCallback)
                trainer.train()
                times[label].append([b - a for a, b in zip(clock.marks, clock.marks[1:])][2:])  # after 3 warm-up steps
                opt_times[label].append(clock.opt_times[3:])
    n_params = sum(p.numel() for p in new_model().parameters())
    out = []
    for label, _, optim_args, _, ref in arms:
        row = {"arm": label, "optim_args": optim_args, "step_ms": median([t for run in times[label] for t in run]) * 1e3,
               "opt_step_ms": median([t for run in opt_times[label] for t in run]) * 1e3,
               "compared_with": ref, "steps": sum(map(len, times[label])), "params": n_params}
        if ref is not None:  # paired: each repetition's median against the reference's in the same repetition
            ratios = sorted(median(a) / median(b) - 1 for a, b in zip(times[label], times[ref]))
            # What the plugin adds lies inside optimizer.step (check, wrappers); the rest of a step is the same
            # code in both arms, so this difference is the low-noise measure of the plugin's cost per step.
            extra = sorted((median(a) - median(b)) / median(c) for a, b, c in
                           zip(opt_times[label], opt_times[ref], times[ref]))
            row.update(overhead=median(ratios), overhead_range=(ratios[0], ratios[-1]),
                       in_step_overhead=median(extra), in_step_range=(extra[0], extra[-1]))
        else:
            row.update(overhead=None, overhead_range=None, in_step_overhead=None, in_step_range=None)
        out.append(row)
    return out


# ------------------------------------------------------------------------------------------ forward + backward + step

def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A loss through every parameter of ``make_layers``' blocks (attention replaced by a sum of q, k, v: the
    optimizer and the gradient check see the same tensors; the mixing is not what is measured)."""
    h = x.shape[-1]
    for b in model:
        x = b.norm1(x + b.attn_out(b.qkv(x).view(-1, 3, h).sum(1)))
        x = b.norm2(x + b.ff_out(torch.nn.functional.gelu(b.ff_in(x))))
    return x.float().square().mean()


def backward_arms() -> list[tuple[str, torch.dtype, Callable[[nn.Module], torch.optim.Optimizer]]]:
    """(label, parameter dtype, build): torch's fused AdamW, and hf_eff_adamw, hf_eff_adam8bit and hf_eff_adamw_bf16
    with and without the check."""
    def ours(name, **kw):
        return lambda m: hfe.create_optimizer(m, name, lr=LR, weight_decay=WD, **kw)

    bf16 = torch.bfloat16
    return [(BASELINE, torch.float32, lambda m: torch.optim.AdamW(_groups(m), lr=LR, fused=True)),
            ("hf_eff_adamw", torch.float32, ours("adamw")),
            ("hf_eff_adamw nonfinite=ignore", torch.float32, ours("adamw", nonfinite="ignore")),
            ("hf_eff_adam8bit", torch.float32, ours("adam8bit")),
            ("hf_eff_adam8bit nonfinite=ignore", torch.float32, ours("adam8bit", nonfinite="ignore")),
            ("torch AdamW fused on bf16 params", bf16, lambda m: torch.optim.AdamW(_groups(m), lr=LR, fused=True)),
            ("hf_eff_adamw_bf16", bf16, ours("adamw_bf16")),
            ("hf_eff_adamw_bf16 nonfinite=ignore", bf16, ours("adamw_bf16", nonfinite="ignore"))]


class _ScanClock:
    """Time spent in the guard's C scan while ``inside`` is set (during backward: the scans its hooks run)."""

    def __init__(self):
        self.inside, self.seconds, self.real = False, 0.0, nonfinite._scan

    def __enter__(self):
        def timed(*a, **kw):
            if not self.inside:
                return self.real(*a, **kw)
            t = time.perf_counter()
            try:
                return self.real(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t

        nonfinite._scan = timed
        return self

    def __exit__(self, *exc):
        nonfinite._scan = self.real


def backward_run(args) -> list[dict]:
    """Per arm: forward, backward (and the check's scans within it), step and the whole iteration, median over
    ``--backward-reps`` iterations in a new random order each repetition (each arm its own copy of the layers, the
    same batch)."""
    device = args.device
    arms = []
    for label, dtype, build in backward_arms():
        model = make_layers(args.hidden, args.layers, dtype, device)
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            arms.append({"label": label, "dtype": dtype, "model": model, "opt": build(model),
                         "times": {k: [] for k in ("forward", "backward", "scan_in_backward", "step", "iteration")}})
    x = torch.randn(args.backward_tokens, args.hidden, device=device, generator=torch.Generator(device).manual_seed(2))
    xs = {dt: x.to(dt) for dt in (torch.float32, torch.bfloat16)}
    with _ScanClock() as clock:
        for rep in range(args.backward_warmup + args.backward_reps):
            for arm in random.Random(rep).sample(arms, len(arms)):  # shuffled, as the step table's rows
                opt, model = arm["opt"], arm["model"]
                opt.zero_grad(set_to_none=True)
                _sync(device)
                t0 = time.perf_counter()
                loss = _forward(model, xs[arm["dtype"]])
                _sync(device)
                t1 = time.perf_counter()
                clock.inside, clock.seconds = True, 0.0
                loss.backward()
                clock.inside = False
                _sync(device)
                t2 = time.perf_counter()
                opt.step()
                _sync(device)
                t3 = time.perf_counter()
                if rep >= args.backward_warmup:
                    for k, v in (("forward", t1 - t0), ("backward", t2 - t1), ("scan_in_backward", clock.seconds),
                                 ("step", t3 - t2), ("iteration", t3 - t0)):
                        arm["times"][k].append(v)
    base = next(a for a in arms if a["label"] == BASELINE)
    out = []
    for arm in arms:
        med = {k: median(v) for k, v in arm["times"].items()}
        t, b = arm["times"], base["times"]
        ratios = {k: median([x / y for x, y in zip(t[k], b[k])]) for k in ("step", "iteration")}
        ratios["step_plus_scan"] = median([(x + c) / y for x, c, y in zip(t["step"], t["scan_in_backward"], b["step"])])
        out.append({"arm": arm["label"], "param_dtype": str(arm["dtype"]).removeprefix("torch."),
                    **{f"{k}_ms": v * 1e3 for k, v in med.items()},
                    "step_ratio": ratios["step"], "iteration_ratio": ratios["iteration"],
                    "step_plus_scan_ratio": ratios["step_plus_scan"],
                    "iterations": len(arm["times"]["step"])})
    return out


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    device = argparse.ArgumentParser(add_help=False)
    device.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    known, rest = device.parse_known_args(argv)
    if torch.device(known.device).type == "cuda":  # a GPU: its own shapes, peers and end-to-end rows
        import bench_cuda
        return bench_cuda.main(rest)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=15, help="interleaved timed steps per optimizer")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per optimizer first (compilation happens here)")
    p.add_argument("--probe-mb", type=int, default=256, help="size of the bandwidth probes' tensor, MiB")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--trainer-reps", type=int, default=6, help="interleaved Trainer runs per arm (0: skip)")
    p.add_argument("--trainer-steps", type=int, default=25)
    p.add_argument("--trainer-hidden", type=int, default=256)
    p.add_argument("--backward-reps", type=int, default=10,
                   help="interleaved forward + backward + step iterations per optimizer (0: skip)")
    p.add_argument("--backward-warmup", type=int, default=2)
    p.add_argument("--backward-tokens", type=int, default=256, help="tokens (rows) of the forward's batch")
    p.add_argument("--no-compile", action="store_true",
                   help="run torch.compile'd optimizers eagerly (smoke tests: skips minutes of compilation)")
    p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test")
    p.add_argument("--only", default="", help="comma-separated words: only the step rows whose label or state "
                   "format holds one (and the baseline), e.g. 'Muon' for Muon's rows")
    p.add_argument("--page", default="bench_step", choices=("bench_step", "bench_muon"),
                   help="the page written into --out (bench_muon: Muon's rows, --only Muon)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.reps, args.warmup, args.probe_mb = 64, 1, 3, 1, 8
        args.trainer_reps, args.trainer_steps, args.trainer_hidden = min(args.trainer_reps, 1), 5, 32
        args.backward_reps, args.backward_warmup, args.backward_tokens = min(args.backward_reps, 2), 1, 16
    import torch._dynamo as dynamo

    threads, dynamo_disabled = torch.get_num_threads(), dynamo.config.disable
    try:  # called from tests too: leave the process as it was
        if args.threads:
            torch.set_num_threads(args.threads)
        if args.no_compile:
            dynamo.config.disable = True
        info = machine(args.device)
        result = run(args)
        rows = annotate(rows_of(result))
        backward = backward_run(args) if args.backward_reps > 0 else []
        overhead = trainer_overhead(args) if args.trainer_reps > 0 and torch.device(args.device).type == "cpu" else []
    finally:
        torch.set_num_threads(threads)
        dynamo.config.disable = dynamo_disabled
        if args.no_compile:  # frames first run with dynamo off stay skipped: a later torch.compile(fullgraph) fails
            dynamo.reset()
    config = {k: getattr(args, k) for k in ("hidden", "layers", "reps", "warmup", "probe_mb", "threads", "only",
                                            "trainer_reps", "trainer_steps", "trainer_hidden", "backward_reps",
                                            "backward_warmup", "backward_tokens", "no_compile")}
    doc = {"command": command_line(__file__, argv), "page": args.page, "machine": info,
           "loadavg_after": [round(x, 2) for x in os.getloadavg()], "config": {**config, "lr": LR, "weight_decay": WD},
           "tensors": len(list(make_layers(8, args.layers, torch.float32, "cpu").parameters())),
           "bandwidth_bytes_per_s": result["bandwidth"], "copy_bandwidth_bytes_per_s": result["copy_bandwidth"],
           "probes": result["probes"], "vouched": result["vouched"], "rows": rows, "trainer_overhead": overhead,
           "backward": backward}
    print(render_results.write(args.out, args.page, doc))
    return doc


if __name__ == "__main__":
    main()
