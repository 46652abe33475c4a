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


# ------------------------------------------------------------------------------------------- Muon's share


from hf_efficient.param_groups import build_muon_param_groups, split_muon  # noqa: E402


def _linear_weights_in_blocks(model, blocks: str) -> set[str]:
    """The expected Muon set, from names: 2-D weights of Linear / Conv1D modules under ``blocks`` (the layer list)."""
    out = set()
    for mod_name, m in model.named_modules():
        if mod_name.startswith(blocks) and type(m).__name__ in ("Linear", "Conv1D") and m.weight.ndim == 2:
            out.add(f"{mod_name}.weight")
    return out


@pytest.mark.parametrize("make,blocks,head", [
    (tiny_bert, "bert.encoder.layer.", None),  # classifier and pooler: outside the blocks
    (tiny_gpt2, "transformer.h.", None),  # head tied to wte: an embedding
    (tiny_llama, "model.layers.", "lm_head.weight"),  # untied head
    (tiny_t5, "", None),  # encoder.block.* and decoder.block.*; head tied to shared
])
def test_muon_takes_the_linear_weights_of_the_blocks(make, blocks, head):
    model = make()
    split = split_muon(model)
    expected = _linear_weights_in_blocks(model, blocks) if blocks else {
        n for n in _linear_weights_in_blocks(model, "") if ".block." in n}
    assert expected and set(split.muon) == expected
    names = [n for n, _ in model.named_parameters()]
    assert sorted(split.muon + split.adamw) == sorted(names)  # every parameter once
    for n in split.muon:
        assert split.params[n].ndim == 2
    out = model.get_output_embeddings()
    if out is not None:
        assert all(id(p) not in {id(q) for q in (split.params[n] for n in split.muon)} for p in out.parameters())
    if head:
        assert split.reasons[head] == "output head"
    emb = model.get_input_embeddings().weight
    assert split.reasons[next(n for n, p in split.params.items() if p is emb)] == "embedding"
    assert {"norm"} <= set(split.reasons.values())


def test_gpt2_conv1d_weights_are_muon_and_marked_transposed():
    model = tiny_gpt2()
    split = split_muon(model)
    assert "transformer.h.0.attn.c_attn.weight" in split.muon  # stored (64, 192): (in, out)
    assert set(split.transposed) == set(split.muon)  # every GPT-2 block matrix is a Conv1D
    assert split.reasons["transformer.h.0.attn.c_attn.bias"] == "bias"


def test_bert_heads_outside_blocks_go_to_adamw():
    split = split_muon(tiny_bert())
    assert split.reasons["classifier.weight"] == "not a linear layer in a block"
    assert split.reasons["bert.pooler.dense.weight"] == "not a linear layer in a block"


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def test_plain_sequential_without_blocks_gives_muon_nothing_and_warns(caplog):
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with caplog.at_level(logging.INFO, logger="hf_efficient.param_groups"):
        groups = build_muon_param_groups(mlp, weight_decay=0.1)
    assert not any(g["muon"] for g in groups)
    assert "Muon: 0 matrices" in caplog.text and "muon_include" in caplog.text
    assert any(r.levelno == logging.WARNING for r in caplog.records)
    # named, the hidden layer is Muon's
    assert split_muon(mlp, muon_include="2.weight").muon == ["2.weight"]
    # a Sequential of blocks: the blocks' linears are Muon's, the input and output layers are not
    model = nn.Sequential(nn.Embedding(20, 8), _Block(8), _Block(8), nn.Linear(8, 20))
    split = split_muon(model)
    assert split.muon == ["1.up.weight", "1.down.weight", "2.up.weight", "2.down.weight"]
    assert split.reasons["3.weight"] == "not a linear layer in a block"


def test_groups_compose_with_decay_groups_and_log_the_split(caplog):
    model = tiny_llama()
    with caplog.at_level(logging.INFO, logger="hf_efficient.param_groups"):
        groups = build_muon_param_groups(model, weight_decay=0.1, decay_embeddings=False)
    assert [(g["muon"], g["weight_decay"]) for g in groups] == [(True, 0.1), (False, 0.1), (False, 0.0)]
    decay = build_param_groups(model, weight_decay=0.1, decay_embeddings=False)
    by_wd = {wd: set() for wd in (0.1, 0.0)}
    for g in groups:
        by_wd[g["weight_decay"]] |= set(g["param_names"])
    assert by_wd == {g["weight_decay"]: set(g["param_names"]) for g in decay}  # the same decay, cut in two
    assert {n for g in groups if g["muon"] for n in g["param_names"]} == set(split_muon(model).muon)
    line = next(r.getMessage() for r in caplog.records if "Muon split" in r.getMessage())
    assert "Muon: 14 matrices / 81,920 params (0.3 MiB)" in line and "output head 1" in line and "embedding 1" in line


def test_include_and_exclude_patterns():
    model = tiny_llama()
    split = split_muon(model, muon_exclude="*.self_attn.q_proj.weight|*.mlp.*", muon_include=["lm_head.weight"])
    assert "lm_head.weight" in split.muon  # the user's choice wins over the rule
    assert not any(".mlp." in n or "q_proj" in n for n in split.muon)
    assert split.reasons["model.layers.0.mlp.up_proj.weight"] == "muon_exclude"
    # exclusion wins over inclusion; inclusion takes only matrices
    split = split_muon(model, muon_include="model.layers.0.*", muon_exclude="*.k_proj.weight")
    assert "model.layers.0.self_attn.k_proj.weight" not in split.muon
    assert split.reasons["model.layers.0.input_layernorm.weight"] == "norm"
    with pytest.raises(ValueError, match=r"muon_include: pattern 'layers\.\*' matches no 2-D"):
        split_muon(model, muon_include="layers.*")  # names start with model.
    with pytest.raises(ValueError, match="muon_exclude: pattern 'nope' matches no trainable"):
        split_muon(model, muon_exclude="nope")
    with pytest.raises(ValueError, match="empty pattern"):
        split_muon(model, muon_exclude="*.mlp.*|")
