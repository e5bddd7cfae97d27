"""Tensor parallelism of MLA / MoE blocks: what the degrees allow and what the plan refuses, by field.

The training parity of these plans (tp=2 deepseek, tp=2 moe, tp=2 x ep=2 moe: losses and parameters
against one process) is in ``tests/parallel/test_loss_parity.py``.
"""

import pytest

from lockstep.config.base import ConfigError
from lockstep.models.common.transformer import build_meta_model
from lockstep.models.registry import model_config
from lockstep.parallel.dims import ParallelConfig
from lockstep.parallel.tp_blocks import check_tp_divides


def test_ep_with_tp_resolves_to_an_ep_by_tp_mesh():
    dims = ParallelConfig(tp=2, ep=2).resolve(4)
    assert (dims.dp_shard, dims.ep, dims.tp) == (2, 2, 2)
    assert dims.mesh_dims == [("dp_shard_mod_ep", 1), ("ep", 2), ("tp", 2)]
    assert dims.data_dims == ["dp_shard_mod_ep", "ep"]  # the tp ranks of an ep rank share its tokens
    # ep still takes all of dp_shard (experts outside FSDP): refused otherwise, naming the field
    with pytest.raises(ConfigError, match="parallel.ep: expert parallel currently needs ep == dp_shard"):
        ParallelConfig(tp=2, ep=2, dp_shard=4).resolve(8)


@pytest.mark.parametrize("family, tp, message", [
    ("deepseek_v3", 8, r"parallel.tp: 8 does not divide model.n_heads=4 \(layers.0.attention\)"),
    ("qwen3_moe", 64, r"parallel.tp: 64 does not divide the expert hidden size model.feed_forward.moe_ffn_dim=32"),
    ("gpt_oss", 2, r"parallel.tp: expert tensor parallelism does not support model.feed_forward.expert_bias"),
])
def test_tp_plan_refuses_what_it_cannot_split(family, tp, message):
    model = build_meta_model(model_config(family, "debug"))
    with pytest.raises(ConfigError, match=message):
        check_tp_divides(model, tp)


def test_tp_plan_accepts_the_debug_shapes_at_tp2():
    for family in ("deepseek_v3", "qwen3_moe"):
        check_tp_divides(build_meta_model(model_config(family, "debug")), 2)
