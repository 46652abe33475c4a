"""Every name on a CUDA GPU against the same run on CPU, with no host synchronisation inside ``step()``.

    python scripts/gpu_check.py [--steps 5] [--out DIR]

For each name, weight dtype and compensation: a small model (matrices whose sizes are not multiples of 256, a norm,
an embedding) is copied to the GPU and to the CPU, both get the same gradients for ``--steps`` steps, and the weights
(and 8-bit codes) are compared: the GPU runs the Triton kernels, the CPU the C kernels or torch's, so this checks the
GPU path against an independent one. After the first step (compilation and probes), every ``step()`` runs under
``torch.cuda.set_sync_debug_mode("warn")`` and the synchronisations it made are counted. A non-finite gradient under
``nonfinite="skip"`` must leave weights and state untouched. Writes ``gpu_check.json`` and prints a table; exits 1
when a case fails.

Tolerances: weights within ``tol`` of the largest update the run made (``tol`` 1e-3 for fp32 state, 3e-2 for 8-bit
state, where one code of difference moves a moment by a step of the map; bf16/fp16 weights may differ by one unit in
the last place where a rounding boundary is crossed, counted separately).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common  # noqa: E402,F401  (the repository on sys.path)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import hf_efficient as hfe  # noqa: E402

CASES = [(name, dtype, comp) for name in ("adamw", "adam8bit", "adam4bit", "lion8bit", "adafactor")
         for dtype, comps in ((torch.float32, ("none",)), (torch.bfloat16, ("kahan", "stochastic", "none")),
                              (torch.float16, ("kahan",)))
         for comp in comps] + [("adamw_bf16", dt, c) for dt in (torch.bfloat16, torch.float16)
                               for c in ("kahan", "stochastic", "none")]


def model(dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(300, 40), nn.Linear(40, 520), nn.LayerNorm(520), nn.Linear(520, 300),
                         nn.Linear(300, 77, bias=False)).to(dtype)


def run_case(name, dtype, comp, steps) -> dict:
    row = {"name": name, "dtype": str(dtype).removeprefix("torch."), "compensation": comp}
    lr = 1e-3 if name != "lion8bit" else 1e-4
    cpu, gpu = model(dtype), model(dtype).cuda()
    opts = {d: hfe.create_optimizer(m, name, lr=lr, weight_decay=0.01, compensation=comp)
            for d, m in (("cpu", cpu), ("cuda", gpu))}
    gen = torch.Generator().manual_seed(1)
    syncs, biggest = 0, 0.0
    start = [p.detach().float().clone() for p in cpu.parameters()]
    for t in range(steps):
        grads = [torch.randn(p.shape, generator=gen).to(dtype) * 0.1 for p in cpu.parameters()]
        for m in (cpu, gpu):
            for p, g in zip(m.parameters(), grads):
                p.grad = g.to(p.device)
        opts["cpu"].step()
        if t == 0:
            opts["cuda"].step()
            torch.cuda.synchronize()
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                opts["cuda"].step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs += sum(1 for w in caught if "synchroniz" in str(w.message))
    torch.cuda.synchronize()
    worst, ulps = 0.0, 0
    for p0, pc, pg in zip(start, cpu.parameters(), gpu.parameters()):
        biggest = max(biggest, float((pc.detach().float() - p0).abs().max()))
        diff = (pc.detach().float() - pg.detach().float().cpu()).abs()
        worst = max(worst, float(diff.max()))
        if dtype != torch.float32:
            spacing = torch.finfo(dtype).eps * pc.detach().float().abs().clamp_min(torch.finfo(dtype).tiny)
            ulps += int((diff > 0).sum()) if diff.max() <= 2 * spacing.max() else 0
    sd_cpu, sd_gpu = opts["cpu"].state_dict()["state"], opts["cuda"].state_dict()["state"]
    eight = [(i, k) for i, st in sd_cpu.items() for k in st if torch.is_tensor(st[k]) and st[k].dtype == torch.uint8]
    same = sum(int((sd_cpu[i][k] == sd_gpu[i][k].cpu()).sum()) for i, k in eight)
    total = sum(sd_cpu[i][k].numel() for i, k in eight)
    tol = 3e-2 if total else 1e-3
    row.update(max_diff=worst, max_update=biggest, rel=worst / max(biggest, 1e-30), syncs=syncs,
               codes_equal=(same / total) if total else None, backend=opts["cuda"].hf_efficient.resolution.backend)
    row["ok"] = bool(row["rel"] <= tol and syncs == 0 and (total == 0 or same / total >= 0.99))
    if dtype != torch.float32 and row["rel"] > tol:  # low-precision weights: a rounding boundary crossed
        row["ok"] = row["syncs"] == 0 and worst <= 2 * torch.finfo(dtype).eps * max(
            float(p.detach().abs().max()) for p in cpu.parameters())
    return row


def skip_case(name) -> dict:
    dtype = torch.bfloat16 if name == "adamw_bf16" else torch.float32
    m = model(dtype).cuda()
    opt = hfe.create_optimizer(m, name, lr=1e-3, nonfinite="skip")
    for p in m.parameters():
        p.grad = torch.full_like(p, 0.1)
    opt.step()
    before = [p.detach().clone() for p in m.parameters()]
    state = {(i, k): v.clone() for i, st in enumerate(opt.state.values()) for k, v in st.items() if torch.is_tensor(v)}
    for p in m.parameters():
        p.grad = torch.full_like(p, 0.1)
    next(m.parameters()).grad[0, 0] = float("nan")
    opt.step()
    torch.cuda.synchronize()
    same_w = all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    after = {(i, k): v for i, st in enumerate(opt.state.values()) for k, v in st.items() if torch.is_tensor(v)}
    same_s = all(torch.equal(state[k], after[k]) for k in state if k in after)
    return {"name": name, "dtype": str(dtype).removeprefix("torch."), "compensation": "skip-check", "ok": same_w and same_s,
            "weights_unchanged": same_w, "state_unchanged": same_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--only", default="", help="comma-separated names: check only these (a short lease)")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or sorted({c[0] for c in CASES})
    rows = []
    for case in (c for c in CASES if c[0] in names):
        try:
            rows.append(run_case(*case, args.steps))
        except Exception as e:  # noqa: BLE001
            rows.append({"name": case[0], "dtype": str(case[1]), "compensation": case[2], "ok": False,
                         "error": f"{type(e).__name__}: {e}"[:400]})
        print(rows[-1], flush=True)
    for name in names:
        try:
            rows.append(skip_case(name))
        except Exception as e:  # noqa: BLE001
            rows.append({"name": name, "compensation": "skip-check", "ok": False, "error": f"{type(e).__name__}: {e}"})
        print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if not r["ok"]]
    print(f"gpu_check: {len(rows) - len(bad)} passed, {len(bad)} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
