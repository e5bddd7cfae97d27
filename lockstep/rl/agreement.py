"""Trainer-generator agreement: how far the trainer's log-probabilities are from the generator's.

``logprob_diff(generated, scored)`` gives the three metrics every RL / scoring step records
(``logprob_diff/max``, ``logprob_diff/mean``, ``logprob_diff/frac_tokens_different``);
``measure_agreement(model)`` runs a small self-check (a few sequences sampled by the engine with
continuous batching, then scored alone and in one batch) that a run manifest records.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def logprob_diff(generated: Sequence[torch.Tensor], scored: Sequence[torch.Tensor]) -> dict[str, float]:
    """Absolute differences over every token of every sequence (exactly 0 when bitwise equal)."""
    if len(generated) != len(scored):
        raise ValueError(f"logprob_diff: {len(generated)} generated sequences but {len(scored)} scored")
    pairs = [(g.float().flatten(), s.detach().float().flatten()) for g, s in zip(generated, scored)]
    for i, (g, s) in enumerate(pairs):
        if g.shape != s.shape:
            raise ValueError(f"logprob_diff: sequence {i} has {g.numel()} generated and {s.numel()} scored tokens")
    if not pairs or sum(g.numel() for g, _ in pairs) == 0:
        return {"logprob_diff/max": 0.0, "logprob_diff/mean": 0.0, "logprob_diff/frac_tokens_different": 0.0}
    diff = torch.cat([(g - s.to(g.device)).abs() for g, s in pairs])
    return {"logprob_diff/max": diff.max().item(), "logprob_diff/mean": diff.mean().item(),
            "logprob_diff/frac_tokens_different": (diff != 0).float().mean().item()}


@torch.no_grad()
def measure_agreement(model: nn.Module, *, n_requests: int = 5, max_new_tokens: int = 8, seed: int = 0
                      ) -> dict[str, float]:
    """Sample ``n_requests`` continuations of random prompts (3 batch slots, so requests join and
    leave), then compare the engine's log-probabilities with ``score_logprobs`` of the finished
    sequences, scored in one batch and each alone. Returns the metrics of both comparisons."""
    from lockstep.generate import Engine, EngineConfig, Request, SamplingParams
    from lockstep.rl.scoring import score_logprobs

    was_training = model.training
    model.eval()
    try:
        g = torch.Generator().manual_seed(seed)
        vocab = model.config.vocab_size
        prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist()
                   for n in torch.randint(1, 24, (n_requests,), generator=g)]
        engine = Engine(model, None, EngineConfig(cache_memory_mb=16, max_batch_size=3))
        requests = [Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0,
                                                                   seed=seed + i, ignore_eos=True))
                    for i, p in enumerate(prompts)]
        results = engine.generate(requests)
        generated = [torch.tensor(r.logprobs) for r in results]
        sequences = [p + list(r.token_ids) for p, r in zip(prompts, results)]
        lengths = [len(p) for p in prompts]
        batched = score_logprobs(model, sequences, lengths)
        alone = [score_logprobs(model, [s], [n])[0] for s, n in zip(sequences, lengths)]
    finally:
        model.train(was_training)
    out = logprob_diff(generated, batched)
    out.update({k.replace("logprob_diff/", "batch_vs_alone/"): v for k, v in logprob_diff(alone, batched).items()})
    return out
