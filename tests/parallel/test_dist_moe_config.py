"""Dist-MoE configuration: field validation, refusals and the manifest entry (one process, fast)."""

import pytest

from lockstep.config.base import ConfigError
from lockstep.models.registry import model_config
from lockstep.parallel.dims import ParallelConfig
from lockstep.parallel.dist_moe import describe_dispatch, make_dist_moe


@pytest.mark.parametrize("fields, name", [({"ep_chunks": -1}, "parallel.ep_chunks"),
                                          ({"ep_capacity_factor": -0.5}, "parallel.ep_capacity_factor"),
                                          ({"ep_chunks": 2, "tp": 2}, "parallel.ep_chunks"),
                                          ({"ep_chunks": 2, "pp": 2}, "parallel.ep_chunks"),
                                          ({"ep_chunks": 1, "cp": 2}, "parallel.ep_chunks")])
def test_bad_fields_name_themselves(fields, name):
    with pytest.raises(ConfigError, match=name):
        ParallelConfig(**fields).validate()


def test_manifest_entry_names_chunks_capacity_and_policy():
    sync = describe_dispatch(ParallelConfig(ep=2))
    assert sync["ep_chunks"] == 0 and "synchronous" in sync["operation"]
    entry = describe_dispatch(ParallelConfig(ep=2, ep_chunks=4, ep_capacity_factor=1.25))
    assert entry["ep_chunks"] == 4 and entry["overlap"] and entry["capacity_factor"] == 1.25
    assert entry["drop_policy"].startswith("drop past ceil(1.25")
    assert describe_dispatch(ParallelConfig(ep=2, ep_chunks=1))["drop_policy"] == "no-drop"


def test_refuses_expert_biases_and_bad_values():
    cfg = model_config("qwen3_moe", "debug").feed_forward
    cfg.expert_bias = True
    moe = cfg.build(dim=16, hidden_dim=8)
    with pytest.raises(ConfigError, match="expert_bias"):
        make_dist_moe(moe, 0, 2, 0.0, None)
    with pytest.raises(ConfigError, match="parallel.ep_chunks"):
        make_dist_moe(moe, 0, 0, 0.0, None)
