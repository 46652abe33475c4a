"""The hf_eff_* names inside transformers: TrainingArguments, the CLI parser, Trainer.train, resume."""

import json
import logging
import re

import pytest
import torch
from cases import fp32_model, names
from conftest import ClassificationSet, tiny_bert
from transformers import HfArgumentParser, Trainer, TrainingArguments

import hf_efficient as hfe

# paged_adam8bit runs as adam8bit off CUDA (tested in test_registry); adamw_bf16 has its own Trainer test
NAMES = ["hf_eff_adamw", "hf_eff_adam8bit", "hf_eff_paged_adam8bit", "hf_eff_adafactor"]


def _args(tmp_path, optim, steps=20, **kw):
    kw = {"learning_rate": 3e-3, "save_strategy": "no", "weight_decay": 0.01, **kw}
    return TrainingArguments(
        str(tmp_path), optim=optim, max_steps=steps, per_device_train_batch_size=8, logging_steps=1,
        report_to=[], use_cpu=True, disable_tqdm=True, seed=0, data_seed=0, **kw)


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.filterwarnings("ignore:hf_eff_paged_adam8bit")
@pytest.mark.parametrize("optim", NAMES)
def test_each_name_trains_and_loss_falls(tmp_path, optim):
    trainer = Trainer(model=tiny_bert(), args=_args(tmp_path, optim, steps=16), train_dataset=ClassificationSet())
    trainer.train()
    losses = _losses(trainer)
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4, losses
    info = hfe.optimizer_info(trainer.optimizer)
    assert info.resolution.name in optim
    # our decay groups replaced the Trainer's: embeddings decayed, norms and biases not
    wd = {n: g["weight_decay"] for g in trainer.optimizer.param_groups for n in g["param_names"]}
    assert wd["bert.embeddings.word_embeddings.weight"] == 0.01
    assert wd["bert.embeddings.LayerNorm.weight"] == 0.0 and wd["classifier.bias"] == 0.0


def test_8bit_states_in_trainer(tmp_path):
    model = tiny_bert()
    trainer = Trainer(model=model, args=_args(tmp_path, "hf_eff_adam8bit", steps=2), train_dataset=ClassificationSet())
    trainer.train()
    state = trainer.optimizer.state
    assert hfe.optimizer_info(trainer.optimizer).resolution.backend == "torch"  # the CPU default
    big = model.bert.encoder.layer[0].intermediate.dense.weight  # 128 x 64 = 8192 elements
    assert state[big]["exp_avg"].dtype == torch.uint8 and state[big]["exp_avg_sq"].dtype == torch.uint8
    emb = model.bert.embeddings.word_embeddings.weight  # 256 x 64: large, but an embedding
    assert state[emb]["exp_avg"].dtype == torch.float32
    small = model.bert.encoder.layer[0].attention.self.query.bias
    assert state[small]["exp_avg"].dtype == torch.float32


def test_optim_args_reach_the_optimizer(tmp_path):
    args = _args(tmp_path, "hf_eff_adam8bit", steps=1, optim_args="embedding_state=8bit, decay_embeddings=false")
    model = tiny_bert()
    trainer = Trainer(model=model, args=args, train_dataset=ClassificationSet())
    trainer.train()
    emb = model.bert.embeddings.word_embeddings.weight
    assert trainer.optimizer.state[emb]["exp_avg"].dtype == torch.uint8
    wd = {n: g["weight_decay"] for g in trainer.optimizer.param_groups for n in g["param_names"]}
    assert wd["bert.embeddings.word_embeddings.weight"] == 0.0


def test_bad_optim_args_fail_when_the_arguments_are_made(tmp_path):
    # before any model or data is loaded: in TrainingArguments, set_optimizer and the CLI parser alike
    with pytest.raises(ValueError, match=r"optim_args='bta1=0.9'.*unknown option 'bta1' for 'adam8bit'"):
        _args(tmp_path, "hf_eff_adam8bit", optim_args="bta1=0.9")
    with pytest.raises(ValueError, match=r"unknown option 'embeding_state'.*Did you mean 'embedding_state'"):
        _args(tmp_path, "hf_eff_adam8bit", optim_args="embeding_state=8bit")
    with pytest.raises(ValueError, match=r"option 'min_8bit_size' must be > 0"):
        _args(tmp_path, "hf_eff_adam8bit", optim_args="min_8bit_size=0")
    with pytest.raises(ValueError, match=r"unknown option 'budget'.*Did you mean 'budget_gb'"):
        _args(tmp_path, "hf_eff_auto", optim_args="budget=2")
    args = _args(tmp_path, "adamw_torch")
    with pytest.raises(ValueError, match=r"'nonfinite' must be one of"):
        args.set_optimizer(name="hf_eff_adafactor", args="nonfinite=maybe")
    assert args.optim == "adamw_torch" and args.optim_args is None  # nothing changed by the refused call
    parser = HfArgumentParser((TrainingArguments,))
    with pytest.raises(ValueError, match=r"unknown option 'bta1'"):
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--optim", "hf_eff_adam8bit",
                                            "--optim_args", "bta1=0.9", "--report_to", "none"])
    # transformers' own names keep their own optim_args (not ours to parse)
    assert _args(tmp_path, "adamw_torch", optim_args="anything=1").optim_args == "anything=1"


def test_hf_eff_adamw_equals_torch_adamw_with_the_same_groups(tmp_path):
    def run(optim, optimizers=(None, None), model=None):
        model = model or tiny_bert()
        trainer = Trainer(model=model, args=_args(tmp_path, optim, steps=10), train_dataset=ClassificationSet(),
                          optimizers=optimizers)
        trainer.train()
        return model

    ours = run("hf_eff_adamw")
    ref_model = tiny_bert()
    ref_opt = torch.optim.AdamW(hfe.build_param_groups(ref_model, weight_decay=0.01), lr=3e-3, fused=True)
    ref = run("adamw_torch", optimizers=(ref_opt, None), model=ref_model)
    # bit for bit: the same groups and the same fused kernel (a foreach reference differs by rounding only,
    # except on attention key biases whose true gradient is 0 and Adam normalises the rounding noise)
    for (n, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), n


def test_transformers_own_names_still_work(tmp_path):
    trainer = Trainer(model=tiny_bert(), args=_args(tmp_path, "adamw_torch", steps=2), train_dataset=ClassificationSet())
    trainer.train()
    assert type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer) \
        is torch.optim.AdamW


def test_training_arguments_surface(tmp_path):
    args = TrainingArguments(str(tmp_path), optim="hf_eff_adafactor", report_to=[])
    assert args.optim == "hf_eff_adafactor"
    assert args.to_dict()["optim"] == "hf_eff_adafactor"
    assert json.loads(args.to_json_string())["optim"] == "hf_eff_adafactor"
    args.set_optimizer(name="hf_eff_adam8bit", learning_rate=1e-4)
    assert args.optim == "hf_eff_adam8bit" and args.learning_rate == 1e-4
    import pickle

    assert pickle.loads(pickle.dumps(args)).optim == "hf_eff_adam8bit"


def test_cli_parser_path(tmp_path):
    parser = HfArgumentParser((TrainingArguments,))
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--optim", "hf_eff_adam8bit", "--optim_args", "embedding_state=8bit",
         "--report_to", "none"])
    assert args.optim == "hf_eff_adam8bit" and args.optim_args == "embedding_state=8bit"
    with pytest.raises(SystemExit):  # argparse refuses an unknown choice
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--optim", "hf_eff_nope"])


def test_unknown_hf_eff_name_lists_registered_names(tmp_path):
    with pytest.raises(ValueError, match=r"Did you mean 'hf_eff_adam8bit'.*Registered names: hf_eff_adafactor"):
        TrainingArguments(str(tmp_path), optim="hf_eff_adam8bt")


def test_short_name_in_training_arguments_names_the_full_one(tmp_path):
    # short names work in create_optimizer & co., not here: say which name TrainingArguments takes
    with pytest.raises(ValueError, match=r"optim='adam8bit' is not a transformers optimizer name; "
                                         r"hf_efficient's is 'hf_eff_adam8bit'"):
        TrainingArguments(str(tmp_path), optim="adam8bit", report_to=[])
    with pytest.raises(ValueError, match=r"TrainingArguments\(optim=\.\.\.\) needs the full hf_eff_ name"):
        TrainingArguments(str(tmp_path), optim="hf_eff_adam8bt", report_to=[])


def _optimizer_lines(trainer, caplog, level="INFO") -> list[tuple[str, str]]:
    """(level name, message) of what the Trainer's logger says while it builds the optimizer; level WARNING: what
    a user sees at transformers' default verbosity."""
    trainer_logger = logging.getLogger("transformers.trainer")  # transformers' loggers do not propagate
    trainer_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(level, logger="transformers.trainer"):
            trainer.create_optimizer()
    finally:
        trainer_logger.removeHandler(caplog.handler)
    records = {id(r): r for r in caplog.records}.values()  # once each: transformers 5's loggers also propagate
    return [(r.levelname, r.getMessage()) for r in records
            if r.name == "transformers.trainer" and r.getMessage().startswith("hf_efficient:")]


def test_trainer_logs_the_backend_choice(tmp_path, caplog):
    args = _args(tmp_path, "hf_eff_adamw", steps=1)
    lines = _optimizer_lines(Trainer(model=tiny_bert(), args=args, train_dataset=ClassificationSet()), caplog)
    assert lines == [("INFO", "hf_efficient: optim=hf_eff_adamw runs on backend torch on cpu (first of torch usable "
                              f"on cpu (torch {torch.__version__}))")], lines


def test_auto_says_what_it_chose_and_why_at_the_default_verbosity(tmp_path, caplog):
    """hf_eff_auto's choice depends on the free memory: one WARNING line (shown at transformers' default verbosity)
    names it and says why; at INFO it was invisible unless the user raised the Trainer's verbosity."""
    args = _args(tmp_path, "hf_eff_auto", steps=1, optim_args="budget_gb=1000")
    lines = _optimizer_lines(Trainer(model=tiny_bert(), args=args, train_dataset=ClassificationSet()), caplog,
                             level="WARNING")
    assert len(lines) == 1 and lines[0][0] == "WARNING", lines
    assert lines[0][1].startswith("hf_efficient: optim=hf_eff_auto chose hf_eff_adamw, which runs on backend torch "
                                  "on cpu"), lines
    assert ". Why: the first that fits: usable 800.00 GiB = 80% of 1000.00 GiB (budget_gb=1000.0); hf_eff_adamw " \
           "needs" in lines[0][1], lines


@pytest.mark.parametrize("optim, optim_args, hint", [("hf_eff_adam8bit", None, True),
                                                     ("hf_eff_adam8bit", "embedding_state=32bit", False),
                                                     ("hf_eff_adam8bit", "embedding_state=8bit", False),
                                                     ("hf_eff_adamw", None, False)])
def test_the_embedding_state_hint_comes_once_from_the_optimizer_build(tmp_path, caplog, optim, optim_args, hint):
    """Where 32-bit embedding state (the default, not chosen) keeps the saving small (a large vocabulary), the
    Trainer's line at building says, at WARNING, what embedding_state=8bit would save: under any script (run_clm.py
    showed nothing: the line was at INFO on hf_efficient's logger, which only the examples turned on), once."""
    from hf_efficient.estimate import estimate_memory
    from hf_efficient.memory import MB

    model = tiny_bert(vocab=4096)  # embeddings hold most parameters, as in MiniLM or GPT-2
    trainer = Trainer(model=model, args=_args(tmp_path, optim, steps=1, optim_args=optim_args),
                      train_dataset=ClassificationSet(n=8, vocab=4096))
    lines = _optimizer_lines(trainer, caplog)
    assert len(lines) == 1, lines
    level, line = lines[0]
    assert (level == "WARNING") == hint and ('optim_args="embedding_state=8bit" would save about' in line) == hint, line
    if hint:
        now, all8 = estimate_memory(model, "adam8bit"), estimate_memory(model, "adam8bit", embedding_state="8bit")
        more = re.search(r"would save about ([0-9.]+) MiB more \((\d+)% of fp32 AdamW's state in all, instead of "
                         r"(\d+)%\)", line)
        assert float(more[1]) == pytest.approx((now.state_bytes - all8.state_bytes) / MB, abs=0.06), line
        assert (int(more[2]), int(more[3])) == (round(100 * all8.saving), round(100 * now.saving)), line


# --- resume: N steps, save, fresh Trainer resumes to 2N == uninterrupted 2N --------------------------

RESUME = {  # name -> (atol, why)
    "hf_eff_adamw": (0.0, "fp32 on CPU is deterministic: exact"),
    "hf_eff_adam8bit": (0.0, "the CPU 8-bit kernel is deterministic and the uint8 state round-trips: exact"),
    "hf_eff_adafactor": (0.0, "fp32 row/column statistics round-trip: exact"),
}


@pytest.mark.parametrize("optim", sorted(RESUME))
def test_resume_equals_uninterrupted(tmp_path, optim):
    n = 6
    data = ClassificationSet()
    full_model = tiny_bert()
    Trainer(model=full_model, args=_args(tmp_path / "full", optim, steps=2 * n), train_dataset=data).train()

    first = Trainer(model=tiny_bert(), args=_args(tmp_path / "run", optim, steps=2 * n, save_strategy="steps",
                                                  save_steps=n), train_dataset=data)
    first.train()  # runs to 2n but we resume from the checkpoint at n below, in a fresh Trainer and model
    resumed_model = tiny_bert()
    second = Trainer(model=resumed_model, args=_args(tmp_path / "run", optim, steps=2 * n), train_dataset=data)
    second.train(resume_from_checkpoint=str(tmp_path / "run" / f"checkpoint-{n}"))
    atol, _why = RESUME[optim]
    for (name, a), (_, b) in zip(full_model.named_parameters(), resumed_model.named_parameters()):
        torch.testing.assert_close(b, a, atol=atol, rtol=0.0, msg=name)
    # and the checkpoint's optimizer state loads with weights_only=True
    torch.load(tmp_path / "run" / f"checkpoint-{n}" / "optimizer.pt", weights_only=True)


def test_adamw_bf16_trains_a_bf16_model_with_warmup_and_no_autocast(tmp_path):
    model = tiny_bert().to(torch.bfloat16)
    args = _args(tmp_path, "hf_eff_adamw_bf16", steps=16, warmup_steps=4, lr_scheduler_type="linear")
    assert not args.bf16 and not args.fp16  # no autocast, no grad scaler: the weights themselves are bf16
    trainer = Trainer(model=model, args=args, train_dataset=ClassificationSet())
    trainer.train()
    losses = _losses(trainer)
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4, losses
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert lrs[0] < lrs[3] and lrs[-1] < lrs[4]  # warm-up, then decay: the scheduler drives the optimizer
    p = model.bert.encoder.layer[0].intermediate.dense.weight
    state = trainer.optimizer.state[p]
    assert p.dtype == torch.bfloat16
    assert {k: v.dtype for k, v in state.items() if k != "step"} == {
        "exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16, "kahan_comp": torch.bfloat16}


# every name made for fp32 models (hf_eff_adamw_bf16, made for bf16 ones, has its test above); the example family's
# too: registered after transformers was patched, as a user's own family is, TrainingArguments still takes its name
@pytest.mark.parametrize("optim", [pytest.param(hfe.registry.PREFIX + p.values[0], marks=p.marks, id=p.id)
                                   for p in names(fp32_model)])
def test_every_name_trains_a_bf16_model_compensated_and_resumes_exactly(tmp_path, optim):
    """A bf16 model (no autocast): each name's default compensation holds what rounding to bf16 drops (its Kahan
    buffer, or stochastic rounding), the loss falls, and a resume from a checkpoint equals the uninterrupted run
    bit for bit (buffer and noise stream included)."""
    n, data = 4, ClassificationSet()
    spec = hfe.registry.get_spec(optim)
    bf16 = lambda: tiny_bert().to(torch.bfloat16)  # noqa: E731
    lr = 1e-3 if "lion" in optim else 3e-3
    full_model = bf16()
    trainer = Trainer(model=full_model, args=_args(tmp_path / "full", optim, steps=2 * n, learning_rate=lr),
                      train_dataset=data)
    trainer.train()
    losses = _losses(trainer)
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2, losses
    p = full_model.bert.encoder.layer[0].intermediate.dense.weight
    assert hfe.optimizer_info(trainer.optimizer).options["compensation"] == spec.facts.compensation
    if spec.facts.compensation == "kahan":
        assert trainer.optimizer.state[p]["kahan_comp"].dtype == torch.bfloat16
    first = Trainer(model=bf16(), args=_args(tmp_path / "run", optim, steps=2 * n, learning_rate=lr,
                                             save_strategy="steps", save_steps=n), train_dataset=data)
    first.train()
    resumed = bf16()
    Trainer(model=resumed, args=_args(tmp_path / "run", optim, steps=2 * n, learning_rate=lr),
            train_dataset=data).train(resume_from_checkpoint=str(tmp_path / "run" / f"checkpoint-{n}"))
    for (name, a), (_, b) in zip(full_model.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), name
