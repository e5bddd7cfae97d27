"""Weight-sync packing: every state tensor once (tied weights too), bit-exact through the byte buffer."""

from __future__ import annotations

import torch
from torch import nn

from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.rl.transport import FlatState


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(3, 5))
        self.b = nn.Parameter(torch.randn(7, dtype=torch.bfloat16))
        self.register_buffer("c", torch.arange(5, dtype=torch.int64))
        self.tied = nn.Linear(5, 3, bias=False)
        self.tied.weight = self.a


def test_flat_state_round_trip_is_bitwise_with_mixed_dtypes_and_ties():
    src, dst = Mixed(), Mixed()
    flat_src, flat_dst = FlatState(src), FlatState(dst)
    assert [name for name, *_ in flat_src.entries] == ["a", "b", "c"]  # the tied weight once
    assert all(offset % 64 == 0 for *_, offset, _ in flat_src.entries)
    buffer = flat_src.new_buffer()
    flat_src.pack(buffer)
    flat_dst.unpack(buffer)
    for (name, x), (_, y) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert torch.equal(x, y), name
    assert dst.tied.weight is dst.a


def test_flat_state_carries_a_whole_model_exactly():
    cfg = model_config("qwen3_moe", "debug")
    src, dst = build_model(cfg, seed=1), build_model(cfg, seed=2)
    buffer = FlatState(src).new_buffer()
    FlatState(src).pack(buffer)
    FlatState(dst).unpack(buffer)
    sd_src, sd_dst = src.state_dict(), dst.state_dict()
    assert sd_src.keys() == sd_dst.keys()
    assert all(torch.equal(sd_src[k], sd_dst[k]) for k in sd_src)
