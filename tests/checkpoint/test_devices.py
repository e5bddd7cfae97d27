"""Checkpoint staging and RNG state for device tensors, checked on the CPU: the CUDA calls
(page-locking the staging buffer, the CUDA generator) are replaced by recorders, so the rules run
here; scripts/gpu_check.sh saves and loads real CUDA tensors."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from lockstep.checkpoint import Checkpointer, LocalStorage, Slot
from lockstep.checkpoint.checkpointer import stage
from lockstep.checkpoint.train_state import rng_state, set_rng_state


class FakeCudart:
    def __init__(self, error: int = 0) -> None:
        self.error, self.registered, self.unregistered = error, [], []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (the CUDA runtime's name)
        self.registered.append((ptr, size, flags))
        return self.error

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def _slots():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 30, generator=g)
    return {"model/w": Slot.of(w), "model/wt": Slot.of(w.t()), "model/b": Slot.of(torch.randn(7).bfloat16())}


def test_cpu_staging_is_exact_and_synchronises_no_device(monkeypatch):
    slots = _slots()
    views = {name: torch.empty(s.shape, dtype=s.tensor.dtype) for name, s in slots.items()}
    monkeypatch.setattr(torch, "get_device_module", lambda *a: pytest.fail("CPU staging synchronised a device"))
    stage(views, slots)
    assert all(torch.equal(views[n], slots[n].tensor) for n in slots)  # the transposed (non-contiguous) one too


@pytest.mark.parametrize("error", [0, 2])
def test_staging_buffer_is_page_locked_once_and_released(tmp_path, monkeypatch, error):
    cudart = FakeCudart(error)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    ck = Checkpointer(LocalStorage(tmp_path), mode="sync")
    ck.prepare(_slots())
    buffer = ck._buffer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck._pin_buffer()
    assert len([w for w in caught if "page-locking" in str(w.message)]) == (1 if error else 0)
    assert cudart.registered == [(buffer.data_ptr(), buffer.numel(), 1)]
    ck.close()
    ck._release_buffer()  # a second release unregisters nothing more
    # a failed registration is never unregistered
    assert cudart.unregistered == ([] if error else [buffer.data_ptr()])


def test_rng_state_records_cuda_only_when_cuda_is_in_use(monkeypatch):
    assert "cuda" not in rng_state()  # this process never initialised CUDA
    saved_cuda = torch.arange(16, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: saved_cuda)
    monkeypatch.setattr(torch.cuda, "set_rng_state", restored.append)
    state = rng_state()
    expected = torch.rand(3), random.random()
    set_rng_state(state)
    assert torch.equal(restored[0], saved_cuda)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
