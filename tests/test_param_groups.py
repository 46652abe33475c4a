"""Weight-decay groups on real architectures built from configs, and on a custom module."""

import logging

import pytest
import torch
from conftest import tiny_bert, tiny_gpt2, tiny_llama, tiny_t5
from torch import nn

from hf_efficient import build_param_groups, split_parameters
from hf_efficient.param_groups import is_norm_module


def _decay_rules_hold(model, split):
    """Check every trainable parameter against the rule, using module ownership (not names)."""
    owner = {}
    for _, m in model.named_modules():
        for attr, p in m.named_parameters(recurse=False):
            owner.setdefault(id(p), []).append((attr, m))
    no_decay = set(split.no_decay)
    for name, p in model.named_parameters():
        uses = owner[id(p)]
        if any(isinstance(m, nn.Embedding) for _, m in uses):
            continue
        expect_no = any(is_norm_module(m) for _, m in uses) or any(a == "bias" for a, _ in uses)
        assert (name in no_decay) == expect_no, name


@pytest.mark.parametrize("make", [tiny_bert, tiny_gpt2, tiny_llama, tiny_t5])
def test_architectures(make):
    model = make()
    split = split_parameters(model)
    _decay_rules_hold(model, split)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(split.decay + split.no_decay) == sorted(names)  # every param once, tied weights once
    assert split.embeddings and set(split.embeddings) <= set(split.decay)  # decayed by default
    assert split.reasons and set(split.reasons.values()) <= {"norm", "bias"}


def test_norm_classes_of_transformers_are_found():
    llama, t5 = tiny_llama(), tiny_t5()
    llama_norms = [n for n, m in llama.named_modules() if type(m).__name__ == "LlamaRMSNorm"]
    t5_norms = [n for n, m in t5.named_modules() if type(m).__name__ == "T5LayerNorm"]
    assert llama_norms and t5_norms
    for model, norms in ((llama, llama_norms), (t5, t5_norms)):
        split = split_parameters(model)
        for n in norms:
            assert split.reasons[f"{n}.weight"] == "norm"


def test_gpt2_tied_embedding_appears_once_and_counts_as_embedding():
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    split = split_parameters(model)
    groups = build_param_groups(model, weight_decay=0.1)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert "transformer.wte.weight" in split.embeddings
    # GPT-2 attention uses transformers' Conv1D, whose bias is still a bias
    assert split.reasons["transformer.h.0.attn.c_attn.bias"] == "bias"


class ScaleNorm(nn.Module):
    """A user's own norm layer, not derived from any torch norm class."""

    def __init__(self, dim):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.gain * x / x.norm(dim=-1, keepdim=True)


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 16)
        self.norm = ScaleNorm(16)
        self.bn = nn.BatchNorm1d(16)
        self.gn = nn.GroupNorm(4, 16)
        self.rms = nn.RMSNorm(16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(16, 3, bias=False)


def test_custom_module_with_own_norm_frozen_and_embeddings(caplog):
    model = Custom()
    with caplog.at_level(logging.INFO, logger="hf_efficient.param_groups"):
        groups = build_param_groups(model, weight_decay=0.05, decay_embeddings=False)
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert set(decay["param_names"]) == {"proj.weight", "head.weight"}
    assert set(no_decay["param_names"]) == {"emb.weight", "proj.bias", "norm.gain", "bn.weight", "bn.bias",
                                            "gn.weight", "gn.bias", "rms.weight"}
    assert not any(n.startswith("frozen") for g in groups for n in g["param_names"])
    # the log line gives tensor and parameter counts per group
    assert "decay: 2 tensors / 304 params" in caplog.text and "no decay: 8 tensors" in caplog.text


def test_decay_embeddings_flag():
    model = Custom()
    assert "emb.weight" in split_parameters(model, decay_embeddings=True).decay
    assert split_parameters(model, decay_embeddings=False).reasons["emb.weight"] == "embedding"


def test_all_frozen_is_refused():
    model = nn.Linear(3, 3).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_param_groups(model)
