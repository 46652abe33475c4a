"""Worker of tests/test_deepspeed.py, run on 2 gloo ranks by ``accelerate launch --use_deepspeed``.

One process pair covers ZeRO stages 1, 2 and 3 and both entry points (the Accelerate plugin, the Trainer's
``deepspeed=``): a fresh tiny model and DeepSpeed engine per case. Each rank writes what it saw to
``rank{N}.json``: per case either the refusal message, or the losses on a fixed batch, a digest of the
(gathered) weights, the optimizer state's dtypes, and for the plugin whether ``save_state`` / ``load_state``
resumes exactly.

Usage: ``_deepspeed_worker.py OUT_DIR STAGES PLUGIN_CASES TRAINER_CASES`` (cases: ``name[:optim_args]``,
separated by ``;``; stages: ``1,2,3``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import os
import sys
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
WATCHDOG_S = 480
STEPS = 6  # optimizer steps per case; the plugin saves after STEPS // 2 and resumes from there


def ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage}}


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def gathered(model, stage: int):
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters())) if stage == 3 else contextlib.nullcontext()


def digest(model, stage: int) -> str:
    with gathered(model, stage):
        return hashlib.sha256(b"".join(p.detach().float().numpy().tobytes() for p in model.parameters())).hexdigest()


def state_dtypes(optimizer) -> dict:
    """What the wrapped optimizer holds state for (ZeRO's flat partitions: 1-D), and the state's dtypes."""
    inner = optimizer
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    # ZeRO 3 puts a partition into its group only for the duration of step(), so look at the state's keys
    p, state = next(iter(inner.state.items()))
    return {"param_dim": p.dim(), "state": {k: str(v.dtype) for k, v in state.items()
                                            if torch.is_tensor(v) and v.numel() > 1}}


def fixed_batch(rank: int) -> dict:
    from helpers import variable_batches

    return variable_batches(n_batches=2, per_batch=2, seed=3)[rank]


def plugin_case(stage: int, name: str, optim_args: str, out_dir: str) -> dict:
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    from hf_efficient.integrations.accelerate import EfficientOptimPlugin
    from helpers import logits_of, tiny_mlm

    reset_accelerate()
    plugin = EfficientOptimPlugin(optim=name, optim_args=optim_args or None, lr=1e-2,
                                  lr_scheduler_type="constant")
    try:
        accelerator = plugin.create_accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(stage)),
                                                kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    except ValueError as e:
        return {"refused": str(e), "at": "create_accelerator"}
    assert accelerator.distributed_type.value == "DEEPSPEED" and accelerator.num_processes == 2
    model, optimizer, scheduler = plugin.prepare(accelerator, tiny_mlm(0))
    batch = fixed_batch(accelerator.process_index)

    def step() -> float:
        loss = torch.nn.functional.cross_entropy(logits_of(model, batch).flatten(0, 1), batch["labels"].flatten(),
                                                 ignore_index=-100)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        return loss.item()

    losses = [step() for _ in range(STEPS // 2)]
    ckpt = os.path.join(out_dir, f"ckpt-{stage}-{name}-{optim_args}".replace("=", "-"))
    accelerator.save_state(ckpt)
    losses += [step() for _ in range(STEPS - STEPS // 2)]
    out = {"losses": losses, "sha256": digest(model, stage), "optimizer": type(optimizer.optimizer).__name__,
           **state_dtypes(optimizer)}
    accelerator.load_state(ckpt)
    resumed = [step() for _ in range(STEPS - STEPS // 2)]
    out["resume_exact"] = digest(model, stage) == out["sha256"] and resumed == losses[STEPS // 2:]
    accelerator.free_memory()
    return out


class _Tokens(torch.utils.data.Dataset):
    """Two fixed-length sequences per rank (so the distributed sampler gives each rank its own)."""

    def __init__(self):
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(1, 100, (4, 12), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(12, dtype=torch.long), "labels": self.ids[i]}


def trainer_case(stage: int, name: str, optim_args: str, out_dir: str) -> dict:
    from transformers import Trainer, TrainingArguments

    from helpers import tiny_mlm

    reset_accelerate()
    kwargs = dict(output_dir=os.path.join(out_dir, f"trainer-{stage}-{name}"), optim=f"hf_eff_{name}",
                  optim_args=optim_args or None, deepspeed=ds_config(stage) | {"gradient_accumulation_steps": "auto",
                                                                               "train_micro_batch_size_per_gpu":
                                                                                   "auto"},
                  per_device_train_batch_size=2, max_steps=STEPS, learning_rate=1e-2, lr_scheduler_type="constant",
                  ddp_backend="gloo", report_to=[], logging_steps=1, save_strategy="steps", save_steps=STEPS,
                  disable_tqdm=True, seed=0)
    try:  # TrainingArguments itself refuses what the table says no to (integrations/transformers.py)
        args = TrainingArguments(**kwargs)
    except ValueError as e:
        return {"refused": str(e), "at": "TrainingArguments"}
    trainer = Trainer(model=tiny_mlm(0), args=args, train_dataset=_Tokens())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    saved = os.path.join(args.output_dir, f"checkpoint-{STEPS}")
    out = {"losses": losses, "sha256": digest(trainer.model, stage),
           "optimizer": type(trainer.optimizer.optimizer).__name__, **state_dtypes(trainer.optimizer),
           "checkpoint": sorted(os.listdir(saved)) if os.path.isdir(saved) else None}
    trainer.accelerator.free_memory()
    return out


def main(out_dir: str, stages: str, plugin_cases: str, trainer_cases: str) -> None:
    rank = int(os.environ["RANK"])
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)  # a rank stuck in a collective: fail, with stacks
    result = {"plugin": {}, "trainer": {}}
    # the plugin's cases first: TrainingArguments re-creates Accelerate's process state its own way
    for entry, run, cases in (("plugin", plugin_case, plugin_cases), ("trainer", trainer_case, trainer_cases)):
        for stage in map(int, stages.split(",")):
            for case in filter(None, cases.split(";")):
                name, _, optim_args = case.partition(":")
                try:
                    result[entry][f"{stage}/{case}"] = run(stage, name, optim_args, out_dir)
                except Exception as e:  # a failure is a finding; the other rank fails alike (same code, same data)
                    result[entry][f"{stage}/{case}"] = {"error": f"{type(e).__name__}: {e}"[:2000],
                                                        "traceback": traceback.format_exc()[-3000:]}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
