"""ParallelDims: degrees resolve against the world size; errors name the offending degree."""

import pytest

from lockstep.config.base import ConfigError
from lockstep.parallel.dims import ParallelConfig


def test_auto_dp_shard_takes_the_remaining_ranks():
    dims = ParallelConfig(tp=2).resolve(8)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp) == (1, 4, 2, 4)
    assert dims.mesh_dims == [("dp_shard", 4), ("tp", 2)]
    assert ParallelConfig(dp_replicate=2, dp_shard=1).resolve(2).mesh_dims == [("dp_replicate", 2), ("dp_shard", 1)]
    assert ParallelConfig().resolve(1).mesh_dims == []


def test_product_must_equal_world():
    with pytest.raises(ConfigError, match=r"pp=1 x dp_replicate=1 x dp_shard=3 x cp=1 x tp=1 = 3, but the world size is 4"):
        ParallelConfig(dp_shard=3).resolve(4)
    with pytest.raises(ConfigError, match=r"tp=3 x pp=1 x cp=1 = 3 does not divide the world size 4"):
        ParallelConfig(tp=3).resolve(4)


def test_tp_must_divide_heads_and_ffn():
    dims = ParallelConfig(tp=4).resolve(4)
    with pytest.raises(ConfigError, match=r"parallel.tp: 4 does not divide model.n_kv_heads=2"):
        dims.check_model(n_heads=8, n_kv_heads=2, ffn_dim=64, vocab_size=128)


@pytest.mark.parametrize("kwargs, field", [({"tp": 0}, "parallel.tp"), ({"dp_shard": 0}, "parallel.dp_shard"),
                                           ({"reshard_after_forward": "sometimes"}, "parallel.reshard_after_forward")])
def test_validation_names_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        ParallelConfig(**kwargs).validate()


def test_cp_is_a_mesh_dim_but_not_a_data_dim():
    dims = ParallelConfig(cp=2).resolve(4)
    assert dims.mesh_dims == [("dp_shard", 2), ("cp", 2)]
    assert dims.data_dims == ["dp_shard"]  # both cp ranks of a replica read the same batch
    cp_tp = ParallelConfig(cp=2, tp=2).resolve(4)  # composes: tp innermost, cp next to it
    assert cp_tp.mesh_dims == [("cp", 2), ("tp", 2)] and cp_tp.data_dims == []
    cp_pp = ParallelConfig(cp=2, pp=2).resolve(4)  # composes: each stage's ranks split the sequence
    assert cp_pp.mesh_dims == [("pp", 2), ("cp", 2)] and cp_pp.data_dims == []
    assert ParallelConfig(cp=2, pp=2, ep=2, dp_shard=1).resolve(4).ep_spans_cp  # each stage's ep over its cp ranks
    with pytest.raises(ConfigError, match=r"parallel.ep: with context parallel, ep spans dp_shard x cp .* got ep=2, "
                                          r"dp_shard=2, cp=2"):
        ParallelConfig(cp=2, ep=2, dp_shard=2).resolve(4)
    with pytest.raises(ConfigError, match=r"parallel.ep: expert parallel spanning cp with tp=2"):
        ParallelConfig(cp=2, ep=2, tp=2, dp_shard=1).resolve(4)


def test_ep_borrows_the_cp_ranks():
    dims = ParallelConfig(cp=2, ep=4, dp_shard=2).resolve(4)
    assert dims.ep_spans_cp and dims.ep_data_ranks == 2  # expert grads sum 2 data batches' means
    assert dims.mesh_dims == [("dp_shard", 2), ("cp", 2)] and dims.data_dims == ["dp_shard"]
    alone = ParallelConfig(cp=2, ep=2, dp_shard=1).resolve(2)  # ep over the cp ranks only
    assert alone.mesh_dims == [("dp_shard", 1), ("cp", 2)] and alone.ep_data_ranks == 1
    assert ParallelConfig(ep=2, dp_shard=2).resolve(2).ep_data_ranks == 2 and not ParallelConfig(
        ep=2, dp_shard=2).resolve(2).ep_spans_cp


def test_ep_borrows_part_of_dp_shard_and_works_with_replicas():
    """ep any divisor of dp_shard: the dp_shard ranks split into (dp_shard_mod_ep, ep), ep innermost;
    the experts' FSDP mesh is dp_shard_mod_ep (x dp_replicate), none when ep takes all of dp_shard."""
    from lockstep.parallel.fsdp import expert_mesh

    dims = ParallelConfig(dp_shard=4, ep=2).resolve(4)
    assert dims.mesh_dims == [("dp_shard_mod_ep", 2), ("ep", 2)] and dims.dp == 4
    hsdp = ParallelConfig(dp_replicate=2, dp_shard=2, ep=2).resolve(4)
    assert hsdp.mesh_dims == [("dp_replicate", 2), ("dp_shard_mod_ep", 1), ("ep", 2)]
    assert hsdp.data_dims == ["dp_replicate", "dp_shard_mod_ep", "ep"]  # every rank reads its own batch
    fake = {"dp_shard_mod_ep": "mod", ("dp_replicate", "dp_shard_mod_ep"): "hsdp"}  # what each slices
    assert expert_mesh(fake, dims) == "mod" and expert_mesh(fake, hsdp) == "hsdp"
    assert expert_mesh(fake, ParallelConfig(dp_shard=2, ep=2).resolve(2)) is None  # each ep rank owns its slice
    with pytest.raises(ConfigError, match=r"parallel.ep: 3 must divide dp_shard=4"):
        ParallelConfig(dp_shard=4, ep=3).resolve(4)
