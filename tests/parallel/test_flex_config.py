"""FlexShard in one process: bucket specs and their errors, the layout rules, owner balancing, and
``flex_shard`` at world 1 (no process group: every collective is the identity) against the plain model."""

from __future__ import annotations

import pytest
import torch

from lockstep.config.base import ConfigError
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.parallel.dims import ParallelConfig
from lockstep.parallel.flex import BlockShard, Bucket, Owned, Shard, flex_shard, parse_bucket
from lockstep.parallel.flex.buckets import match_buckets, muon_preset, parse_buckets
from lockstep.parallel.flex.layout import FlexParam, assign_owners, newton_schulz_cost

FQNS = ["tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.attention.wk.weight",
        "layers.0.feed_forward.w1.weight", "norm.weight"]


def test_spec_strings_parse():
    b = parse_bucket("layers.*.attention.w[qkv].weight|norm.*=block_shard(0, 16)+fp8@dp", "f")
    assert b.patterns == ["layers.*.attention.w[qkv].weight", "norm.*"]
    assert b.placement == BlockShard(0, 16) and b.fp8 and b.mesh_dim == "dp"
    assert parse_bucket("*=owned", "f").placement == Owned()
    assert parse_bucket("*=shard", "f").placement == Shard(0)
    assert parse_bucket("*=shard(1)", "f").placement == Shard(1)
    assert parse_bucket("*=shard(1)", "f").describe() == "shard(1)"


@pytest.mark.parametrize("spec, message", [
    ("layers.*=replicate", r"parallel.flex_buckets\[1\]: unknown placement 'replicate'"),
    ("layers.*", r"parallel.flex_buckets\[1\]: expected 'GLOB"),
    ("layers.*=shard(0)+fp8", r"parallel.flex_buckets\[1\]: fp8 gathers need block_shard"),
    ("layers.*=owned+fp8", r"parallel.flex_buckets\[1\]: fp8 gathers need block_shard"),
    ("layers.*=owned@tp", r"parallel.flex_buckets\[1\]: mesh dim must be one of"),
    ("layers.*=block_shard(0,0)", r"parallel.flex_buckets\[1\]: block_shard block must be >= 1"),
])
def test_bad_specs_name_the_entry(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_buckets(["*=shard", spec])
    with pytest.raises(ConfigError, match=message):  # and through the config's validation
        ParallelConfig(sharding="flex", flex_buckets=["*=shard", spec]).validate()


def test_every_parameter_in_exactly_one_bucket():
    ok = match_buckets(FQNS, parse_buckets(["layers.*=owned", "[!l]*=shard"]))
    assert ok == {f: 0 if f.startswith("layers") else 1 for f in FQNS}
    with pytest.raises(ConfigError, match=r"parallel.flex_buckets: parameter 'norm.weight' is matched by no bucket"):
        match_buckets(FQNS, parse_buckets(["layers.*=owned", "tok_*=shard"]))
    with pytest.raises(ConfigError, match=r"parameter 'layers.0.attention.wq.weight' is matched by 2 buckets: "
                                          r"parallel.flex_buckets\[0\] \['layers.\*'\] and parallel.flex_buckets\[1\]"):
        match_buckets(FQNS, parse_buckets(["layers.*=owned", "*.w[qkv].weight=block_shard(0,16)", "[!l]*=shard"]))
    with pytest.raises(ConfigError, match=r"parallel.flex_buckets\[1\]: 'mtp.\*' matches no module"):
        match_buckets(FQNS, parse_buckets(["*=shard", "mtp.*=owned"]))


def test_flex_config_refusals():
    for degree in ("tp", "ep", "cp", "pp"):
        with pytest.raises(ConfigError, match=rf"^parallel.sharding: flex supports dp_shard / dp_replicate only, "
                                              rf"got {degree}=2"):
            ParallelConfig(sharding="flex", **{degree: 2}).validate()
    with pytest.raises(ConfigError, match="^parallel.flex_buckets: give flex_buckets or flex_preset"):
        ParallelConfig(sharding="flex", flex_preset="muon", flex_buckets=["*=shard"]).validate()
    with pytest.raises(ConfigError, match="^parallel.sharding: flex_buckets / flex_preset need sharding='flex'"):
        ParallelConfig(flex_preset="muon").validate()
    with pytest.raises(ConfigError, match="^parallel.sharding"):
        ParallelConfig(sharding="zero3").validate()
    with pytest.raises(ConfigError, match="^parallel.flex_preset"):
        ParallelConfig(sharding="flex", flex_preset="adam").validate()


def test_flex_refuses_graph_mode():
    from lockstep.parallel.parallelize import parallelize_dense

    config = ParallelConfig(dp_shard=1, sharding="flex")
    model = build_model(model_config("llama3", "debug"), seed=0)
    with pytest.raises(ConfigError, match="^parallel.sharding: flex is eager only"):
        parallelize_dense(model, config.resolve(1), None, config, traceable=True)


def _layout(placement: str, shape, world: int, rank: int, block=None, owner=None, dim=0) -> FlexParam:
    lay = FlexParam(placement=placement, global_shape=shape, dim=dim, offset=0, block=block, owner=owner,
                    group=None, rank=rank, world=world, bucket="b")
    lay.offset = lay.piece_of(rank)[0]
    return lay


def test_pieces_follow_the_placement_rules():
    # shard: torch.chunk pieces (5 rows over 4 ranks: 2, 2, 1, 0)
    pieces = [_layout("shard", (5, 3), 4, r).piece_of(r) for r in range(4)]
    assert pieces == [(0, 2), (2, 2), (4, 1), (5, 0)]
    assert [c.shape[0] for c in torch.arange(15).view(5, 3).chunk(4)] == [2, 2, 1]
    # block_shard: T = ceil(40 / 16) = 3 blocks, k = ceil(3 / 2) = 2 per rank: rows 0..32, 32..40
    assert [_layout("block_shard", (40, 8), 2, r, block=16).piece_of(r) for r in range(2)] == [(0, 32), (32, 8)]
    # owned: the owner whole, the others (0, *shape[1:])
    lay = _layout("owned", (6, 4), 2, 1, owner=0)
    assert lay.local_shape == (0, 4) and not lay.is_whole
    assert _layout("owned", (6, 4), 2, 0, owner=0).is_whole
    whole = torch.arange(24.0).view(6, 4)
    assert lay.shard_of(whole).shape == (0, 4)
    col = _layout("shard", (6, 4), 2, 1, dim=1)
    assert torch.equal(col.shard_of(whole), whole[:, 2:])
    assert col.assemble([whole[:, :2], whole[:, 2:]]).equal(whole)


def test_owners_balance_newton_schulz_cost_deterministically():
    assert newton_schulz_cost((8, 32, 64)) == 8 * 32 ** 2 * 64 and newton_schulz_cost((7,)) == 7
    shapes = {"a": (64, 64), "b": (64, 64), "c": (32, 64), "d": (16, 16), "e": (64,)}
    owners = assign_owners(shapes, 2)
    # a (cost 262144) -> 0; b (equal cost, FQN after a) -> 1; c (65536) -> 0 (tie on load: lower rank)...
    assert owners == {"a": 0, "b": 1, "c": 0, "d": 1, "e": 1}
    assert assign_owners(dict(reversed(shapes.items())), 2) == owners  # independent of the input order


def _train_steps(model, batches):
    from lockstep.run.objective import LMObjective
    from lockstep.train.optim import AdamWConfig

    optimizer = AdamWConfig(lr=1e-2).build(model)
    losses = []
    for batch in batches:
        loss, _ = LMObjective()(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("reshard", ["always", "never"])
def test_world1_flex_trains_like_the_plain_model(reshard):
    """No process group: pieces are whole, gathers and reduces copy. The reads inside forward, the
    regather from saved-tensor handles ("always") and the reduce keep the plain model's bits."""
    from lockstep.parallel.checkpointing import apply_activation_checkpointing

    cfg = model_config("qwen3_moe", "debug")
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, cfg.vocab_size, (2, 16), generator=g),
                torch.randint(0, cfg.vocab_size, (2, 16), generator=g)) for _ in range(2)]
    plain = build_model(cfg, seed=0)
    flex = apply_activation_checkpointing(build_model(cfg, seed=0), "full")
    state = flex_shard(flex, parse_buckets(["layers.*.attention.w[qkv].weight=block_shard(0,16)",
                                            "layers.*.feed_forward.*=owned", "[!l]*|layers.*_norm.*|*.wo.*=shard"]),
                       None, reshard_after_forward=reshard)
    assert {p._flex.placement for p in flex.parameters()} == {"shard", "owned", "block_shard"}
    assert all(p._flex.is_whole for p in flex.parameters())
    assert _train_steps(flex, batches) == _train_steps(plain, batches)
    for (name, a), b in zip(plain.state_dict().items(), flex.state_dict().values()):
        assert torch.equal(a, b), name
    # outside a forward the attributes are the stored parameters
    attention = flex.layers["0"]._checkpoint_wrapped_module.attention
    assert attention.wq.weight is attention.wq._parameters["weight"]
    assert state.describe()["buckets"][1]["params"] == 8


def test_muon_preset_places_hidden_matrices():
    model = build_model(model_config("llama3", "debug"), seed=0)
    buckets = muon_preset(model)
    fqns = list(dict(model.named_parameters()))
    chosen = {f: buckets[i].placement for f, i in match_buckets(fqns, buckets).items()}
    assert chosen["layers.0.attention.wq.weight"] == BlockShard(0, 16)  # head_dim = 64 / 4
    assert chosen["layers.0.attention.wo.weight"] == Owned()
    assert chosen["layers.1.feed_forward.w2.weight"] == Owned()
    assert chosen["tok_embeddings.weight"] == chosen["output.weight"] == chosen["norm.weight"] == Shard(0)


def test_python_api_bucket_errors_name_the_bucket():
    model = build_model(model_config("llama3", "debug"), seed=0)
    with pytest.raises(ConfigError, match="^mine: fp8 gathers need block_shard"):
        flex_shard(model, [Bucket(["*"], Shard(0), fp8=True, name="mine")], None)
    with pytest.raises(ConfigError, match="^ffn: fp8 gathers 2-D parameters split on dim 0"):
        flex_shard(model, [Bucket(["layers.*.feed_forward.*"], BlockShard(1, 16), fp8=True, name="ffn"),
                           Bucket(["[!l]*", "layers.*.attention*", "layers.*.ffn_norm.*"], Shard(0))], None)


def test_cli_flags_reach_the_config():
    from lockstep.cli import resolve_config

    specs = ["layers.*.attention.w[qkv].weight=block_shard(0,16)", "layers.*.feed_forward.*=owned", "[!l]*=shard"]
    cfg, _ = resolve_config(["--recipe", "debug", "--parallel.sharding", "flex", "--parallel.flex-buckets", *specs])
    assert cfg.parallel.sharding == "flex" and cfg.parallel.flex_buckets == specs
    with pytest.raises(ConfigError, match=r"^parallel.flex_buckets\[0\]: unknown placement 'everywhere'"):
        resolve_config(["--recipe", "debug", "--parallel.sharding", "flex", "--parallel.flex-buckets", "*=everywhere"])
    with pytest.raises(ConfigError, match=r"^parallel.sharding: flex supports dp_shard / dp_replicate only, got tp=2"):
        resolve_config(["--recipe", "debug", "--parallel.sharding", "flex", "--parallel.tp", "2"])
