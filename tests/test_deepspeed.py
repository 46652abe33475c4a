"""DeepSpeed ZeRO 1, 2 and 3 on CPU (two gloo processes): every name trains where the support table
(``integrations/distributed.py``, README "Several processes") says yes, and is refused with the table's
message, before a model is built, where it says no; through the Accelerate plugin and through the
Trainer's ``deepspeed=``. One ``accelerate launch`` runs every case (tests/_deepspeed_worker.py).
"""

from __future__ import annotations

import json
import os
import re

import pytest

from conftest import launch_two_processes
from hf_efficient.registry import SPECS, get_spec, resolve

pytest.importorskip("deepspeed")

HERE = os.path.dirname(os.path.abspath(__file__))
STAGES = (1, 2, 3)


def _plugin_cases() -> dict:
    """name[:optim_args] -> None when it trains, else a pattern of its refusal: from each family's ``deepspeed`` (why
    not) and ``deepspeed_options`` (what ZeRO needs) in the registry, for the name's CPU backend and each other backend
    it has there (forced: torchao only so, and it runs on flat partitions); a name that runs as another off CUDA
    (paged_adam8bit) is refused as that one."""
    cases = {}
    for spec in SPECS.values():
        if not spec.backends:
            continue
        runs_as = get_spec(spec.fallback[1]) if spec.fallback else spec
        label = re.escape(f"{runs_as.trainer_name} (backend={resolve(runs_as.name, 'cpu', log=False).backend})")
        fam = spec.facts
        if fam.deepspeed:
            cases[spec.name] = rf"{label} is not supported with DeepSpeed: {re.escape(fam.deepspeed[:40])}"
            continue
        needs = ",".join(f"{option}={value}" for option, (value, _) in fam.deepspeed_options.items())
        for option, (value, why) in fam.deepspeed_options.items():
            cases[spec.name] = rf"{label} with DeepSpeed {re.escape(why[:30])}.*{option}={value}"
        cases[f"{spec.name}:{needs}" if needs else spec.name] = None
        for backend, impl in spec.backends.items() if not spec.fallback else ():
            if impl.serves("cpu") and backend != resolve(spec.name, "cpu", log=False).backend:
                cases[f"{spec.name}:{needs + ',' if needs else ''}backend={backend}"] = None
    cases["auto"] = r"hf_eff_auto is not supported with DeepSpeed: .*Name the optimizer"
    return cases


PLUGIN_CASES = _plugin_cases()
TRAINER_CASES = {k: v for k, v in PLUGIN_CASES.items() if "torchao" not in k and "paged" not in k}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed")
    # DeepSpeed's CPU accelerator; Accelerate joins the processes with the gloo backend the worker names
    launch_two_processes("--use_deepspeed", os.path.join(HERE, "_deepspeed_worker.py"), str(out),
                         ",".join(map(str, STAGES)), ";".join(PLUGIN_CASES), ";".join(TRAINER_CASES),
                         env={"DS_ACCELERATOR": "cpu"})
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _cases(entry: str):
    cases = PLUGIN_CASES if entry == "plugin" else TRAINER_CASES
    return [(entry, stage, case, refusal) for stage in STAGES for case, refusal in cases.items()]


@pytest.mark.parametrize("entry, stage, case, refusal", _cases("plugin") + _cases("trainer"))
def test_trains_where_the_table_says_yes_and_is_refused_where_it_says_no(ranks, entry, stage, case, refusal):
    seen = [r[entry][f"{stage}/{case}"] for r in ranks]
    assert "error" not in seen[0], f"ZeRO {stage} {entry} {case}: {seen[0]['error']}\n{seen[0]['traceback']}"
    if refusal is not None:
        for s in seen:
            assert re.search(refusal, s.get("refused", "")), f"ZeRO {stage} {entry} {case}: expected a refusal, saw {s}"
            # before a model exists: the plugin in create_accelerator, the Trainer at its TrainingArguments
            assert s["at"] == ("create_accelerator" if entry == "plugin" else "TrainingArguments"), s
        return
    a, b = seen
    assert "refused" not in a, f"ZeRO {stage} {entry} {case}: refused, but the table says it trains: {a['refused']}"
    assert a["sha256"] == b["sha256"], f"ZeRO {stage} {entry} {case}: ranks ended with different weights"
    for r in seen:
        assert r["losses"][-1] < 0.8 * r["losses"][0], f"ZeRO {stage} {entry} {case}: loss did not fall: {r['losses']}"
        # what the optimizer holds is ZeRO's flat fp32 partition; the 8-bit names keep uint8 state on it
        assert r["param_dim"] == 1 and r["optimizer"].startswith("DeepSpeedZeroOptimizer"), r
        # 8-bit codes: uint8 (ours, bnb); torchao's own tensor subclass reports its dequantized dtype
        eight_bit = SPECS[case.partition(":")[0]].facts.quantized and "torchao" not in case
        assert ("torch.uint8" in r["state"].values()) == eight_bit, r["state"]
        if entry == "plugin":
            assert r["resume_exact"], f"ZeRO {stage} {case}: save_state / load_state did not resume exactly"
        else:
            assert r["checkpoint"] and "latest" in r["checkpoint"], f"ZeRO {stage} {case}: no DeepSpeed checkpoint"


def test_training_arguments_check_refuses_before_a_model_exists(tmp_path):
    """The Trainer path's check needs only TrainingArguments (and the DeepSpeed config, a dict or a JSON file)."""
    from unittest import mock

    from transformers import TrainingArguments

    from hf_efficient.integrations.distributed import check_training_arguments

    config = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}
    config_file = tmp_path / "ds.json"
    config_file.write_text(json.dumps(config))
    with mock.patch.dict(os.environ):  # TrainingArguments(deepspeed=...) exports ACCELERATE_USE_DEEPSPEED
        check_training_arguments(TrainingArguments(str(tmp_path), optim="hf_eff_adam8bit", deepspeed=config,
                                                   optim_args="embedding_state=8bit", report_to=[]))
        for optim, optim_args, deepspeed, message in [
                ("hf_eff_adafactor", None, config, "hf_eff_adafactor .* not supported with DeepSpeed: ZeRO flattens"),
                ("hf_eff_adam8bit", None, str(config_file), "cannot keep 32-bit state .*embedding_state=8bit"),
                ("hf_eff_auto", "budget_gb=1", config, "hf_eff_auto is not supported with DeepSpeed"),
                ("hf_eff_adamw", None, dict(config, optimizer={"type": "AdamW"}), "has an 'optimizer' section")]:
            try:
                args = TrainingArguments(str(tmp_path), optim=optim, optim_args=optim_args, deepspeed=deepspeed,
                                         report_to=[])
            except ValueError as e:  # once TrainingArguments runs the check itself
                assert re.search(message, str(e)), str(e)
                continue
            with pytest.raises(ValueError, match=message):
                check_training_arguments(args)
        # not our optimizer, or no DeepSpeed: not our business
        check_training_arguments(TrainingArguments(str(tmp_path), optim="adamw_torch",
                                                   deepspeed=dict(config, optimizer={"type": "AdamW"}), report_to=[]))
        check_training_arguments(TrainingArguments(str(tmp_path), optim="hf_eff_adafactor", report_to=[]))
