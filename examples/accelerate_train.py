"""Fine-tune a pretrained masked LM with Accelerate; the optimizer is chosen in config, not in this code.

    HF_EFF_OPTIM=adam8bit HF_EFF_GRADIENT_ACCUMULATION_STEPS=4 accelerate launch examples/accelerate_train.py \
        --max_steps 10                                     # minutes on a 2-core CPU
    HF_EFF_CONFIG=optim.yaml ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 \
        examples/accelerate_train.py --max_steps 20        # 2 CPU processes, gloo
    python examples/accelerate_train.py --model bert-base-uncased     # any hub MLM, given a network

Default task (examples/data.py): all-MiniLM-L6-v2 (bundled, offline) learns masked-token prediction on the
prose of Python's documentation. Gradient accumulation counts target tokens over each whole window on all
processes, so the update equals the big batch's. With --output_dir, every rank writes a checksum of its final
parameters (params_rank{N}.json) and the run fails if the ranks disagree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    from data import MLMCollator, build_datasets, evaluate, load_model_and_tokenizer  # noqa: E402
except ModuleNotFoundError as exc:  # copied without its neighbour
    if exc.name != "data":
        raise
    raise SystemExit(f"{os.path.basename(__file__)} needs data.py (the shared task, examples/data.py in the "
                     "hf_efficient repository) in the same directory: copy it there") from None

from hf_efficient import optimizer_info  # noqa: E402
from hf_efficient.integrations.accelerate import (  # noqa: E402
    EfficientOptimPlugin, accumulation_windows, summed_token_loss)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="hub name or local directory (default: bundled all-MiniLM-L6-v2)")
    p.add_argument("--config", default=None, help="YAML file of EfficientOptimPlugin fields (or set HF_EFF_CONFIG)")
    p.add_argument("--max_steps", type=int, default=10, help="optimizer steps (the default is sized for a CPU, where "
                   "a step of 4 micro-batches took ~15 s on a busy 2-core machine; give hundreds on a GPU)")
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--per_device_eval_batch_size", type=int, default=32)
    p.add_argument("--max_length", type=int, default=128, help="tokens per paragraph, longer ones are truncated")
    p.add_argument("--eval_every", type=int, default=100, help="optimizer steps between evaluations (0: only at the end)")
    p.add_argument("--eval_samples", type=int, default=None, help="evaluate on the first N eval sequences (default: all)")
    p.add_argument("--max_grad_norm", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default=None, help="write metrics and per-rank parameter checksums here")
    p.add_argument("--expect_processes", type=int, default=None,
                   help="fail unless Accelerate runs this many processes (guards CI against a silent 1-process run)")
    return p.parse_args(argv)


def params_sha256(model: torch.nn.Module) -> str:
    """Checksum of every parameter's bytes, in name order: equal on two ranks only if the weights are identical."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("hf_efficient").setLevel(logging.INFO)
    from accelerate.utils import gather_object, set_seed

    plugin = EfficientOptimPlugin(config_file=args.config)
    accelerator = plugin.create_accelerator()
    if args.expect_processes and accelerator.num_processes != args.expect_processes:
        raise SystemExit(f"expected {args.expect_processes} processes, Accelerate runs {accelerator.num_processes} "
                         f"({accelerator.distributed_type.value}); on CPU launch with ACCELERATE_USE_CPU=true "
                         "accelerate launch --multi_gpu --num_processes N")
    set_seed(args.seed)

    model, tokenizer = load_model_and_tokenizer(args.model)
    train_set, eval_set = build_datasets(tokenizer, max_length=args.max_length, seed=args.seed)
    if args.eval_samples:
        eval_set = eval_set[:args.eval_samples]
    collate = MLMCollator(tokenizer)
    train_dl = DataLoader(train_set, batch_size=args.per_device_train_batch_size, shuffle=True, collate_fn=collate)
    eval_dl = DataLoader(eval_set, batch_size=args.per_device_eval_batch_size, collate_fn=collate)
    model, optimizer, train_dl, eval_dl, scheduler = plugin.prepare(
        accelerator, model, train_dl, eval_dl, num_training_steps=args.max_steps)

    res = optimizer_info(optimizer).resolution
    accelerator.print(f"optimizer: hf_eff_{res.name}, backend: {res.backend} ({res.reason})")
    accelerator.print(f"{len(train_set)} train / {len(eval_set)} eval sequences; {accelerator.num_processes} processes "
                      f"x {plugin.gradient_accumulation_steps} micro-batches of {args.per_device_train_batch_size}")

    def run_eval(step: int) -> dict:
        metrics = evaluate(model, eval_dl, gather=accelerator.gather_for_metrics)
        if accelerator.is_main_process:  # tqdm.write keeps the line apart from the progress bar
            tqdm.write(f"step {step}: eval loss {metrics['loss']:.4f}, masked-token accuracy "
                       f"{metrics['accuracy']:.4f} ({metrics['targets']} targets)")
        return metrics

    history = [{"step": 0, **run_eval(0)}]
    model.train()
    step = 0
    bar = tqdm(total=args.max_steps, disable=not accelerator.is_local_main_process, desc="train")
    while step < args.max_steps:
        for window in accumulation_windows(accelerator, train_dl):
            window_loss = torch.zeros((), device=accelerator.device)
            for batch in window:
                with accelerator.accumulate(model):
                    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                    loss_sum = summed_token_loss(logits, batch["labels"])
                    accelerator.backward(window.scale(loss_sum))
                    if accelerator.sync_gradients and args.max_grad_norm:
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                window_loss += loss_sum.detach()
            step += 1
            train_loss = accelerator.reduce(window_loss, reduction="sum").item() / max(window.num_items, 1)
            bar.update(1)
            bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
            if args.eval_every and step % args.eval_every == 0 and step < args.max_steps:
                history.append({"step": step, **run_eval(step)})
            if step >= args.max_steps:
                break
    bar.close()
    history.append({"step": step, **run_eval(step)})

    accelerator.wait_for_everyone()
    digest = params_sha256(accelerator.unwrap_model(model))
    digests = gather_object([digest])
    result = {"rank": accelerator.process_index, "num_processes": accelerator.num_processes, "steps": step,
              "optimizer": f"hf_eff_{res.name}", "backend": res.backend, "params_sha256": digest,
              "plugin": plugin.describe(), "eval": history}
    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, f"params_rank{accelerator.process_index}.json"), "w") as f:
            json.dump(result, f, indent=1)
    if len(set(digests)) != 1:
        raise SystemExit(f"ranks ended with different parameters: {digests}")
    accelerator.print(f"all {len(digests)} ranks end with identical parameters (sha256 {digest[:16]}...)")
    accelerator.end_training()
    return result


if __name__ == "__main__":
    main()
