"""Optimizer steps and end-to-end training on a CUDA GPU, every hf_eff name beside the optimizers a user would pick
instead, in one run; ratios to torch's fused fp32 AdamW measured in the same process.

    python scripts/bench_step.py --device cuda          # the same as: python scripts/bench_cuda.py
    python scripts/bench_cuda.py --layers 4 --e2e-layers 2   # smaller, for a quick look
    python scripts/bench_cuda.py --render-only           # markdown again from the JSON
    python scripts/bench_cuda.py --sweep --e2e-layers 0   # the 8-bit kernels' program shapes compared too

Writes ``bench_cuda.json`` (measurements) and ``bench_cuda.md`` (tables, machine, command; rendered from the JSON
by ``render_results.bench_cuda_md``) into ``--out`` (default ``docs/results``).

Step rows. The parameters of ``--layers`` Llama layers of 1B shapes (q, k, v, o 2048x2048; gate, up 5632x2048; down
2048x5632; two norms of 2048): 1.23B parameters at 24 layers, fp32 (and a bf16 copy for the bf16-weight rows), with
fixed random gradients set through a backward pass before every timed step (the guard's hooks run there, as in
training; their time is the "backward" column, over the baseline's). One optimizer is alive at a time: built, a few
warm-up steps (Triton compiles and probes there), ``--reps`` timed steps between CUDA events, median; the baseline is
timed first and last and its mean is the ratio's unit. Also per step: kernels launched and host synchronisations
(torch.profiler over one step; ``torch.cuda.set_sync_debug_mode`` warnings), memory allocated beyond the state
("temporaries": peak during the step minus before it), state bytes per parameter, and the bytes a step must move
(each parameter, gradient and state byte read once, each parameter and state byte written once) over the baseline's:
the ratio no kernel can beat at the memory-bandwidth limit.

End-to-end rows. A config-built Llama of ``--e2e-layers`` layers (16: 953M parameters, untied 32000-token
embeddings), batches of 4 x 1024 random tokens, gradient checkpointing; tokens per second over ``--e2e-steps``
steps after warm-up, and peak memory allocated.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import render_results  # noqa: E402
from _bench_common import RESULTS, command_line, machine, median  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import hf_efficient as hfe  # noqa: E402

LR, WD = 1e-4, 0.01
BASELINE = "torch AdamW fused (fp32)"


class Layer(nn.Module):
    """The parameters of one Llama layer of 1B shapes (``h`` 2048, ``f`` 5632); no forward."""

    def __init__(self, h: int, f: int):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))
        self.gate, self.up, self.down = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False), nn.Linear(
            f, h, bias=False)
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(h), nn.LayerNorm(h)


def make_model(layers: int, h: int, f: int, dtype: torch.dtype, device) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        model = nn.Sequential(*[Layer(h, f) for _ in range(layers)]).to(dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen, device=device) * 1e-3).to(dtype)
    model.fixed_grads = [p.grad for p in model.parameters()]
    return model


def set_grads(model: nn.Module) -> None:
    """The same gradients again, through a backward pass: every post-accumulate-grad hook runs, as in training."""
    params = list(model.parameters())
    for p in params:
        p.grad = None
    torch.autograd.backward(params, model.fixed_grads)


def _ours(name: str, **options):
    return lambda m: hfe.create_optimizer(m, name, lr=LR, weight_decay=WD, **options)


def _bnb(cls: str):
    def build(m):
        import bitsandbytes as bnb
        return getattr(bnb.optim, cls)(hfe.build_param_groups(m, weight_decay=WD), lr=LR)
    return build


def _transformers_adafactor(m):
    from transformers.optimization import Adafactor
    return Adafactor(hfe.build_param_groups(m, weight_decay=WD), lr=LR, scale_parameter=False, relative_step=False)


def candidates() -> list[tuple[str, torch.dtype, object]]:
    """(label, weight dtype, builder): the step rows."""
    f32, b16 = torch.float32, torch.bfloat16
    fused = lambda m: torch.optim.AdamW(hfe.build_param_groups(m, weight_decay=WD), lr=LR, fused=True)  # noqa: E731
    return [
        ("hf_eff_adamw (default check)", f32, _ours("adamw")),
        ("hf_eff_adamw nonfinite=ignore", f32, _ours("adamw", nonfinite="ignore")),
        ("hf_eff_adam8bit", f32, _ours("adam8bit")),
        ("hf_eff_adam8bit backend=bnb", f32, _ours("adam8bit", backend="bnb")),
        ("bitsandbytes AdamW8bit", f32, _bnb("AdamW8bit")),
        ("hf_eff_adam4bit", f32, _ours("adam4bit")),
        ("hf_eff_lion8bit", f32, _ours("lion8bit")),
        ("bitsandbytes Lion8bit", f32, _bnb("Lion8bit")),
        ("hf_eff_adafactor", f32, _ours("adafactor")),
        ("transformers Adafactor", f32, _transformers_adafactor),
        ("bf16: torch AdamW fused (stale weights)", b16, fused),
        ("bf16: hf_eff_adamw_bf16 (kahan)", b16, _ours("adamw_bf16")),
        ("bf16: hf_eff_adam8bit (default)", b16, _ours("adam8bit")),
        ("bf16: hf_eff_adam8bit compensation=kahan", b16, _ours("adam8bit", compensation="kahan")),
        ("bf16: hf_eff_adam4bit (default)", b16, _ours("adam4bit")),
        ("bf16: hf_eff_adamw (fp32 moments)", b16, _ours("adamw")),
        ("bf16: hf_eff_lion8bit", b16, _ours("lion8bit")),
        ("bf16: hf_eff_adafactor", b16, _ours("adafactor")),
        ("bf16: bitsandbytes AdamW8bit", b16, _bnb("AdamW8bit")),
    ]


def sweep_rows() -> list[tuple[str, torch.dtype, object, dict]]:
    """(label, weight dtype, builder, settings): the 8-bit steps again under each program shape (``--sweep``): blocks
    of 256 per program and warps per program, ``blockwise_triton``'s ``NB`` and ``NUM_WARPS``, chosen without a GPU;
    the rows say which is fastest on this one."""
    f32, b16 = torch.float32, torch.bfloat16
    return [(f"{label} NB={nb} warps={warps}", dtype, _ours(name), {"NB": nb, "NUM_WARPS": warps})
            for label, dtype, name in (("hf_eff_adam8bit", f32, "adam8bit"),
                                       ("bf16: hf_eff_adam8bit (default)", b16, "adam8bit"),
                                       ("hf_eff_lion8bit", f32, "lion8bit"))
            for nb in (4, 8, 16) for warps in (4, 8)]


@contextmanager
def program_shape(settings: dict):
    """``blockwise_triton``'s module settings for one row, put back afterwards."""
    from hf_efficient.optim import blockwise_triton as B

    saved = {k: getattr(B, k) for k in settings}
    for k, v in settings.items():
        setattr(B, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(B, k, v)


def state_bytes(opt) -> int:
    seen, total = set(), 0
    for st in opt.state.values():
        for t in (st.values() if isinstance(st, dict) else ()):
            if torch.is_tensor(t) and t.data_ptr() not in seen and t.device.type != "cpu":
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


class _Clock:
    """CUDA events on a GPU; the host clock after a synchronisation elsewhere (``--device cpu``: smoke tests)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.t = None

    def record(self):
        if self.cuda:
            self.event.record()
        else:
            self.t = time.perf_counter()

    def elapsed_time(self, later: "_Clock") -> float:
        return self.event.elapsed_time(later.event) if self.cuda else (later.t - self.t) * 1e3


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def time_steps(opt, model, reps: int, cuda: bool) -> tuple[list[float], list[float]]:
    """Milliseconds of ``reps`` steps, and of the backward passes that set their gradients."""
    steps, backs = [], []
    for _ in range(reps):
        b0, b1, s1 = (_Clock(cuda) for _ in range(3))
        sync(cuda)
        b0.record()
        set_grads(model)
        sync(cuda)
        b1.record()
        opt.step()
        s1.record()
        sync(cuda)
        backs.append(b0.elapsed_time(b1))
        steps.append(b1.elapsed_time(s1))
    return steps, backs


def launches_and_syncs(opt, model, cuda: bool) -> tuple[int | None, int | None, list[str]]:
    """CUDA kernels launched by one step, the host synchronisations it made (None, None on CPU), and where each was
    made (``file:line`` of the Python frame torch's warning names: what to fix)."""
    from torch.profiler import ProfilerActivity, profile

    if not cuda:
        return None, None, []
    set_grads(model)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA" and "Memcpy" not in e.name
                  and "Memset" not in e.name)
    set_grads(model)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    return kernels, len(syncs), sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})


def measure_step(label, dtype, build, models, args) -> dict:
    model, cuda = models[dtype], args.device == "cuda"
    row = {"label": label, "dtype": str(dtype).removeprefix("torch.")}
    try:
        sync(cuda)
        opt = build(model)
        for _ in range(args.warmup):
            set_grads(model)
            opt.step()
        row["temporaries_mb"] = None
        if cuda:
            torch.cuda.synchronize()
            set_grads(model)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            opt.step()
            torch.cuda.synchronize()
            row["temporaries_mb"] = max(0, torch.cuda.max_memory_allocated() - before) / 2**20
        steps, backs = time_steps(opt, model, args.reps, cuda)
        row.update(step_ms=median(steps), backward_ms=median(backs), steps_ms=steps)
        row["kernels"], row["syncs"], row["sync_sites"] = launches_and_syncs(opt, model, cuda)
        n = sum(p.numel() for p in model.parameters())
        row["state_bytes_per_param"] = state_bytes(opt) / n
        pb = dtype.itemsize
        row["min_bytes_per_param"] = 3 * pb + 2 * row["state_bytes_per_param"]  # p read+write, g read, state r+w
        info = getattr(opt, "hf_efficient", None)
        row["backend"] = info.resolution.backend if info is not None else None
        del opt
    except Exception as e:  # noqa: BLE001 - a row that cannot run says why; the others still run
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    if cuda:
        torch.cuda.empty_cache()
    return row


def e2e_rows(args) -> list[dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=args.e2e_layers,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    cases = [
        ("fp32 weights + bf16 autocast + torch fused AdamW", torch.float32, True,
         lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD, fused=True)),
        ("bf16 weights + torch fused AdamW (stale weights)", torch.bfloat16, False,
         lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD, fused=True)),
        ("bf16 weights + bitsandbytes AdamW8bit", torch.bfloat16, False, _bnb("AdamW8bit")),
        ("bf16 weights + hf_eff_adam8bit", torch.bfloat16, False, _ours("adam8bit")),
        ("bf16 weights + hf_eff_adam8bit, embedding_state=8bit, gradient_release", torch.bfloat16, False,
         _ours("adam8bit", embedding_state="8bit", gradient_release=True)),
        ("bf16 weights + hf_eff_adam4bit, embedding_state=4bit, gradient_release", torch.bfloat16, False,
         _ours("adam4bit", embedding_state="4bit", gradient_release=True)),
        ("bf16 weights + hf_eff_adamw_bf16", torch.bfloat16, False, _ours("adamw_bf16")),
        ("bf16 weights + hf_eff_adamw (fp32 moments)", torch.bfloat16, False, _ours("adamw")),
        ("fp32 weights + bf16 autocast + hf_eff_adam8bit", torch.float32, True, _ours("adam8bit")),
    ]
    gen = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (4, 1024), device="cuda", generator=gen) for _ in range(4)]
    rows = []
    for label, dtype, autocast, build in cases:
        row = {"label": label}
        try:
            torch.manual_seed(0)
            with torch.device("cuda"):
                model = LlamaForCausalLM(cfg).to(dtype)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
            torch.cuda.reset_peak_memory_stats()
            opt = build(model)

            def train_step(i):
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    loss = model(input_ids=batches[i % len(batches)], labels=batches[i % len(batches)]).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss

            for i in range(args.e2e_warmup):
                train_step(i)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(args.e2e_steps):
                loss = train_step(i)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            row.update(tokens_per_s=4 * 1024 * args.e2e_steps / dt, peak_gb=torch.cuda.max_memory_allocated() / 1e9,
                       loss=float(loss), params=sum(p.numel() for p in model.parameters()))
            del opt, model
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        torch.cuda.empty_cache()
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--e2e-layers", type=int, default=16, help="0: no end-to-end rows")
    p.add_argument("--e2e-steps", type=int, default=8)
    p.add_argument("--e2e-warmup", type=int, default=3)
    p.add_argument("--only", default="", help="comma-separated substrings: run only the step rows matching one")
    p.add_argument("--sweep", action="store_true", help="the 8-bit steps under each program shape too (~2 min)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--render-only", action="store_true")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of the script only")
    args = p.parse_args(argv)
    path = args.out / "bench_cuda.json"
    if args.render_only:
        result = json.loads(path.read_text())
    else:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("bench_cuda needs a CUDA GPU (the CPU benchmark is scripts/bench_step.py)")
        import importlib.metadata as md

        def version(pkg):
            try:
                return md.version(pkg)
            except md.PackageNotFoundError:
                return None

        result = {"command": command_line("bench_cuda.py", argv), "machine": machine(args.device),
                  "layers": args.layers,
                  "reps": args.reps, "triton": version("triton"), "bitsandbytes": version("bitsandbytes"),
                  "transformers": version("transformers")}
        models = {dt: make_model(args.layers, args.hidden, args.ffn, dt, args.device)
                  for dt in (torch.float32, torch.bfloat16)}
        result["params"] = sum(p.numel() for p in models[torch.float32].parameters())
        fused = lambda m: torch.optim.AdamW(hfe.build_param_groups(m, weight_decay=WD), lr=LR, fused=True)  # noqa
        first = measure_step(BASELINE, torch.float32, fused, models, args)
        print(first, flush=True)
        steps = [first]
        wanted = [s for s in args.only.split(",") if s]
        for label, dtype, build in candidates():
            if wanted and not any(w in label for w in wanted):
                continue
            steps.append(measure_step(label, dtype, build, models, args))
            print({k: v for k, v in steps[-1].items() if k != "steps_ms"}, flush=True)
        for label, dtype, build, settings in sweep_rows() if args.sweep else ():
            if wanted and not any(w in label for w in wanted):
                continue
            with program_shape(settings):
                steps.append({**measure_step(label, dtype, build, models, args), "settings": settings})
            print({k: v for k, v in steps[-1].items() if k != "steps_ms"}, flush=True)
        last = measure_step(BASELINE, torch.float32, fused, models, args)
        result.update(steps=steps, baseline_first_ms=first.get("step_ms"), baseline_last_ms=last.get("step_ms"))
        result["baseline_ms"] = (first["step_ms"] + last["step_ms"]) / 2
        del models
        if args.device == "cuda":
            torch.cuda.empty_cache()
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))  # the step rows kept, whatever happens to the end-to-end ones
        if args.e2e_layers and args.device == "cuda":
            result["e2e"] = e2e_rows(args)
            result["e2e_params"] = result["e2e"][0].get("params", 0)
            path.write_text(json.dumps(result, indent=1))
    print(render_results.render(path))
    return result


if __name__ == "__main__":
    main()
