"""Tensor parallelism of MLA / MoE / Gated DeltaNet / GPT-OSS blocks: what the degrees allow and what the plan refuses, by field.

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
    # ep may take part of dp_shard (experts FSDP-sharded over the rest: `tp=2 x dp_shard=4 x ep=2 moe`)
    borrowed = ParallelConfig(tp=2, ep=2, dp_shard=4).resolve(8)
    assert borrowed.mesh_dims == [("dp_shard_mod_ep", 2), ("ep", 2), ("tp", 2)]


@pytest.mark.parametrize("family, tp, message", [
    ("deepseek_v3", 8, r"parallel.tp: 8 does not divide model.n_heads=4 \(layers.0.attention\)"),
    ("qwen3_moe", 64, r"parallel.tp: 64 does not divide the expert hidden size model.feed_forward.moe_ffn_dim=32"),
    # whole key-head groups per rank: the debug hybrids have 2 key heads
    ("qwen3_5", 4, r"parallel.tp: 4 does not divide model.linear_attention.n_k_heads=2 \(layers.0.attention\)"),
])
def test_tp_plan_refuses_what_it_cannot_split(family, tp, message):
    model = build_meta_model(model_config(family, "debug"))
    with pytest.raises(ConfigError, match=message):
        check_tp_divides(model, tp)


@pytest.mark.parametrize("family, flavor", [("deepseek_v3", "debug"), ("qwen3_moe", "debug"), ("gpt_oss", "debug"),
                                            ("qwen3_5", "debug"), ("qwen3_5", "debug-moe"), ("qwen3_next", "debug")])
def test_tp_plan_accepts_the_debug_shapes_at_tp2(family, flavor):
    # sinks, attention / expert biases, shared-expert gates, gated attention and Gated DeltaNet have
    # plans (parity: the tp=2 layouts of tests/parallel/test_loss_parity.py)
    from lockstep.parallel.parallelize import _require_tp_blocks

    model = build_meta_model(model_config(family, flavor))
    _require_tp_blocks(model)
    check_tp_divides(model, 2)


# --- expert TP at world 2 (gloo): one MoE layer under the plan equals the one-process layer ----------------

def _moe_worker(rank, world, init_file, out_dir):
    import datetime
    import os
    import sys

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from lockstep.models.common.moe import MoEConfig
    from lockstep.parallel.expert import TensorParallelExperts
    from lockstep.parallel.tp_blocks import install_moe_tp, moe_plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    cfg = MoEConfig(n_routed_experts=8, n_activated=2, moe_ffn_dim=16, n_shared_experts=1, score_func="sigmoid",
                    routed_scaling_factor=2.5, seq_aux_loss_coef=0.1)
    torch.manual_seed(0)
    ref = cfg.build(dim=16, hidden_dim=16, init_std=0.3)
    torch.manual_seed(0)
    block = nn.Module()
    block.feed_forward = cfg.build(dim=16, hidden_dim=16, init_std=0.3)
    install_moe_tp(block.feed_forward, mesh)
    parallelize_module(block, mesh, moe_plan(shared=True))
    g = torch.Generator().manual_seed(1)
    x, gout = torch.randn(2, 8, 16, generator=g), torch.randn(2, 8, 16, generator=g)
    mine = slice(4 * rank, 4 * rank + 4)  # this rank's sequence shard

    xr, xs = x.clone().requires_grad_(), x[:, mine].clone().requires_grad_()
    out_ref = ref(xr)
    (out_ref * gout).sum().add(ref.pop_auxiliary()[0]["seq_aux_loss"]).backward()
    out = block.feed_forward(xs)
    (out * gout[:, mine]).sum().add(block.feed_forward.pop_auxiliary()[0]["seq_aux_loss"]).backward()

    def chunk(t, name):  # this rank's shard of a full parameter/gradient of the one-process layer
        p = dict(block.feed_forward.named_parameters())[name]
        if not isinstance(p, DTensor):
            return t
        dim = p.placements[0].dim
        return t.chunk(world, dim=dim)[rank]

    def rel(a, b):  # max difference relative to the reference's largest entry (at least 1)
        return float((a - b).detach().abs().max() / b.detach().abs().max().clamp_min(1.0))

    diffs = {"out": rel(out, out_ref[:, mine]), "x.grad": rel(xs.grad, xr.grad[:, mine])}
    for name, p in ref.named_parameters():
        got = dict(block.feed_forward.named_parameters())[name]
        local = got.grad.to_local() if isinstance(got.grad, DTensor) else got.grad
        diffs[name] = rel(local, chunk(p.grad, name))

    # reset_parameters draws the full experts and keeps this rank's hidden-dim chunk
    experts = block.feed_forward.experts
    torch.manual_seed(5)
    experts.reset_parameters()
    torch.manual_seed(5)
    ref.experts.reset_parameters()
    reset = max(float((experts.w1.to_local() - ref.experts.w1.chunk(world, 1)[rank]).abs().max()),
                float((experts.w2.to_local() - ref.experts.w2.chunk(world, 2)[rank]).abs().max()))
    torch.save({"diffs": diffs, "reset": reset, "is_tp": isinstance(experts, TensorParallelExperts),
                "scale": float(out_ref.abs().max())}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.slow
def test_expert_tp_moe_layer_matches_one_process(tmp_path):
    """Output, input gradient and every parameter's gradient (router, experts, shared experts) of a
    sigmoid-routed MoE with shared experts and the sequence balance loss, under tp=2 with the
    sequence sharded. Tolerance 1e-6 relative to each reference tensor's largest entry (fp32, measured
    ~1e-7): the split only changes the summation order of each expert's hidden dim; a missing
    gradient sum (router weights, expert inputs) is off by O(0.1)."""
    import torch
    import torch.multiprocessing as mp

    mp.spawn(_moe_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        assert res["is_tp"] and res["scale"] > 0.1
        assert max(res["diffs"].values()) < 1e-6, (rank, res["diffs"])
        assert res["reset"] == 0.0
