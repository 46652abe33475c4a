"""The lowest-memory recipe: bf16 weights, 4-bit AdamW state (embeddings too), gradients released in backward.

    python examples/lowest_memory.py              # a small Llama-shaped model from a config, on CPU, a few steps

About 3.1 bytes per parameter of weights + gradients + optimizer state (2 + ~0.04 + ~1.06 on a Llama-shaped model:
docs/results/memory_release.md), so a 7B model's ~20 GiB fits a 24 GiB GPU before activations
(``hf-efficient estimate --params 7B --dtype bf16 --gradient-release``). In a Trainer, the same is
``optim="hf_eff_adam4bit", optim_args="embedding_state=4bit,gradient_release=true"`` on a bf16 model, with
``max_grad_norm=0`` (release cannot clip by the global norm). Nothing is downloaded: the model is built from a
config, and trains on random tokens (a memory demonstration, not a training run).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_efficient as hfe
from hf_efficient.memory import format_bytes


def main(steps: int = 3) -> dict:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16)  # bf16 weights: no fp32 master copy
    # stochastic rounding (adam4bit's default compensation) keeps small updates from being lost on bf16 weights
    opt = hfe.create_optimizer(model, "adam4bit", lr=1e-4, weight_decay=0.01, embedding_state="4bit",
                               gradient_release=True)
    n = sum(p.numel() for p in model.parameters())
    for step in range(steps):
        ids = torch.randint(0, config.vocab_size, (4, 64))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()  # each tensor is stepped here, as its gradient completes, and its gradient freed
        opt.step()  # closes the step (release stepped the tensors already)
        opt.zero_grad()
        print(f"step {step}: loss {loss.item():.3f}")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state = hfe.optimizer_state_bytes(opt)
    print(f"{n / 1e6:.1f}M parameters: weights {format_bytes(weights)} ({weights / n:.2f} B/param), optimizer state "
          f"{format_bytes(state)} ({state / n:.2f} B/param); gradients: only those in flight during backward")
    return {"params": n, "weights_bpp": weights / n, "state_bpp": state / n}


if __name__ == "__main__":
    main()
