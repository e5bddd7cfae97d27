"""``EngineConfig.skip_guard_checks``: after a bucket ran with every guard checked, the compiled
decode step runs with only the guards that tell cached graphs apart. That must never pick the wrong
graph: not across context buckets, not between two engines sharing the compiled code (the cache of
``Engine._forward_last`` is per code object, so both engines' graphs sit in it), not when
batch-invariant mode flips between calls (that mode decodes uncompiled). ``aot_eager`` traces
without changing any bits, so every compiled run must equal its uncompiled twin exactly.
"""

from __future__ import annotations

from lockstep import numerics
from lockstep.generate import Request, SamplingParams

from .conftest import engine_for, prompts, tiny_model


def _requests(seed: int) -> list[Request]:
    # prompts of 3 and 9 tokens and 10 new ones with 4-token blocks: contexts cross 1 -> 2 -> 4 -> 8 blocks
    return [Request(prompt_ids=p, sampling=SamplingParams(max_new_tokens=10, temperature=0.8, seed=seed + i))
            for i, p in enumerate(prompts([3, 9], seed=seed))]


def _run(engine, seed: int) -> list[tuple[list[int], list[float]]]:
    return [(r.token_ids, r.logprobs) for r in engine.generate(_requests(seed))]


def test_two_compiled_engines_and_mode_flips_match_their_uncompiled_twins():
    models = [tiny_model("llama3", seed=0), tiny_model("llama3", seed=1)]
    compiled = [engine_for(m, block_size=4, max_batch_size=2, compile_decode="aot_eager") for m in models]
    eager = [engine_for(m, block_size=4, max_batch_size=2) for m in models]
    for engine in compiled:
        assert engine.config.skip_guard_checks
    for round_ in range(3):  # interleaved: each engine's calls come after the other's graphs were cached
        for i in (0, 1):
            assert _run(compiled[i], seed=round_) == _run(eager[i], seed=round_), (round_, i)
    assert compiled[0]._guarded and compiled[1]._guarded
    assert not compiled[0]._unskippable and not compiled[1]._unskippable  # skipped without a recompile
    guarded = set(compiled[0]._guarded)
    with numerics.batch_invariant(True):  # decodes uncompiled: bits of the eager batch-invariant engine
        for i in (0, 1):
            assert _run(compiled[i], seed=7) == _run(eager[i], seed=7), i
    assert compiled[0]._guarded == guarded
    for i in (0, 1):  # and back to the compiled graphs, guards skipped
        assert _run(compiled[i], seed=8) == _run(eager[i], seed=8), i
    compiled[0].sync_weights()
    assert not compiled[0]._guarded
    assert _run(compiled[0], seed=9) == _run(eager[0], seed=9)
