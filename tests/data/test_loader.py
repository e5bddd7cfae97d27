"""PackedLoader on small synthetic token streams: shapes, shift, shuffle, exact resume."""

from __future__ import annotations

import itertools

import pytest
import torch

from lockstep.data import PackedLoader

T, B = 8, 4
TOKENS = torch.arange(1000, dtype=torch.int32)  # 124 windows -> 31 batches per epoch


def take(loader: PackedLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(itertools.islice(loader, n))


def test_shapes_and_shift() -> None:
    loader = PackedLoader(TOKENS, seq_len=T, batch_size=B, seed=0)
    inputs, targets = next(loader)
    assert inputs.shape == targets.shape == (B, T)
    assert inputs.dtype == targets.dtype == torch.long
    assert torch.equal(targets[:, :-1], inputs[:, 1:])
    assert torch.equal(targets, inputs + 1)  # tokens are arange, so the shift is +1
    assert (inputs[:, 0] % T == 0).all()  # windows start at multiples of T
    assert loader.num_windows == (1000 - 1) // T and loader.num_batches == 124 // B


def test_epoch_visits_every_window_once() -> None:
    loader = PackedLoader(TOKENS, seq_len=T, batch_size=B, seed=3)
    starts = torch.cat([x[:, 0] for x, _ in take(loader, loader.num_batches)])
    assert sorted(starts.tolist()) == [i * T for i in range(loader.num_windows)]
    assert starts.tolist() != sorted(starts.tolist())  # shuffled
    assert loader.state_dict()["epoch"] == 0
    next(loader)
    assert loader.state_dict()["epoch"] == 1  # rolled over into the next epoch


def test_dropped_remainder_and_epoch_boundary() -> None:
    tokens = torch.arange(4 * T * 3 + 2 * T + 1)  # 14 windows, B=4: 3 batches, 2 left over
    loader = PackedLoader(tokens, seq_len=T, batch_size=B, seed=0)
    assert loader.num_batches == 3
    batches = take(loader, 7)
    assert loader.epoch == 2 and loader.position == B
    for epoch in range(2):
        order = loader.window_order(epoch)
        for b in range(3):
            expected = order[b * B:(b + 1) * B] * T
            assert torch.equal(batches[epoch * 3 + b][0][:, 0], expected)


def test_shuffle_is_seeded() -> None:
    def first_epoch(seed: int) -> list[torch.Tensor]:
        return [x for x, _ in take(PackedLoader(TOKENS, seq_len=T, batch_size=B, seed=seed), 31)]

    a, again, other = first_epoch(0), first_epoch(0), first_epoch(1)
    assert all(torch.equal(x, y) for x, y in zip(a, again))
    assert not all(torch.equal(x, y) for x, y in zip(a, other))
    loader = PackedLoader(TOKENS, seq_len=T, batch_size=B, seed=0)
    assert not torch.equal(loader.window_order(0), loader.window_order(1))
    # Order is a pure function of (seed, epoch): seed 0 epoch 1 == seed 1 epoch 0 by design.
    assert torch.equal(loader.window_order(1), PackedLoader(TOKENS, T, B, seed=1).window_order(0))


@pytest.mark.parametrize("consumed", [0, 1, 10, 30, 31, 32, 45, 62, 100])
def test_resume_is_exact(consumed: int) -> None:
    reference = PackedLoader(TOKENS, seq_len=T, batch_size=B, seed=7)
    expected = take(reference, consumed + 40)

    first = PackedLoader(TOKENS, seq_len=T, batch_size=B, seed=7)
    take(first, consumed)
    state = first.state_dict()
    assert set(state) >= {"epoch", "position", "seed"}

    resumed = PackedLoader(TOKENS, seq_len=T, batch_size=B, seed=12345)  # seed comes from state
    resumed.load_state_dict(dict(state))
    for (x, y), (ex, ey) in zip(take(resumed, 40), expected[consumed:]):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    assert resumed.state_dict() == reference.state_dict()


def test_iter_epoch_is_sequential_and_leaves_state_alone() -> None:
    loader = PackedLoader(TOKENS, seq_len=T, batch_size=B, seed=0, shuffle=False)
    take(loader, 5)
    state = loader.state_dict()
    batches = list(loader.iter_epoch())
    assert len(batches) == loader.num_batches == 31
    starts = torch.cat([x[:, 0] for x, _ in batches])
    assert starts.tolist() == [i * T for i in range(31 * B)]
    assert loader.state_dict() == state
    assert list(loader.iter_epoch())[3][0].equal(batches[3][0])


def test_unshuffled_training_order_is_corpus_order() -> None:
    loader = PackedLoader(TOKENS, seq_len=T, batch_size=B, shuffle=False)
    assert torch.equal(next(loader)[0][:, 0], torch.arange(B) * T)


def test_ranks_partition_the_global_batch() -> None:
    full = PackedLoader(TOKENS, seq_len=T, batch_size=2 * B, seed=5)
    ranks = [PackedLoader(TOKENS, seq_len=T, batch_size=B, seed=5, rank=r, world_size=2)
             for r in range(2)]
    for _ in range(20):
        x, _ = next(full)
        assert torch.equal(torch.cat([next(r)[0] for r in ranks]), x)


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"shorter than one sequence.*seq_len=8.*9 tokens"):
        PackedLoader(torch.arange(8), seq_len=8, batch_size=1)
    with pytest.raises(ValueError, match="fewer than one batch"):
        PackedLoader(torch.arange(30), seq_len=8, batch_size=4)
    with pytest.raises(ValueError, match="1-D"):
        PackedLoader(torch.zeros(4, 100, dtype=torch.long), seq_len=8, batch_size=1)
    with pytest.raises(ValueError, match="integer"):
        PackedLoader(torch.zeros(100), seq_len=8, batch_size=1)
    loader = PackedLoader(TOKENS, seq_len=T, batch_size=B)
    with pytest.raises(ValueError, match="seq_len: saved 16, now 8"):
        loader.load_state_dict({**loader.state_dict(), "seq_len": 16})
    with pytest.raises(ValueError, match="position"):
        loader.load_state_dict({**loader.state_dict(), "position": 3})
