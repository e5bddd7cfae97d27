"""The engine on a non-CPU device, checked without one: a model on the ``meta`` device (shapes, no
data) shows where the engine puts its cache and step tensors and which kernels it picks; no GPU is
needed for the placement rules (scripts/gpu_check.sh runs the real thing on CUDA)."""

from __future__ import annotations

import pytest
import torch

from lockstep import numerics
from lockstep.config.base import ConfigError
from lockstep.generate import Request, SamplingParams
from lockstep.generate.engine import check_batch_invariant_device

from tests.generate.conftest import engine_for, tiny_model


class _Stop(Exception):
    pass


@pytest.mark.parametrize("family,weights_dtype", [("llama3", "model"), ("deepseek_v3", "bfloat16")])
def test_engine_follows_the_models_device(family, weights_dtype):
    model = tiny_model(family).to("meta")
    engine = engine_for(model, weights_dtype=weights_dtype)
    assert engine.device.type == "meta"
    pools = [p for name in engine.cache.layouts for p in engine.cache.layer(name).pools]
    assert pools and all(p.device.type == "meta" for p in pools)
    # the CPU C kernels stay off: no packed linears, no in-place paged attention
    assert engine._packed == [] and not engine.cache.in_place_decode
    seen = {}

    def trunk(tokens, positions, cache=None):
        meta = cache.meta
        seen.update(tokens=tokens.device, positions=positions.device, slots=meta.slot_mapping.device,
                    tables=meta.block_tables.device, q_positions=meta.q_positions.device)
        raise _Stop

    engine.runner.trunk = trunk
    engine.add_request(Request(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2, temperature=0)))
    with pytest.raises(_Stop):
        engine.step()
    assert set(seen) == {"tokens", "positions", "slots", "tables", "q_positions"}
    assert all(d.type == "meta" for d in seen.values()), seen


def test_batch_invariant_mode_is_cpu_only():
    check_batch_invariant_device(torch.device("cpu"))  # the CPU: allowed
    with pytest.raises(ConfigError, match=r"engine\.batch_invariant: batch-invariant mode is CPU-only"):
        engine_for(tiny_model("llama3").to("meta"), batch_invariant=True)
    # following the process-wide switch: refused at the first step, naming the switch
    engine = engine_for(tiny_model("llama3").to("meta"))
    engine.add_request(Request(prompt_ids=[1, 2], sampling=SamplingParams(max_new_tokens=1, temperature=0)))
    with numerics.batch_invariant(True), pytest.raises(ConfigError, match=r"numerics\.batch_invariant"):
        engine.step()
