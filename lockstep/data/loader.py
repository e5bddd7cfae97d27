"""Batches of fixed-length training windows cut from one long stream of token ids.

The token stream (documents concatenated, eos between them) is cut into non-overlapping windows
of ``seq_len + 1`` tokens starting at multiples of ``seq_len``; a window gives ``inputs`` (its
first ``seq_len`` tokens) and ``targets`` (its last ``seq_len``, i.e. shifted by one). Each epoch
visits every window once in an order that is a pure function of ``(seed, epoch)``; the loader's
whole state is ``(epoch, position)``, so a run resumed from ``state_dict()`` sees exactly the
batches the uninterrupted run would have seen.

With ``world_size > 1`` each global batch of ``batch_size * world_size`` windows is dealt out in
rank order, every rank getting its own ``batch_size`` windows, and all ranks share one state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


class PackedLoader:
    """Infinite, resumable, seeded-shuffle iterator of ``(inputs, targets)`` LongTensors [B, T]."""

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        name: str = "corpus",
    ) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
            raise ValueError(f"{name}: tokens must be a 1-D tensor of token ids")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ValueError(f"{name}: tokens must have an integer dtype, got {tokens.dtype}")
        if seq_len <= 0 or batch_size <= 0:
            raise ValueError(f"{name}: seq_len and batch_size must be > 0, "
                             f"got seq_len={seq_len}, batch_size={batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"{name}: need 0 <= rank < world_size, got {rank=}, {world_size=}")
        n = tokens.numel()
        if n < seq_len + 1:
            raise ValueError(
                f"{name} has {n} tokens, shorter than one sequence: seq_len={seq_len} needs at "
                f"least {seq_len + 1} tokens (inputs plus the shifted target); use a shorter "
                f"seq_len or more data"
            )
        self.tokens = tokens
        self.seq_len, self.batch_size = seq_len, batch_size
        self.seed, self.shuffle = seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.name = name
        self.num_windows = (n - 1) // seq_len
        self.global_batch = batch_size * world_size
        if self.num_windows < self.global_batch:
            raise ValueError(
                f"{name} has {n} tokens = {self.num_windows} windows of seq_len={seq_len}, fewer "
                f"than one batch of batch_size={batch_size} x world_size={world_size}; lower "
                f"batch_size or seq_len"
            )
        self.epoch = 0
        self.position = 0  # index into this epoch's window order of the next global batch
        self._order: torch.Tensor | None = None
        self._order_epoch = -1
        self._offsets = torch.arange(seq_len + 1)

    @property
    def num_batches(self) -> int:
        """Batches per epoch (a final partial batch is dropped)."""
        return self.num_windows // self.global_batch

    def window_order(self, epoch: int) -> torch.Tensor:
        """Window indices in the order epoch ``epoch`` visits them."""
        if not self.shuffle:
            return torch.arange(self.num_windows)
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_windows, generator=generator)

    def _batch(self, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = (windows * self.seq_len).unsqueeze(1) + self._offsets
        chunk = self.tokens[index].long()
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def _rank_slice(self, order: torch.Tensor, start: int) -> torch.Tensor:
        first = start + self.rank * self.batch_size
        return order[first: first + self.batch_size]

    def __iter__(self) -> "PackedLoader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position + self.global_batch > self.num_windows:
            self.epoch, self.position = self.epoch + 1, 0
        if self._order_epoch != self.epoch:
            self._order, self._order_epoch = self.window_order(self.epoch), self.epoch
        assert self._order is not None
        batch = self._batch(self._rank_slice(self._order, self.position))
        self.position += self.global_batch
        return batch

    def iter_epoch(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One pass over the windows in corpus order (no shuffle), ``num_batches`` batches.

        For evaluation; does not read or change the training state.
        """
        order = torch.arange(self.num_windows)
        for b in range(self.num_batches):
            yield self._batch(self._rank_slice(order, b * self.global_batch))

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue at exactly the next batch."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "num_tokens": self.tokens.numel(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a ``state_dict()``; the data layout must match, the seed is adopted."""
        expected = {"seq_len": self.seq_len, "global_batch": self.global_batch,
                    "num_tokens": self.tokens.numel()}
        mismatched = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if mismatched:
            detail = ", ".join(f"{k}: saved {s}, now {v}" for k, (s, v) in mismatched.items())
            raise ValueError(f"{self.name}: loader state does not match this data ({detail}); "
                             f"a resumed run needs the same corpus, seq_len and global batch")
        position = int(state["position"])
        if not 0 <= position <= self.num_windows or position % self.global_batch:
            raise ValueError(f"{self.name}: invalid loader position {position}")
        self.epoch, self.position = int(state["epoch"]), position
        self.seed = int(state["seed"])
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self._order, self._order_epoch = None, -1

    def __repr__(self) -> str:
        return (f"PackedLoader({self.name}: {self.tokens.numel()} tokens, seq_len={self.seq_len}, "
                f"batch_size={self.batch_size}, {self.num_batches} batches/epoch, "
                f"epoch={self.epoch}, position={self.position})")
