"""The results pages of the benchmark scripts, written from their JSON alone: a function per page.

    python scripts/render_results.py docs/results/bench_step.json     # rewrites bench_step.md (and .png)
    python scripts/render_results.py docs/results/*.json              # every page

Each script in scripts/ measures into ``<page>.json`` through :func:`write`, which then renders ``<page>.md`` (and
``<page>.png`` where the page has a plot) beside it. Rendering never measures, so a page's wording or layout can
change and every page be rewritten from its committed JSON, its numbers untouched. Pages state what was measured
and how it compares (ratios to a baseline, the fastest row of a format, the bandwidth limit); they pass no verdicts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


# ------------------------------------------------------------------------------------------ shared

def md_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(x: float | None, digits: int = 2) -> str:
    return "—" if x is None or x != x else f"{x:.{digits}f}"


def machine_md(info: dict, load_after: list[float] | None = None) -> str:
    """The machine and its load (the machines are shared: the load says how far to trust absolute times)."""
    gpu = info["gpu"] or "none used (CPU run)"
    after = f"; after: {', '.join(map(str, load_after))}" if load_after else ""
    return (f"- Machine: {info['cpu']}, {info['cores']} cores ({info['cpu_capability']}), torch {info['torch']} "
            f"with {info['torch_threads']} threads, Python {info['python']}; GPU: {gpu}\n"
            f"- Load average (1, 5, 15 min) at start: {', '.join(map(str, info['loadavg_1_5_15']))}{after} "
            f"(a shared machine: compare ratios within this run, not absolute times across runs)\n"
            f"- Date: {info['date']}")


def figure(page: str, alt: str) -> str:
    """The page's own plot (``<page>.png``, written beside it by :func:`render`), shown where the line stands."""
    return f"![{alt}]({page}.png)"


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# ------------------------------------------------------------------------------------------ bench_step

def bench_step_md(doc: dict) -> str:
    cfg, rows = doc["config"], doc["rows"]
    params = next((r["params"] for r in rows if "params" in r), 0)
    headers = ["optimizer", "backend / option", "state format", "params", "step ms (median)", "IQR ms",
               "M params/s", "state B/param", "x fused fp32", "B moved/param", "limit ms", "% of limit",
               "first step s"]
    table = []
    for r in rows:
        label = f"**{r['optimizer']}**" if r["optimizer"].startswith("hf_eff_") else r["optimizer"]
        if "step_ms" not in r:
            table.append([label, _bench_option(r), r["format"], r["param_dtype"], "not run: " + (r["error"] or "?")]
                         + [""] * 8)
            continue
        table.append([label, _bench_option(r), r["format"], r["param_dtype"], fmt(r["step_ms"], 1),
                      f"{r['q1_ms']:.1f}–{r['q3_ms']:.1f}", fmt(r["mparams_per_s"], 0),
                      fmt(r["state_bytes_per_param"], 2), fmt(r["ratio_to_fused"], 2),
                      fmt(r["bytes_moved_per_param"], 1), fmt(r["limit_ms"], 1),
                      f"{100 * r['share_of_limit']:.0f}%", fmt(r["first_step_s"], 2)])
    text = ["# Optimizer step benchmark\n",
            f"Command: `{doc['command']}`\n",
            machine_md(doc["machine"], doc["loadavg_after"]),
            f"- Parameters: {cfg['layers']} transformer layers of hidden {cfg['hidden']} ({params:,} parameters in "
            f"{doc['tensors']} tensors: fused QKV, output projection, 4x MLP, LayerNorms, biases; no embedding), fixed "
            f"random gradients, lr={cfg['lr']}, weight_decay={cfg['weight_decay']} with hf_efficient's decay groups",
            f"- Timing: {cfg['warmup']} warm-up steps each, then {cfg['reps']} interleaved repetitions; median and "
            f"interquartile range of single steps; *x fused fp32*: the median of each repetition's step time over "
            f"torch's fused fp32 AdamW's in the same repetition",
            f"- Memory bandwidth: {doc['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, measured as an optimizer moves "
            f"memory: an in-place update of {cfg['probe_mb']} MiB (`x.mul_(-1)`: each byte read and written), median "
            f"of {doc['probes']} probes interleaved with the steps. (A copy `dst.copy_(src)` reaches "
            f"{doc['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s counting 2 bytes per byte: writing a line the core "
            "does not hold costs an extra read, which in-place updates do not pay)",
            "- B moved/param: the least a step must move (read parameter, gradient and state, write parameter and "
            "state); limit ms = those bytes / bandwidth; % of limit = limit / measured time",
            "- **bold**: ours; (pick): the backend the registry picks here; a Kahan/bf16 row runs on bf16 parameters",
            "- Gradients set through a backward pass: with the inf/NaN check on (nonfinite=raise, the default), the "
            "guard scanned the gradients of 65,536+ elements in backward (its hooks), so those rows' step time holds "
            "only the scan of the small ones; the check's time in backward is in the forward + backward + step "
            "section below. Still vouched for by the backward scan after the last timed step (no step changed a "
            f"gradient): {'yes' if doc['vouched'] else 'NO: the rows with the check rescanned them'}\n",
            figure(doc.get("page", "bench_step"), "Median step time of each row (log scale; the tick: the bandwidth limit of its bytes) "
                   "and its optimizer state in bytes per parameter, coloured by state format") + "\n",
            md_table(headers, table), "\n## The registry's picks against the other options of their format\n",
            *(_bench_picks(rows) or ["- no rows ran"])]
    if doc["backward"]:
        text += _bench_backward(doc["backward"], cfg)
    if doc["trainer_overhead"]:
        text += _bench_trainer(doc["trainer_overhead"], cfg)
    return "\n".join(text) + "\n"


def _bench_option(r: dict) -> str:
    return " ".join(x for x in [r["backend"] or "", "(pick)" if r["pick"] else "", r["note"]] if x)


def _bench_picks(rows: list[dict]) -> list[str]:
    """Each of our picked rows: its ratio to fused fp32 AdamW, the fastest row of its format, and what the inf/NaN
    check costs its step (from the rows' ``fastest_of_format`` and ``check_cost``, set when measured)."""
    ok = [r for r in rows if "step_ms" in r]
    lines = []
    for r in ok:
        if not (r["pick"] and r["optimizer"].startswith("hf_eff_")) or r["note"].startswith("runs "):
            continue
        best = next((x for x in ok if x["format"] == r["format"] and x.get("fastest_of_format")), r)
        verdict = "it is the fastest" if best is r else \
            f"the fastest is {best['optimizer']} {_bench_option(best)}".rstrip() + f" at {best['step_ms']:.1f} ms"
        lines.append(f"- `{r['optimizer']}` ({r['backend']}): {r['step_ms']:.1f} ms, {r['ratio_to_fused']:.2f}x fused "
                     f"fp32 AdamW; among the {r['format']} rows, {verdict}")
        if r.get("check_cost") is not None:
            lines.append(f"  - inf/NaN gradient check (nonfinite=raise, the default): {100 * r['check_cost']:+.1f}% "
                         "of the optimizer step against the same row with nonfinite=ignore")
    return lines


def _bench_backward(rows: list[dict], cfg: dict) -> list[str]:
    by = {r["arm"]: r for r in rows}
    table = [[f"**{r['arm']}**" if r["arm"].startswith("hf_eff_") else r["arm"], r["param_dtype"],
              fmt(r["forward_ms"], 1), fmt(r["backward_ms"], 1), fmt(r["scan_in_backward_ms"], 2), fmt(r["step_ms"], 2),
              fmt(r["iteration_ms"], 1), fmt(r["step_ratio"], 2), fmt(r["step_plus_scan_ratio"], 2),
              fmt(r["iteration_ratio"], 3)] for r in rows]
    lines = ["\n## Forward + backward + step: where the inf/NaN check went\n",
             f"The same {cfg['layers']} layers (a forward through every parameter, {cfg['backward_tokens']} tokens, "
             f"loss = mean square), one copy per arm; {cfg['backward_reps']} interleaved iterations after "
             f"{cfg['backward_warmup']} warm-up ones, each: `zero_grad(set_to_none=True)`, forward, backward, `step()`. "
             "Medians; ratios are medians of per-iteration ratios to torch's fused fp32 AdamW in the same repetition. "
             "*check in backward*: time inside the guard's C scan during backward (its post-accumulate-grad hooks "
             "scan each gradient of 65,536+ elements as backward completes it; smaller ones are scanned at `step()`, "
             "in one call). *step + check in backward*: the step plus the check's time in its backward, over the fused "
             "step of the same repetition: the check's whole cost charged to the step.\n",
             md_table(["optimizer", "params", "forward ms", "backward ms", "check in backward ms", "step ms",
                       "iteration ms", "step x fused fp32", "step + check in backward x fused fp32",
                       "iteration x fused fp32"], table), ""]
    for on in rows:
        off = by.get(f"{on['arm']} nonfinite=ignore")
        if off:
            lines.append(f"- `{on['arm']}`: step {on['step_ratio']:.2f}x fused fp32 AdamW, "
                         f"{on['step_plus_scan_ratio']:.2f}x with the check's time in backward charged to it. The "
                         f"check: {on['scan_in_backward_ms']:.2f} ms in backward "
                         f"({100 * on['scan_in_backward_ms'] / off['iteration_ms']:.2f}% of an iteration) and "
                         f"{on['step_ms'] - off['step_ms']:+.2f} ms in the step vs nonfinite=ignore; whole iteration "
                         f"{100 * (on['iteration_ms'] / off['iteration_ms'] - 1):+.1f}% (within the noise of forward "
                         "and backward: the check's own time is the measure)")
    return lines


def _bench_trainer(overhead: list[dict], cfg: dict) -> list[str]:
    text = ["\n## Plugin overhead in a Trainer step\n",
            f"BertForMaskedLM ({overhead[0]['params']:,} parameters, hidden {cfg['trainer_hidden']}, 2 layers, batch "
            f"16 x 64 tokens) trained by Trainer for {cfg['trainer_steps']} steps per run, {cfg['trainer_reps']} "
            "interleaved runs per arm; step = on_step_end to on_step_end (forward, backward, clipping, "
            "optimizer, scheduler, callbacks), after 3 warm-up steps. Overhead: median over repetitions of "
            "(this arm's median step / the reference's median step in the same repetition) - 1, with the range "
            "over repetitions, which shows the noise. Everything the plugin adds per step (the inf/NaN check, "
            "its wrappers) runs inside `optimizer.step`, timed on its own: *plugin cost* is (this arm's median "
            "`optimizer.step` - the reference's) / the reference's median whole step, paired per repetition, "
            "the measure that noise in forward and backward does not swamp. The 8-bit arms quantize the "
            "embeddings too (`embedding_state=8bit`) to hold the same state as the optimizer passed in.\n",
            md_table(["Trainer with", "optim_args", "step ms (median)", "optimizer.step ms",
                      "plugin cost, % of a step", "range over runs",
                      "whole step vs the same backend passed in", "range over runs", "steps"],
                     [[o["arm"], o["optim_args"] or "", fmt(o["step_ms"], 1), fmt(o.get("opt_step_ms"), 2)]
                      + (["(reference)", "", "", ""] if o["overhead"] is None else
                         [f"{100 * o['in_step_overhead']:+.2f}%",
                          f"{100 * o['in_step_range'][0]:+.2f}% to {100 * o['in_step_range'][1]:+.2f}%",
                          f"{100 * o['overhead']:+.1f}%",
                          f"{100 * o['overhead_range'][0]:+.1f}% to {100 * o['overhead_range'][1]:+.1f}%"])
                      + [o["steps"]] for o in overhead])]
    by_arm = {o["arm"]: o for o in overhead}
    for o in overhead:  # the inf/NaN check's share of a whole training step
        off = by_arm.get(f"{o['arm']} nonfinite=ignore")
        if off and o["opt_step_ms"] == o["opt_step_ms"] and off["opt_step_ms"] == off["opt_step_ms"]:
            extra = o["opt_step_ms"] - off["opt_step_ms"]
            text.append(f"\n- inf/NaN check of `{o['arm']}` in a Trainer step: {extra:+.2f} ms of optimizer.step, "
                        f"{100 * extra / off['step_ms']:+.2f}% of a {off['step_ms']:.1f} ms training step")
    return text


def bench_step_png(doc: dict, path: Path) -> None:
    plt = _pyplot()
    info = doc["machine"]
    ok = [r for r in doc["rows"] if "step_ms" in r]
    labels = [" ".join(x for x in [r["optimizer"], r["backend"] or "", "*" if r["pick"] else "", r["note"]] if x)
              for r in ok]
    formats = list(dict.fromkeys(r["format"] for r in doc["rows"]))  # the rows come sorted by format
    colors = {f: plt.cm.tab10(i % 10) for i, f in enumerate(formats)}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 0.38 * len(ok) + 1.8), sharey=True)
    y = range(len(ok))
    ax1.barh(y, [r["step_ms"] for r in ok], color=[colors[r["format"]] for r in ok])
    ax1.scatter([r["limit_ms"] for r in ok], y, marker="|", s=200, color="k", label="bandwidth limit", zorder=3)
    ax1.set_xscale("log")
    ax1.set_xlabel("step time, ms (median, log scale)")
    ax1.legend(loc="lower right")
    ax2.barh(y, [r["state_bytes_per_param"] for r in ok], color=[colors[r["format"]] for r in ok])
    ax2.set_xlabel("optimizer state, bytes / parameter")
    ax1.set_yticks(list(y), labels, fontsize=8)
    ax1.invert_yaxis()
    shown = [f for f in formats if any(r["format"] == f for r in ok)]
    ax2.legend([plt.Rectangle((0, 0), 1, 1, color=colors[f]) for f in shown], shown, loc="lower right", fontsize=8)
    fig.suptitle(f"Optimizer step, {ok[0]['params'] / 1e6:.1f}M params on {info['cpu']} "
                 f"({info['torch_threads']} threads, load {info['loadavg_1_5_15'][0]}); * = registry's pick", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ bench_cuda

def bench_cuda_md(result: dict) -> str:
    base, steps = result["baseline_ms"], result["steps"]
    baseline = steps[0]["label"]  # the baseline is measured first (and last)
    bmin = 3 * 4 + 2 * 8  # fused fp32 AdamW: 28 bytes per parameter
    b_back = statistics.median([r["backward_ms"] for r in steps if "backward_ms" in r and r["label"] == baseline]
                               or [0])
    rows = []
    for r in steps:
        if "error" in r:
            rows.append([r["label"], "—", "—", "—", "—", "—", "—", "—", r["error"][:80]])
            continue
        rows.append([r["label"], fmt(r["step_ms"]), fmt(r["step_ms"] / base) + "x",
                     fmt(r["min_bytes_per_param"] / bmin) + "x", fmt(r["state_bytes_per_param"]),
                     r["kernels"], r["syncs"], fmt(r["temporaries_mb"], 1),
                     fmt(r["backward_ms"] - b_back) if r["label"] != baseline else "0.00"])
    m = result["machine"]
    out = [f"# Optimizer step on a GPU ({m['gpu']})", "",
           f"- Command: `{result['command']}`", f"- Date: {m['date']}; torch {m['torch']}; triton "
           f"{result.get('triton')}; bitsandbytes {result.get('bitsandbytes')}; transformers {result.get('transformers')}",
           f"- {result['params'] / 1e9:.2f}B parameters ({result['layers']} Llama-1B layers); median of "
           f"{result['reps']} steps; unit: {baseline} at {fmt(base)} ms (first and last of the run: "
           f"{fmt(result['baseline_first_ms'])} / {fmt(result['baseline_last_ms'])} ms)", "",
           md_table(["step", "ms", "x fused fp32 AdamW", "bandwidth limit (x)", "state B/param", "kernels", "host syncs",
                     "temporaries MiB", "backward +ms"], rows), "",
           "bandwidth limit: the bytes a step must move (parameters read and written, gradients read, state read and "
           "written) over fused fp32 AdamW's 28 per parameter. backward +ms: the time of the backward pass that sets "
           "the gradients, over the baseline's (what a check in backward hooks costs).", ""]
    sites = [f"- {r['label']}: {', '.join(r['sync_sites'])}" for r in steps if r.get("sync_sites")]
    if sites:
        out += ["Where the host syncs were made (the Python line torch's sync warning names):", "", *sites, ""]
    if result.get("e2e"):
        ref = next((r.get("tokens_per_s") for r in result["e2e"] if r["label"].startswith("bf16 weights + torch")),
                   None)
        e2e = [[r["label"], fmt(r.get("tokens_per_s"), 0), fmt(r["tokens_per_s"] / ref) + "x" if ref and
                "tokens_per_s" in r else "—", fmt(r.get("peak_gb")), r.get("error", "")[:80]] for r in result["e2e"]]
        out += [f"## End to end: config-built Llama, {result['e2e_params'] / 1e6:.0f}M parameters, 4 x 1024 tokens, "
                "gradient checkpointing", "",
                md_table(["configuration", "tokens/s", "x bf16 + torch fused AdamW", "peak GB", "error"], e2e), ""]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------ bench_import

def bench_import_md(doc: dict) -> str:
    med, hook, reps = doc["median_s"], doc["hook_import_us"], doc["reps"]
    rows = [[label, f"{1e3 * m['wall']:.1f}", f"{1e3 * m['cpu']:.1f}"] for label, m in med.items()]
    return "\n\n".join([
        "# What hf_efficient costs a Python process",
        f"`{doc['command']}`: fresh interpreters, medians of {reps} repetitions after one warm-up run of each; hook: "
        f"`{doc['hook']}`; bytecode caches on (as after `pip install`).",
        machine_md(doc["machine"]),
        md_table(["case", "wall ms", "CPU ms"], rows),
        f"- The hook's module at start-up (`-X importtime`, cumulative): {hook['on']:.0f} us with the hook on, "
        f"{hook['off']:.0f} us under `HF_EFF_AUTOLOAD=0` (the .pth line reads the variable and loads nothing).",
        "\n".join(f"- {k}: {v:.2f}" for k, v in doc["ratios"].items()),
        "- `import hf_efficient` loads no transformers module (asserted in the case itself).",
        "CPU time is the steadier figure on a shared machine; differences of a few milliseconds between "
        "whole interpreters are within their noise, which the `-X importtime` line resolves.",
    ]) + "\n"


# ------------------------------------------------------------------------------------------ bench_ns

def bench_ns_md(doc: dict) -> str:
    cfg, layer = doc["config"], doc["layer"]
    rows = [[r["batch"], f"{r['count']} x {r['rows']} x {r['cols']}", fmt(r["ns_ms"]), fmt(r["matmul_ms"]),
             f"{r['ns_tflops']:.3f}", f"{r['matmul_tflops']:.3f}", f"{r['ratio']:.2f}"] for r in doc["rows"]]
    rows.append(["one layer", "", "", "", f"{layer['ns_tflops']:.3f}", f"{layer['matmul_tflops']:.3f}",
                 f"{layer['ratio']:.2f}"])
    return "\n".join([
        "# Newton-Schulz against a plain matmul of the same shapes", "", f"Command: `{doc['command']}`", "",
        machine_md(doc["machine"]), "",
        f"- Muon's matrices of {cfg['layers']} layer(s) of hidden {cfg['hidden']}, MLP {cfg['ffn']} (the 1.23B "
        f"bench model), in {cfg['dtype']}, {cfg['ns_steps']} Newton-Schulz steps of `optim/muon.py`'s "
        "`newton_schulz_`, batched by shape as Muon runs them; a step is 4 r^2 c + 2 r^3 flops a matrix (r <= c)",
        f"- Reference: `torch.bmm(X, X^T)` on the same batch and dtype (2 r^2 c flops); {cfg['reps']} interleaved "
        f"repetitions each, medians; torch threads: {cfg['torch_threads']}", "",
        md_table(["batch", "matrices", "Newton-Schulz ms", "matmul ms", "Newton-Schulz TFLOP/s", "matmul TFLOP/s",
                  "ratio"], rows), ""])


# ------------------------------------------------------------------------------------------ bench_adamw8bit

def bench_adamw8bit_md(doc: dict) -> str:
    rows = [[r["shape"], r["optimizer"], fmt(r["median_ms"]), fmt(r["min_ms"]), fmt(r["ratio"])] for r in doc["rows"]]
    return "\n".join(["# 8-bit AdamW step beside fused fp32 AdamW", "", f"Command: `{doc['command']}`", "",
                      machine_md(doc["machine"]), "",
                      f"- Weights of the 8-bit optimizers: {doc['config']['dtype']}; {doc['config']['reps']} "
                      f"interleaved repetitions after {doc['config']['warmup']} warm-up steps; ratios: medians over "
                      "fused fp32 AdamW's median", "",
                      md_table(["shape", "optimizer", "median ms", "min ms", "x fused fp32"], rows)]) + "\n"


# ------------------------------------------------------------------------------------------ memory_release

TITLES = {"minilm": "MiniLM masked-LM fine-tune (examples/data.py)",
          "llama": "Llama-shaped causal LM (LlamaConfig, random init, untied embedding and lm head)"}
WHY = {"minilm": "The examples' model. Its lm head is tied to the word embedding: one tensor of half the parameters, "
                 "whose gradient lives through the whole backward, released or not.",
       "llama": "Llama's shapes at a size a 2-core CPU steps in seconds: its largest tensors (embedding, lm head) are "
                "2% of the parameters each, as in real LLMs (Llama-7B's embedding: 2.0%), so what release leaves of "
                "the gradients here is what it leaves on an LLM."}
QUANTIZED_EMBEDDINGS_NOTE = (" (two {bits}-bit moments, {bytes:g} B, the embeddings' too; plus their blockwise scales and "
                             "the 32-bit state of the tensors too small to quantize: norms, biases)")


def memory_release_md(doc: dict) -> str:
    cfg, rows = doc["config"], doc["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    text = ["# Gradient release: training memory and step time", "",
            f"Models: {', '.join(models)} (a section each), on {cfg['device']}. Command: `{doc['command']}`", "",
            machine_md(doc["machine"], doc["loadavg_after"]), "",
            "Peak of live weights + gradients + optimizer state during the measured step (see the script's docstring "
            "for the method), bytes per parameter. Peak RSS is the whole process's (model creation, the forward's "
            "activations, the step's temporaries, memory the allocator keeps): it does not follow the live total, "
            "and on CPU, where the activations of the forward set it, release need not lower it.", "",
            figure("memory_release", "Peak live bytes per parameter of each arm, weights + gradients + optimizer state, "
                   "with and without release, one panel per model"), ""]
    for model in models:
        text += _memory_model(model, [r for r in rows if r["model"] == model], cfg)
    speeds = doc["speed"]
    text += ["## Step time (forward + backward + step), median, MiniLM", "",
             f"{cfg['reps']} timed steps per arm, alternating, after {cfg['warmup']} warm-up steps.", "",
             md_table(["optimizer", "release bucket_bytes", "ordinary step ms", "with release ms",
                       "release / ordinary"],
                      [[s["optim"], s["bucket_bytes"], fmt(s["step_ms"], 1), fmt(s["release_step_ms"], 1),
                        fmt(s["ratio"], 3)] for s in speeds])]
    return "\n".join(text) + "\n"


def _memory_model(model: str, rows: list[dict], cfg: dict) -> list[str]:
    """One model's table, its lowest configuration, and what each term of it is."""
    ok = [r for r in rows if "error" not in r]
    cuda = cfg["device"].startswith("cuda")
    heads = ["configuration", "weights", "release", "weights B/param", "gradients B/param (at peak)",
             "state B/param", "total B/param", "peak RSS MiB"] + (["max_memory_allocated MiB"] if cuda else [])
    table = [[r["config"], r["weights"], "yes" if r["released"] else "no", fmt(r["weights_bpp"]), fmt(r["grads_bpp"]),
              fmt(r["state_bpp"]), f"**{fmt(r['total_bpp'])}**", fmt(r["peak_rss_mib"], 0)]
             + ([fmt(r["max_allocated_mib"], 0)] if cuda else []) for r in ok]
    text = [f"## {TITLES.get(model, model)}", ""]
    if ok:
        r0 = ok[0]
        text += [f"{WHY.get(model, '')} {r0['params'] / 1e6:.1f}M parameters; largest tensor `{r0['largest_tensor']}`, "
                 f"{100 * r0['largest_share']:.1f}% of them. Batch {cfg['batch']} x <= {cfg['seq']} tokens.", "",
                 md_table(heads, table), ""]
    base = next((r for r in ok if r["config"] == "adamw_torch"), None)
    lowest = min(ok, key=lambda r: r["total_bpp"]) if ok else None
    if lowest and base:
        grad_bytes = 2 if lowest["weights"] == "bf16" else 4
        bits = next((b for b in (8, 4) if f"embedding_state={b}bit" in lowest["optim_args"]), None)
        note = QUANTIZED_EMBEDDINGS_NOTE.format(bits=bits, bytes=bits / 4) if bits else ""
        text.append(
            f"Lowest: `{lowest['config']}` at {fmt(lowest['total_bpp'])} B/param, against {fmt(base['total_bpp'])} "
            f"for fp32 AdamW ({fmt(base['total_bpp'] / lowest['total_bpp'], 1)}x less): weights "
            f"{fmt(lowest['weights_bpp'])} ({lowest['weights']}); optimizer state {fmt(lowest['state_bpp'])}{note}; "
            f"gradients {fmt(lowest['grads_bpp'])}: with release only the gradients in flight are alive, at most "
            f"a bucket of {cfg['bucket_bytes'] / 2**20:g} MiB plus the tensor being completed, so this term is set by "
            f"the largest tensor (`{lowest['largest_tensor']}`: {fmt(grad_bytes * lowest['largest_share'])} B/param "
            f"alone at {grad_bytes} B per element), not by the sum of all gradients.")
    for r in rows:
        if "error" in r:
            text.append(f"\n- `{r['config']}` did not run here: {r['error']}")
    return text + [""]


def memory_release_png(doc: dict, path: Path) -> None:
    plt = _pyplot()
    rows = [r for r in doc["rows"] if "error" not in r]
    models = list(dict.fromkeys(r["model"] for r in rows))
    groups = [[r for r in rows if r["model"] == m] for m in models]
    fig, axes = plt.subplots(len(groups), 1, sharex=True, squeeze=False, figsize=(10, 0.42 * len(rows) + 1.6 * len(
        groups)), gridspec_kw={"height_ratios": [len(g) for g in groups]})
    for ax, group in zip(axes[:, 0], groups):
        y = list(range(len(group)))
        left = [0.0] * len(group)
        for key, label, color in (("weights_bpp", "weights", "tab:blue"), ("grads_bpp", "gradients", "tab:red"),
                                  ("state_bpp", "optimizer state", "tab:green")):
            vals = [r[key] for r in group]
            ax.barh(y, vals, left=left, color=color, label=label)
            left = [a + b for a, b in zip(left, vals)]
        for yi, total in zip(y, left):
            ax.text(total + 0.1, yi, f"{total:.2f}", va="center", fontsize=8)
        ax.set_yticks(y, [r["config"] for r in group], fontsize=8)
        ax.invert_yaxis()
        r0 = group[0]
        ax.set_title(f"Gradient release, {r0['model']}: {r0['params'] / 1e6:.1f}M params, largest tensor "
                     f"{100 * r0['largest_share']:.1f}% of them, on {doc['machine']['cpu']}", fontsize=9)
    axes[0, 0].legend(loc="lower right")
    axes[-1, 0].set_xlabel("peak live bytes per parameter during a training step (weights + gradients + optimizer "
                           "state)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ convergence

def convergence_md(doc: dict) -> str:
    results, cfg, info = doc["results"], doc["config"], doc["machine"]
    by_label = {r["run"]["label"]: r for r in results}
    baseline = doc["baseline"]
    base = by_label.get(baseline)
    rows = []
    for r in results:
        run, j = r["run"], _judge(r, by_label, baseline)
        live = r.get("live_peak")
        rows.append([run["label"], r["backend"], "bf16" if run["bf16"] else "fp32",
                     f"{cfg['lr'] * run.get('lr_scale', 1.0):.3g}", fmt(r["curve"][0]["loss"], 4),
                     fmt(r["final_loss"], 4), _pct(j["rel"]), "—" if j["ref"] is base else _pct(j["rel_ref"]),
                     fmt(100 * r["final_accuracy"], 1), fmt(r["state_bytes"] / 2**20, 1),
                     "—" if live is None else fmt(live["gradients"] / 2**20, 1),
                     "—" if live is None else fmt(sum(live.values()) / r["num_params"], 2),
                     fmt(r["peak"][1] / 2**20, 0),
                     fmt((r["peak"][1] - r["memory_at_start_of_training"]) / 2**20, 0),
                     fmt(r["train_s"], 0), fmt(r["wall_s"], 0)])
    headers = ["run", "backend", "params", "lr", "eval loss at 0", "final eval loss", "vs fp32 AdamW",
               "vs its fp32 reference (if not AdamW)", "final accuracy %",
               "optimizer state MiB", "gradients MiB (live peak)", "weights + grads + state B/param (live peak)",
               f"{results[0]['peak'][0]} MiB", "peak - at start of training MiB", "train s", "wall s"]
    wall = doc.get("wall_s")
    text = ["# Convergence: fine-tuning the pretrained MiniLM with each optimizer\n",
            f"Command: `{doc['command']}`" + (f" ({wall / 60:.1f} min)" if wall else "") + "\n",
            machine_md(info, doc["loadavg_after"])]
    for s in doc.get("merged", []):
        text += ["", _merged_session(s, base)]
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
             "buffer), `none` (round to nearest: the stale weights, shown for contrast); compared with the same fp32 "
             "reference as the name on fp32 weights"]
    for math, ref in doc["references"].items():
        if ref["label"] != baseline and any(r["run"].get("math") == math for r in results) and not ref["betas"]:
            text.append(f"- {math} runs compare with `{ref['label']}` (fp32 state, the same split, decay groups and "
                        "lr; fp32 AdamW's row is the other comparison)")
        elif ref["label"] != baseline and any(r["run"].get("math") == math for r in results):
            text.append(f"- {math} runs use betas {tuple(ref['betas'])} (its own, as the paper, bitsandbytes and "
                        f"torch-optimi) and compare with `{ref['label']}`: fp32 state, the same math, decay groups, "
                        "betas and lr")
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
    text += ["", figure("convergence", "Eval loss and masked-token accuracy over the steps of each run on fp32 weights; "
                        "on the bf16 model, eval loss under each compensation mode, and each run's final eval loss "
                        "against fp32 AdamW's"),
             "", md_table(headers, rows), *_compensation_summary(doc, by_label), *_lowest_memory(doc, by_label),
             *_other_seeds(doc, by_label), *_lr_summary(doc, base)]
    return "\n".join(text) + "\n"


def _merged_session(s: dict, base: dict | None) -> str:
    """The line on one session merged into the page (``convergence.py --merge``)."""
    return (f"Re-run on {s['machine']['date']} and merged into this page (`--merge`): "
            + ", ".join(f"`{label}`" for label in s["labels"]) + f". Command: `{s['command']}` "
            f"({s['wall_s'] / 60:.1f} min, {s['config']['threads'] or 'default'} torch thread(s) per run, "
            f"{s['config']['jobs']} run(s) at a time); load average at start "
            f"{', '.join(map(str, s['machine']['loadavg_1_5_15']))}, after {', '.join(map(str, s['loadavg_after']))}"
            + ("" if s.get("baseline_before") in (None, base and base["final_loss"]) else
               f". The baseline's final eval loss moved from {s['baseline_before']:.4f}: every row is compared "
               "with the re-run")
            + ("" if s.get("baseline_before") is None or s["baseline_before"] != (base and base["final_loss"])
               else ". The baseline, re-run, reproduced its final eval loss exactly")
            + (". Rows dropped (no longer planned): " + ", ".join(f"`{d}`" for d in s["dropped"])
               if s.get("dropped") else ""))


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:+.2f}%"


def _judge(r: dict, by_label: dict, baseline: str) -> dict:
    """A result's final eval loss against fp32 AdamW's (``rel``) and against its own fp32 reference's (``ref``,
    ``rel_ref``); None where that run is missing or is the result itself."""
    base, ref = by_label.get(baseline), by_label.get(r["run"].get("reference", baseline))
    rel = None if base is None or r is base else r["final_loss"] / base["final_loss"] - 1
    rel_ref = None if ref is None or ref is r else r["final_loss"] / ref["final_loss"] - 1
    return {"rel": rel, "ref": ref, "rel_ref": rel_ref}


def _compensation(run: dict) -> str | None:
    """The ``compensation`` of a bf16-model run whose only option it is (the runs of the compensation table)."""
    opts = dict(map(tuple, run.get("options", ())))
    return opts["compensation"] if run["bf16"] and set(opts) == {"compensation"} else None


def _registry_order(name: str) -> int:
    from hf_efficient.registry import SPECS

    names = list(SPECS)
    return names.index(name) if name in names else len(names)


def _compensation_summary(doc: dict, by_label: dict) -> list[str]:
    """The bf16-model runs whose only option is ``compensation``: one row per name (and lr), one column per mode."""
    from hf_efficient.optim.compensation import COMPENSATIONS

    table: dict[str, dict[str, str]] = {}  # name (and lr) -> mode -> cell
    order: dict[str, str] = {}
    for r in doc["results"]:
        run, mode = r["run"], _compensation(r["run"])
        if mode is None:
            continue
        key = run["label"].replace(f" compensation={mode}", "").replace(" (ablation)", "")  # name and lr
        order[key] = run["name"]
        j = _judge(r, by_label, doc["baseline"])
        ref = "" if j["ref"] is None or j["ref"]["run"]["label"] == doc["baseline"] else \
            f", {_pct(j['rel_ref'])} vs {j['ref']['run']['label']}"
        table.setdefault(key, {})[mode] = (f"{r['final_loss']:.4f} ({_pct(j['rel'])} vs fp32 AdamW{ref}); "
                                           f"state {r['state_bytes'] / 2**20:.1f} MiB")
    if not table:
        return []
    rows = [[f"`{key}`", *(row.get(m, "not run") for m in COMPENSATIONS)]
            for key, row in sorted(table.items(), key=lambda kv: _registry_order(order[kv[0]]))]
    return ["\n## bf16 model: each name with each compensation mode\n",
            "Final eval loss on the bf16 model, against fp32 AdamW on the fp32 model (and the name's own fp32 "
            "reference where it has one); `none` is the ablation. Optimizer state includes the Kahan buffer "
            "(2 B/param) where there is one.\n",
            md_table(["name", *(m + (" (ablation)" if m == "none" else "") for m in COMPENSATIONS)], rows)]


def _lowest_memory(doc: dict, by_label: dict) -> list[str]:
    """The bf16-model runs with options besides ``compensation`` (8-bit embeddings, gradient release): quality
    against fp32 AdamW, live bytes per parameter against it, and the plain compensated run of the same name."""
    base = by_label.get(doc["baseline"])
    lines = []
    for r in doc["results"]:
        run = r["run"]
        if not run["bf16"] or len(run.get("options", ())) < 2:
            continue
        j, live, n = _judge(r, by_label, doc["baseline"]), r.get("live_peak"), r["num_params"]
        line = (f"- `{run['label']}` (bf16 model): final eval loss {r['final_loss']:.4f}, {_pct(j['rel'])} vs fp32 "
                f"AdamW; optimizer state {r['state_bytes'] / 2**20:.1f} MiB ({r['state_bytes'] / n:.2f} B/param)")
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
                         f"hook: {(2 if run['bf16'] else 4) * r['largest_param'] / n:.2f} B/param of the "
                         "gradients' share")
        mode = dict(map(tuple, run["options"])).get("compensation")
        plain = next((p for p in doc["results"] if p["run"]["name"] == run["name"] and _compensation(p["run"]) == mode
                      and p["run"].get("lr_scale", 1.0) == run.get("lr_scale", 1.0)), None)
        lines.append(line + f"; peak RSS {r['peak'][1] / 2**20:.0f} MiB"
                     + (f" vs {plain['peak'][1] / 2**20:.0f} MiB for `{plain['run']['label']}` (the same name and "
                        "compensation on the bf16 model without the other options)" if plain else ""))
    return ["\n## Lowest memory: bf16 weights, 8-bit state, stochastic rounding, gradient release\n", *lines] \
        if lines else []


def _other_seeds(doc: dict, by_label: dict) -> list[str]:
    """The seed-check sessions merged into the page: each run against its own seed's baseline and reference, beside
    the page's figure for the same run."""
    text, baseline = [], doc["baseline"]
    for s in doc.get("other_seeds", []):
        mine = {r["run"]["label"]: r for r in s["results"]}
        rows = []
        for r in s["results"]:
            j, page = _judge(r, mine, baseline), by_label.get(r["run"]["label"])
            pj = page and _judge(page, by_label, baseline)
            rows.append([r["run"]["label"], fmt(r["final_loss"], 4), _pct(j["rel"]),
                         "—" if j["ref"] is mine.get(baseline) else _pct(j["rel_ref"]),
                         "not on the page" if page is None else f"{_pct(pj['rel'])}" + (
                             "" if pj["ref"] is by_label.get(baseline) else f" ({_pct(pj['rel_ref'])} vs its ref)")])
        text += [f"\n## Seed check: seed {s['config']['seed']}\n",
                 f"The same task with `--seed {s['config']['seed']}` (another train/eval split of the paragraphs, other "
                 f"masks, data order and dropout), each run against that seed's own fp32 AdamW and reference. Command: "
                 f"`{s['command']}` ({s['wall_s'] / 60:.1f} min, {s['machine']['date']}).\n",
                 md_table(["run", "final eval loss", "vs fp32 AdamW (this seed)", "vs its fp32 reference (this seed)",
                           f"seed {doc['config']['seed']} (this page): vs fp32 AdamW"], rows)]
    return text


def _lr_summary(doc: dict, base: dict | None) -> list[str]:
    """Lines on each reference tried at several learning rates: its final loss at each, the best one (a reference
    that is a name's run, Muon's: that name's runs on fp32 weights without options)."""
    lines, lr = [], doc["config"]["lr"]
    for math, ref in doc["references"].items():
        own = lambda run: run.get("peer") is None and (run["name"] is None or (  # noqa: E731 (a peer is not ours)
            run["name"] == ref.get("name") and not run["options"] and not run["bf16"]))
        tried = sorted((r for r in doc["results"] if own(r["run"]) and r["run"].get("math") == math),
                       key=lambda r: -r["run"].get("lr_scale", 1.0))
        if len(tried) < 2:
            continue
        best = min(tried, key=lambda r: r["final_loss"])
        versus = "" if base is None else f" ({best['final_loss'] / base['final_loss']:.3f}x fp32 AdamW's)"
        lines.append(f"- {ref['label']}: final eval loss "
                     + ", ".join(f"{r['final_loss']:.4f} at lr {lr * r['run'].get('lr_scale', 1.0):.3g}" for r in tried)
                     + f"; best: lr {lr * best['run'].get('lr_scale', 1.0):.3g}{versus}")
    return ["\n## Learning rates tried\n", *lines] if lines else []


_MODE_STYLE = {"kahan": "-", "stochastic": "--", "none": ":"}


def convergence_png(doc: dict, path: Path) -> None:
    """Top: eval loss and accuracy over steps of the runs on fp32 weights. Bottom (when there are runs on the bf16
    model): their eval loss (a colour per name, a line style per compensation mode), and their final eval loss
    against fp32 AdamW's as bars."""
    from hf_efficient.optim.compensation import COMPENSATIONS

    plt = _pyplot()
    results, cfg, info = doc["results"], doc["config"], doc["machine"]
    base = next((r for r in results if r["run"]["label"] == doc["baseline"]), None)
    fp32 = [r for r in results if not r["run"]["bf16"]]
    modes = list(COMPENSATIONS)  # bf16 runs grouped by name, whichever session ran them first
    bf16 = sorted((r for r in results if r["run"]["bf16"]), key=lambda r: (
        _registry_order(r["run"]["name"]), len(r["run"]["options"]),
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
        _plot_bf16(plt, axes[1], bf16, base, doc)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.suptitle(f"MiniLM masked-LM fine-tuning on Python docs: {cfg['steps']} steps x batch {cfg['batch_size']}, "
                 f"lr {cfg['lr']} ({info['cpu']}, load {info['loadavg_1_5_15'][0]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


def _plot_bf16(plt, axes, bf16: list[dict], base: dict | None, doc: dict) -> None:
    ax3, ax4 = axes
    by_label = {r["run"]["label"]: r for r in doc["results"]}
    names = list(dict.fromkeys(r["run"]["label"].split(" ")[0] for r in bf16))
    colour = {n: plt.cm.tab10.colors[i % 10] for i, n in enumerate(names)}
    for r in bf16:
        name, mode = r["run"]["label"].split(" ")[0], dict(map(tuple, r["run"]["options"])).get("compensation")
        extra = len(r["run"]["options"]) > 1  # the lowest-memory run: its own marker
        _curve(ax3, r, "loss", color=colour[name], ls=_MODE_STYLE.get(mode, "-"), marker="*" if extra else None,
               lw=1.2)
    if base:
        _curve(ax3, base, "loss", color="k", ls="--", marker="x", zorder=3)
    _zoom(ax3, doc["results"])
    ax3.set(xlabel="step", ylabel="eval loss (masked tokens)", title="bf16 model")
    handles = [plt.Line2D([], [], color=colour[n], label=n) for n in names]
    handles += [plt.Line2D([], [], color="grey", ls=ls, label=f"compensation={m}") for m, ls in _MODE_STYLE.items()]
    handles += [plt.Line2D([], [], color="grey", marker="*", label="lowest memory (adam8bit, stochastic)")]
    handles += [plt.Line2D([], [], color="k", ls="--", marker="x", label=f"{doc['baseline']}, fp32 weights")] \
        if base else []
    ax3.legend(handles=handles, fontsize=7)
    if base is None:
        return
    labels = [r["run"]["label"] for r in bf16]
    judged = [_judge(r, by_label, doc["baseline"]) for r in bf16]
    rel = [100 * j["rel"] for j in judged]
    top = 6.0  # % : the ablation's bars run far off the scale of the others; their value is written on them
    y = range(len(bf16))
    bars = ax4.barh(list(y), [min(v, top) for v in rel], color=[colour[l.split(" ")[0]] for l in labels], alpha=0.8)
    for bar, label, v, j in zip(bars, labels, rel, judged):
        bar.set_hatch("" if "kahan" in label else "//" if "stochastic" in label else "..")
        note = f"{v:+.2f}%" + (f" ({_pct(j['rel_ref'])} vs its ref)" if j["ref"] is not base and j["ref"] else "")
        ax4.text(min(v, top) + 0.1 if v >= 0 else 0.1, bar.get_y() + bar.get_height() / 2, note, va="center",
                 fontsize=6)
    ax4.set_yticks(list(y), [label.split(":")[0].replace("hf_eff_", "").replace(" (ablation)", "")
                             for label in labels], fontsize=7)
    ax4.invert_yaxis()
    ax4.axvline(0, color="k", lw=0.8)
    ax4.set_xlim(right=top + 3)
    ax4.set(xlabel="final eval loss vs fp32 AdamW (fp32 weights), %", title="bf16 model: final eval loss")


# ------------------------------------------------------------------------------------------ entry points

# ------------------------------------------------------------------------------------------ fsdp2_memory

def fsdp2_memory_md(doc: dict) -> str:
    m = doc["model"]
    rows = [[r["name"], r["world_size"], f"{r['predicted']:,}", " / ".join(f"{b:,}" for b in r["measured"]),
             "yes" if r["predicted"] == max(r["measured"]) else "**no**"] for r in doc["memory"]]
    worlds = sorted({k for d in doc["resume_max_abs_diff"].values() for k in d}, key=lambda k: int(k.split(">")[1]))
    resumes = [[name, *(f"{d[k]:.3g}" for k in worlds)] for name, d in doc["resume_max_abs_diff"].items()]
    return "\n".join([
        "# Optimizer state per rank under FSDP2, and resumes across mesh sizes", "",
        f"Command: `{doc['command']}`", "", machine_md(doc["machine"]), "",
        f"Model: `LlamaForCausalLM` from a `LlamaConfig` (random init, untied): hidden {m['hidden_size']}, "
        f"{m['num_hidden_layers']} layers, MLP {m['intermediate_size']}, vocabulary {m['vocab_size']}: "
        f"{m['num_params']:,} parameters, fp32 (bf16 for hf_eff_adamw_bf16). Each rank a gloo process on this CPU, "
        "every decoder layer and then the model `fully_shard`-ed on a 1-D mesh of all ranks (1 rank: a 1-rank "
        f"mesh); every rank trains on the same batch of {doc['batch'][0]} x {doc['batch'][1]} tokens, lr "
        f"{doc['lr']}, weight decay {doc['weight_decay']}.", "",
        "## Optimizer state bytes per rank", "",
        "Measured: `optimizer_state_bytes(optimizer)` on each rank after one step (its local shards), rank 0 first. "
        "Predicted: `estimate_memory(model, name, world_size=N, sharding=\"fsdp2\")` of the unsharded model "
        "(the largest rank's bytes).", "",
        md_table(["name", "ranks", "predicted B", "measured B (rank 0 / 1 / ...)", "predicted = largest"], rows), "",
        "## Resharded resume", "",
        f"{doc['steps']} steps on 2 ranks, model and optimizer saved through DCP (`get_model_state_dict` / "
        f"`get_optimizer_state_dict`, `dcp.save`) after step {doc['save_at']}; each mesh below builds the model "
        "afresh, loads that checkpoint (DCP reshards it) and trains the remaining steps. Max |difference| of any "
        "weight from the uninterrupted 2-rank run (0: bit for bit):", "",
        md_table(["name", *worlds], resumes)]) + "\n"


def muon_pretrain_md(doc: dict) -> str:
    s, runs = doc["settings"], doc["runs"]
    headers = ["run", "final eval loss", "vs hf_eff_adamw", "vs hf_eff_muon", "optimizer state MiB", "state B/param",
               "s (train + evals)"]
    seeds = [f"## Seed {o['settings']['seed']}, lr {o['settings']['lr']}\n\nCommand: `{o['command']}` "
             f"({o['wall_s'] / 60:.1f} min, {o['machine']['date']}, load "
             f"{', '.join(map(str, o['machine']['loadavg_1_5_15']))}): the settings above but the seed (initialisation, "
             "paragraph shuffle, training windows) or the lr\n\n"
             + md_table(headers, _pretrain_rows(o["runs"])) for o in doc.get("other_sessions", [])]
    steps = [c["step"] for c in runs[0]["curve"]]
    curves = [[step, *(fmt(next(c["eval_loss"] for c in r["curve"] if c["step"] == step), 4) for r in runs)]
              for step in steps]
    return "\n".join([
        "# Muon pre-training check: a small Llama from random init", "",
        f"Command: `{doc['command']}` ({doc['wall_s'] / 60:.1f} min)", "",
        machine_md(doc["machine"], doc.get("loadavg_after")), "",
        f"- Model: `LlamaForCausalLM` (random init, untied head), hidden {s['hidden']}, {s['layers']} layers, "
        f"{runs[0]['num_params']:,} parameters, fp32; byte-level (vocabulary 256)",
        f"- Data: Python's documentation (`pydoc_data.topics`), paragraphs shuffled (seed {s['seed']}), "
        f"{doc['train_bytes']:,} training bytes, {doc['eval_bytes']:,} held out; batch {s['batch']} windows of "
        f"{s['seq']} bytes drawn at random; eval: mean loss over {s['eval_windows']} fixed held-out windows",
        f"- Schedule: {s['steps']} steps, lr {s['lr']} (linear warm-up over {s['warmup']} steps, cosine to 10%), "
        f"betas (0.9, 0.95), weight decay {s['weight_decay']} (hf_efficient decay groups), gradient norm clipped at "
        "1; every run the same init and data order; Muon's update scaled to AdamW's RMS (`match_rms_adamw`), one lr "
        "for both halves",
        "- A short CPU run, far from a converged model; other seeds and lrs in the sections below", "",
        md_table(headers, _pretrain_rows(runs)), "",
        "## Eval loss over the steps", "",
        md_table(["step", *(f"hf_eff_{r['optimizer']}" for r in runs)], curves), *_pretrain_lrs(doc),
        *_pretrain_seeds(doc), *("\n" + t for t in seeds)]) + "\n"


def _pretrain_seeds(doc: dict) -> list[str]:
    """hf_eff_muon8bit against hf_eff_muon at each lr run with several seeds (sessions with both names): each seed's
    difference, their mean and sample standard deviation. One seed's difference mixes the 8-bit momentum's cost with
    the spread that any change of rounding gives a short run."""
    sessions = [doc, *doc.get("other_sessions", [])]
    gaps = {}  # lr -> {seed: relative difference}
    for o in sessions:
        loss = {r["optimizer"]: r["final_eval_loss"] for r in o["runs"]}
        if "muon" in loss and "muon8bit" in loss:
            gaps.setdefault(o["settings"]["lr"], {})[o["settings"]["seed"]] = loss["muon8bit"] / loss["muon"] - 1
    rows = []
    for lr, by_seed in sorted(gaps.items()):
        if len(by_seed) < 2:
            continue
        values = [by_seed[k] for k in sorted(by_seed)]
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
        rows.append([f"{lr:g}", len(values), ", ".join(f"{k}: {_pct(by_seed[k])}" for k in sorted(by_seed)),
                     _pct(mean), f"{100 * std:.2f}%", _pct(max(values))])
    if not rows:
        return []
    return ["\n## hf_eff_muon8bit against hf_eff_muon over seeds\n",
            "Final eval loss of hf_eff_muon8bit relative to hf_eff_muon's in the same session (same seed, lr, init and "
            "data); the standard deviation is over the seeds.\n",
            md_table(["lr", "seeds", "each seed", "mean", "std", "worst"], rows)]


def _pretrain_lrs(doc: dict) -> list[str]:
    """Each name's final eval loss at each lr run with the page's seed (where more than one lr was)."""
    seed = doc["settings"]["seed"]
    sessions = [doc, *(o for o in doc.get("other_sessions", []) if o["settings"]["seed"] == seed)]
    lrs = sorted({o["settings"]["lr"] for o in sessions})
    if len(lrs) < 2:
        return []
    loss = {(r["optimizer"], o["settings"]["lr"]): r["final_eval_loss"] for o in sessions for r in o["runs"]}
    names = list(dict.fromkeys(r["optimizer"] for o in sessions for r in o["runs"]))
    return [f"\n## Learning rates tried (seed {seed})\n", "Final eval loss; one lr for both halves of a Muon name.\n",
            md_table(["run", *(f"lr {lr:g}" for lr in lrs)],
                     [[f"hf_eff_{n}", *(fmt(loss.get((n, lr)), 4) for lr in lrs)] for n in names])]


def _pretrain_rows(runs: list[dict]) -> list[list]:
    """Each run's final eval loss, against hf_eff_adamw's and (hf_eff_muon8bit) its fp32-state twin hf_eff_muon's."""
    base = next((r for r in runs if r["optimizer"] == "adamw"), None)
    muon = next((r for r in runs if r["optimizer"] == "muon"), None)

    def vs(r, ref):
        return "—" if ref is None or r is ref else _pct(r["final_eval_loss"] / ref["final_eval_loss"] - 1)

    return [[f"hf_eff_{r['optimizer']}", fmt(r["final_eval_loss"], 4), vs(r, base),
             vs(r, muon) if r["optimizer"] == "muon8bit" else "—", fmt(r["state_bytes"] / 2**20, 2),
             fmt(r["state_bytes"] / r["num_params"], 2), fmt(r["curve"][-1]["seconds"], 0)] for r in runs]


PAGES = {  # page -> (markdown, plot or None)
    "bench_step": (bench_step_md, bench_step_png),
    "bench_cuda": (bench_cuda_md, None),
    "bench_import": (bench_import_md, None),
    "bench_adamw8bit": (bench_adamw8bit_md, None),
    "memory_release": (memory_release_md, memory_release_png),
    "convergence": (convergence_md, convergence_png),
    "fsdp2_memory": (fsdp2_memory_md, None),
    "muon_pretrain": (muon_pretrain_md, None),
    "bench_muon": (bench_step_md, bench_step_png),
    "bench_ns": (bench_ns_md, None),  # bench_step.py --only Muon --page bench_muon: its rows alone
}


def render(path: Path) -> str:
    """Write the page of ``path`` (``<page>.json``) beside it, as ``<page>.md`` and its plot; returns the markdown."""
    path = Path(path)
    if path.stem not in PAGES:
        raise SystemExit(f"{path}: no page named {path.stem!r}; the pages: {', '.join(PAGES)} (<page>.json)")
    markdown, plot = PAGES[path.stem]
    doc = json.loads(path.read_text())
    text = markdown(doc)
    path.with_suffix(".md").write_text(text)
    if plot:
        plot(doc, path.with_suffix(".png"))
    return text


def write(out: Path, page: str, doc: dict) -> str:
    """Save a script's measurements as ``out/<page>.json`` (first: they are kept whatever rendering does), then
    render the page; returns its markdown."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{page}.json"
    path.write_text(json.dumps(doc, indent=1))
    return render(path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", type=Path, help="<page>.json files written by the scripts")
    for path in p.parse_args(argv).json:
        render(path)
        print(f"{path.with_suffix('.md')}: rewritten from {path}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hf_efficient from this checkout (the orders)
    main()
