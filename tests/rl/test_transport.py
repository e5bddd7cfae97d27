"""Weight-sync packing: every state tensor once (tied weights too), bit-exact through the byte buffer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.rl.transport import FlatState, backend_devices, transfer_device


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


# --- devices: where the byte buffers live (the group's backend decides; no GPU needed to test the rule)

def test_backend_devices_parses_backend_configs():
    assert backend_devices(config="cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert backend_devices(config="nccl") == {"cuda": "nccl"}
    assert backend_devices(config="gloo") == {"cpu": "gloo", "cuda": "gloo"}


def test_transfer_device_follows_the_backend(monkeypatch):
    cuda1 = torch.device("cuda", 1)
    # NCCL carries the CUDA model's own tensors; gloo gets CPU bytes (it would stage CUDA ones itself)
    assert transfer_device(None, cuda1, config="cuda:nccl") == cuda1
    assert transfer_device(None, cuda1, config="cpu:gloo,cuda:nccl") == cuda1
    assert transfer_device(None, cuda1, config="cpu:gloo,cuda:gloo") == torch.device("cpu")
    assert transfer_device(None, "cpu", config="cpu:gloo,cuda:nccl") == torch.device("cpu")
    # CPU data on an NCCL-only group: the current CUDA device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert transfer_device(None, "cpu", config="nccl") == torch.device("cuda", 3)
    with pytest.raises(ValueError, match="carry neither"):
        transfer_device(None, "cpu", config="xla:gloo")


def test_flat_state_buffer_on_the_groups_device(monkeypatch):
    model = Mixed()
    assert FlatState(model).device == torch.device("cpu")  # no group: the model's device
    import lockstep.rl.transport as transport

    monkeypatch.setattr(transport.dist, "get_backend_config", lambda group=None: "cuda:nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    flat = FlatState(model, group=object())
    assert flat.model_device == torch.device("cpu") and flat.device == torch.device("cuda", 0)
