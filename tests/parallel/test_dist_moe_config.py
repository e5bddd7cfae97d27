"""Dist-MoE configuration: field validation, refusals and the manifest entry (one process, fast)."""

import pytest

from lockstep.config.base import ConfigError
from lockstep.models.registry import model_config
from lockstep.parallel.dims import ParallelConfig
from lockstep.parallel.dist_moe import describe_dispatch, make_dist_moe
from lockstep.parallel.dist_moe_ops import LINK_ENV, EmulatedLink, emulated_link, remote_bytes


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


def test_emulated_link_reads_its_variable_and_counts_remote_bytes(monkeypatch):
    monkeypatch.delenv(LINK_ENV, raising=False)
    assert emulated_link() is None
    monkeypatch.setenv(LINK_ENV, "50,100")
    link = emulated_link()
    assert link == EmulatedLink(50e-6, 100e6)
    # rank 1 receives 3 + 5 remote rows and sends 2 + 7: the larger side (9 rows of 1 KiB) crosses its link
    assert remote_bytes(([3, 4, 5], [2, 6, 7]), 1, 1024) == 9 * 1024
    assert emulated_link() is link  # one link per process: every layer queues on it
    # exchanges queue: the second, issued while the first is on the wire, starts when it is done
    free = 10.0 + 9 * 1024 / 100e6
    assert link.deadline(10.0, 9 * 1024) == free + 50e-6
    assert link.deadline(10.0, 1000) == free + 1000 / 100e6 + 50e-6
    assert link.deadline(20.0, 0) == 20.0 + 50e-6  # idle link: issue + latency
    for bad in ("50", "fast,100", "50,0", "-1,100"):
        monkeypatch.setenv(LINK_ENV, bad)
        with pytest.raises(ConfigError, match=LINK_ENV):
            emulated_link()
