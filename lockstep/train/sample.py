"""Greedy continuation with full-sequence forwards: a quick look at what a trained model says.

This recomputes the whole prefix per token (no KV cache); the generation engine is the fast path.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def greedy_continue(model: nn.Module, prompt_ids: list[int], max_new_tokens: int,
                    max_seq_len: int, stop_id: int | None = None) -> list[int]:
    """Token ids generated after ``prompt_ids`` by repeated argmax (context cut to max_seq_len)."""
    if not prompt_ids:
        raise ValueError("prompt_ids: the prompt must contain at least one token")
    was_training = model.training
    model.eval()
    ids = list(prompt_ids)
    device = next(model.parameters()).device
    generated: list[int] = []
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-max_seq_len:]], dtype=torch.long, device=device)
        logits = model(window)
        if hasattr(logits, "full_tensor"):  # vocabulary-sharded logits under tensor parallel
            logits = logits.full_tensor()
        next_id = int(logits[0, -1].argmax())
        if stop_id is not None and next_id == stop_id:
            break
        ids.append(next_id)
        generated.append(next_id)
    model.train(was_training)
    return generated
