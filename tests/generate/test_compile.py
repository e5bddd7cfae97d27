"""``compile_decode``: the decode step under torch.compile computes what eager does.

Only ``aot_eager`` runs here (a traced graph, no code generation: ~2 s on a debug model, and bitwise
equal to eager on CPU for the same shapes). Inductor is not run in the suite: its cold compile of
the decode step of the same model took ~10 s per batch bucket on this 2-vCPU machine (see the
report in docs/generation.md); the option itself is validated in test_errors.py.
"""

from __future__ import annotations

import torch

from lockstep.generate import Request, SamplingParams

from .conftest import engine_for, prompts, tiny_model


def test_aot_eager_decode_is_bitwise_eager_and_follows_weight_updates():
    model = tiny_model("qwen3")
    reqs = [Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=6, temperature=0.8, seed=i))
            for i, p in enumerate(prompts([3, 7]))]
    eager = engine_for(model, max_batch_size=2)
    compiled = engine_for(model, max_batch_size=2, compile_decode="aot_eager")
    before = eager.generate(reqs)
    for a, b in zip(before, compiled.generate(reqs)):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs  # exact floats
    # in-place weight updates (an RL trainer between rollouts) reach the compiled step
    with torch.no_grad():
        model.layers["1"].feed_forward.w2.weight.mul_(-1.5)
    after = eager.generate(reqs)
    assert [r.logprobs for r in after] != [r.logprobs for r in before]
    for a, b in zip(after, compiled.generate(reqs)):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    # a batch of 3 is padded to the bucket of 4 (padding rows attend the null block only)
    greedy = SamplingParams(max_new_tokens=4, temperature=0)
    reqs3 = [Request(prompt_ids=p, sampling=greedy) for p in prompts([2, 5, 9])]
    eager4 = engine_for(model, max_batch_size=4)
    compiled4 = engine_for(model, max_batch_size=4, compile_decode="aot_eager")
    for a, b in zip(eager4.generate(reqs3), compiled4.generate(reqs3)):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-5)
