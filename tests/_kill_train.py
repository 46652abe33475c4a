"""Child process of test_kill_resume.py: train a tiny BERT with Trainer; optionally die right after a save."""

import os
import signal
import sys

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, os.path.dirname(__file__))
from conftest import ClassificationSet, tiny_bert  # noqa: E402  (also imports hf_efficient)


class DieAfterSave(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)  # abrupt: no cleanup, no final save


def run(optim, optim_args, out, steps, kill_at=0, resume=False, dtype="float32"):
    model = tiny_bert().to(getattr(torch, dtype))
    args = TrainingArguments(out, optim=optim, optim_args=optim_args or None, max_steps=steps,
                             per_device_train_batch_size=8, learning_rate=3e-3, weight_decay=0.01, logging_steps=1,
                             save_strategy="steps", save_steps=3, report_to=[], use_cpu=True, disable_tqdm=True,
                             seed=0, data_seed=0)
    callbacks = [DieAfterSave(kill_at)] if kill_at else []
    trainer = Trainer(model=model, args=args, train_dataset=ClassificationSet(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume or None)
    return model


if __name__ == "__main__":
    optim, optim_args, out, steps, kill_at, resume, dtype = sys.argv[1:]
    model = run(optim, optim_args, out, int(steps), int(kill_at), resume == "1", dtype)
    torch.save({k: v for k, v in model.state_dict().items()}, os.path.join(out, "final.pt"))
