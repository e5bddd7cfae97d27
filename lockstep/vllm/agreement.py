"""How far vLLM's log-probabilities are from the trainer's, with the batch-invariant switch off and on.

:func:`measure` gives the ``logprob_diff`` metrics (:mod:`lockstep.rl.agreement`) of:

* ``vllm_vs_trainer``: vLLM's log-probabilities of the tokens it generated vs the trainer's
  ``score_logprobs`` of the finished sequences (scored together in one batch);
* ``lockstep_vs_trainer``: the same for lockstep's own engine (the reference: 0 with the switch on);
* ``vllm_batch_vs_alone``: vLLM's log-probabilities of the same greedy tokens generated in one batch
  vs each request alone.

``python scripts/vllm_agreement.py`` prints them for the generation tests' tiny fp32 model of each
family; docs/numerics.md ("vLLM vs the trainer") quotes them.
"""

from __future__ import annotations

import torch
from torch import nn

from lockstep import numerics
from lockstep.generate import Engine, EngineConfig, Request, SamplingParams
from lockstep.rl.agreement import logprob_diff
from lockstep.rl.scoring import score_logprobs


def _requests(model: nn.Module, n: int, max_new: int, seed: int, greedy: bool) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 24, (n,), generator=g).tolist()
    return [Request(prompt_ids=torch.randint(0, model.config.vocab_size, (k,), generator=g).tolist(),
                    sampling=SamplingParams(max_new_tokens=max_new, temperature=0.0 if greedy else 1.0,
                                            seed=seed + i, ignore_eos=True))
            for i, k in enumerate(lengths)]


def _versus_trainer(model: nn.Module, results) -> dict[str, float]:
    sequences = [r.prompt_ids + r.token_ids for r in results]
    scored = score_logprobs(model, sequences, [len(r.prompt_ids) for r in results])
    return logprob_diff([torch.tensor(r.logprobs) for r in results], scored)


@torch.no_grad()
def measure(model: nn.Module, batch_invariant: bool, *, n_requests: int = 5, max_new_tokens: int = 8,
            seed: int = 0) -> dict[str, dict[str, float]]:
    """The three comparisons of the module docstring, with the batch-invariant switch ``batch_invariant``
    on both sides (the trainer's scoring and both engines)."""
    from lockstep.vllm.engine import VllmEngine

    config = EngineConfig(cache_memory_mb=16, max_batch_size=3, batch_invariant=batch_invariant)
    model.eval()
    out: dict[str, dict[str, float]] = {}
    with numerics.batch_invariant(batch_invariant):
        vllm = VllmEngine(model, None, config)
        try:
            sampled = _requests(model, n_requests, max_new_tokens, seed, greedy=False)
            out["vllm_vs_trainer"] = _versus_trainer(model, vllm.generate(sampled))
            greedy = _requests(model, n_requests, max_new_tokens, seed, greedy=True)
            batched = vllm.generate(greedy)
            alone = [vllm.generate([r])[0] for r in greedy]
            same = all(a.token_ids == b.token_ids for a, b in zip(alone, batched))
            out["vllm_batch_vs_alone"] = {**logprob_diff([torch.tensor(r.logprobs) for r in batched],
                                                         [torch.tensor(r.logprobs) for r in alone]),
                                          "same_tokens": float(same)}
        finally:
            vllm.close()
        out["lockstep_vs_trainer"] = _versus_trainer(model, Engine(model, None, config).generate(sampled))
    return out
