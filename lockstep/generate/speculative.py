"""MTP speculative decoding: draft with the model's multi-token-prediction heads, verify in one forward.

``EngineConfig.speculative = "mtp"`` (greedy requests only) on a model with MTP depths
(DeepSeek-V3's ``model.mtp``, :mod:`lockstep.models.deepseek_v3.model`: families ``deepseek_v3``
and ``deepseek_v32`` with ``n_mtp >= 1``; others are refused, :func:`check_speculative`). Each MTP
depth gets a layer of the paged cache of its own (``"mtp.<d>"``, an MLA latent like the main
layers, under the same block tables), and its stream index ``i`` is the position of the main hidden
state it reads: depth 1 at ``i`` combines ``h_i`` with the embedding of ``t_{i+1}`` and predicts
``t_{i+2}``.

Per sequence of length ``L`` (tokens ``t_0 .. t_{L-1}``, the main cache holding ``0 .. L-2``) with
drafts ``d_1 .. d_n`` (``n <= draft_tokens``, fewer near the token budget):

1. **verify**: one forward of the main model over ``[t_{L-1}, d_1, .., d_n]`` at positions
   ``L-1 .. L-1+n``; column ``j``'s logits give the main model's own next token ``m_j`` (sampled by
   the engine's sampler, so log-probabilities, stop tokens and budgets are handled as in plain
   decoding). ``d_{j+1}`` is accepted while ``m_j == d_{j+1}``; the accepted drafts plus the bonus
   token ``m_a`` are emitted (``a + 1`` tokens). This is exactly what plain greedy decoding emits,
   up to the float summation order of a multi-token forward (token-identical in the fp32 tests).
2. **roll back**: nothing to undo. Rejected columns wrote the cache at positions past the new
   length ``L'``; every later forward writes a position before any query can attend it (a query at
   ``p`` sees positions ``<= p``), so those entries are overwritten unread. The same holds for the
   MTP layers' caches.
3. **catch up and draft**: MTP depth 1 runs over the verify columns (same cache metadata: stream
   index = position) with the main hidden states and the emitted tokens, so its cache holds the true
   entries up to ``L'-2``; its output at ``L'-2`` drafts ``d'_1``. Draft ``j >= 2`` runs depth
   ``min(j, D)`` on the previous draft's hidden state and the embedding of ``d'_{j-1}`` (depths past
   ``D`` reuse the last one one position further on, as vLLM does for DeepSeek's single MTP layer).
   After a prefill, depth 1 runs over the prompt the same way.

DeepSeek-V3.2 (``deepseek_v32``) runs the same steps: its sparse indexer's keys live in the same
blocks as the latent (main and MTP layers), and each query of a verify or catch-up forward selects
its top-k among the positions up to its own, so a rejected draft's stale keys are never selected
before they are overwritten.

Depths >= 2 (no released model has them) see only what the drafts wrote into their caches: their
drafts are approximate, which costs acceptance, never correctness. Sampling with ``temperature >
0`` is refused (``sampling.temperature``): distribution-preserving rejection sampling is not
implemented. The speculative steps run eagerly (``compile_decode`` applies to plain decode only).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lockstep.config.base import ConfigError
from lockstep.generate.cache import LayerLayout
from lockstep.generate.output import StreamEvent
from lockstep.generate.scheduler import Sequence

if TYPE_CHECKING:
    from lockstep.generate.engine import Engine

def mtp_layers(model: nn.Module) -> list[nn.Module]:
    """The model's MTP depths in order (empty without any)."""
    mtp = getattr(model, "mtp", None)
    return list(mtp.values()) if mtp is not None else []


def mtp_layouts(model: nn.Module) -> dict[str, LayerLayout]:
    """Cache layouts of the MTP depths' attention (``"mtp.<d>"``), for the engine's paged cache."""
    from lockstep.generate.cache import layer_layouts

    blocks = {f"mtp.{d}": layer.block for d, layer in enumerate(mtp_layers(model))}
    return layer_layouts(SimpleNamespace(layers=blocks))  # it reads ``model.layers``: the MTP blocks


#: families whose models never have MTP depths, and why (the refusal names it)
NO_MTP = {
    "kimi_k25": "kimi_k25 builds no MTP depths (its config forces n_mtp=0: multi-token prediction with "
                "images is not implemented)",
    "deepseek_v4": "deepseek_v4 has no MTP depths (its checkpoints' mtp.* weights are not loaded)",
}


def check_speculative(model: nn.Module, mode: str, recurrent: bool, field: str = "engine.speculative") -> None:
    """Refuse speculative decoding on a model it cannot run on, naming ``field`` and the family."""
    if mode == "none":
        return
    config = getattr(model, "config", None)
    family = getattr(config, "family", type(model).__name__)
    if not mtp_layers(model):
        if family in NO_MTP:
            why = NO_MTP[family]
        elif getattr(config, "n_mtp", None) == 0:
            why = f"this {family} model has n_mtp=0 (model.n_mtp >= 1 builds MTP depths)"
        else:
            why = f"family {family} has none"
        raise ConfigError(f"{field}: 'mtp' drafts with the model's multi-token-prediction heads; {why}; "
                          f"speculative='mtp' runs on deepseek_v3 and deepseek_v32 models with n_mtp >= 1")
    if recurrent:
        raise ConfigError(f"{field}: models with linear-attention (recurrent) layers ({family}) cannot roll "
                          f"back a rejected draft's state; use speculative='none'")


@dataclasses.dataclass
class SpeculativeStats:
    """Counters since the last :meth:`reset`: drafted and accepted tokens, verify forwards, tokens emitted."""

    drafted: int = 0
    accepted: int = 0
    verifies: int = 0
    emitted: int = 0

    def reset(self) -> None:
        self.drafted = self.accepted = self.verifies = self.emitted = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verify(self) -> float:
        """Tokens emitted per sequence and verify forward (1 = plain decoding's rate)."""
        return self.emitted / self.verifies if self.verifies else 0.0


class MTPSpeculator:
    """Drafts and verification for one :class:`Engine`; see the module docstring."""

    def __init__(self, engine: "Engine", draft_tokens: int) -> None:
        self.engine, self.draft_tokens = engine, draft_tokens
        self.layers = mtp_layers(engine.runner)
        #: seq_id -> its drafted tokens for the next verify
        self.drafts: dict[int, list[int]] = {}
        self.stats = SpeculativeStats()

    def check_request(self, greedy: bool) -> None:
        if not greedy:
            raise ConfigError("sampling.temperature: speculative decoding (engine.speculative='mtp') is greedy-only "
                              "(temperature=0); rejection sampling for temperature > 0 is not implemented")

    def _budget(self, seq: Sequence) -> int:
        """Drafts this sequence may verify: every emitted token must fit its budget (and reserved blocks)."""
        return max(0, min(self.draft_tokens, seq.max_new - len(seq.generated) - 1))

    # ------------------------------------------------------------------ MTP forwards

    def _mtp(self, depth: int, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Depth ``depth``'s normed output ``[B, T, dim]`` for ``tokens`` embedded beside ``hidden``,
        under the cache metadata already set (stream index = ``positions``)."""
        runner, layer = self.engine.runner, self.layers[depth]
        emb = runner.tok_embeddings(tokens.to(hidden.device))
        cache = self.engine.cache.layer(f"mtp.{depth}")
        return layer(emb, hidden, runner.rope(positions), cache=cache)

    def catch_up(self, seqs: list[Sequence], tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 last: list[int]) -> None:
        """After a main forward (prefill chunk or verify) whose metadata is still set: run depth 1 over
        its columns with ``tokens`` (each column's next token), then draft from column ``last[i]`` of
        row ``i`` (``-1``: no drafts for that row)."""
        out = self._mtp(0, tokens, hidden, positions)
        for seq, col in zip(seqs, last):
            if col >= 0:
                self.drafts[seq.seq_id] = []
        rows = [i for i, col in enumerate(last) if col >= 0 and seqs[i].finish_reason is None]
        if not rows:
            return
        index = torch.tensor(rows, device=out.device)
        cols = torch.tensor([last[i] for i in rows], device=out.device)
        self._draft([seqs[i] for i in rows], out[index, cols])

    def _draft(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        """Chain drafts from each sequence's last caught-up MTP output ``hidden [B, dim]``."""
        engine = self.engine
        budgets = [self._budget(s) for s in seqs]
        runner = engine.runner
        for j in range(1, max(budgets, default=0) + 1):
            drafted = runner.output(hidden).float().argmax(-1).tolist()
            for seq, token, budget in zip(seqs, drafted, budgets):
                if j <= budget:
                    self.drafts[seq.seq_id].append(token)
            if j == max(budgets):
                break
            # draft j+1: depth min(j+1, D); depths past D reuse the last one, one position further on
            depth = min(j, len(self.layers) - 1)
            offset = j - depth  # 0 while each draft has a depth of its own
            valid = torch.tensor([[j < b] for b in budgets])
            positions = torch.tensor([[s.length - 2 + offset] for s in seqs]) * valid
            tables = engine._block_tables(seqs, -(-(int(positions.max()) + 1) // engine.config.block_size))
            positions = engine._set_step(tables, positions, valid, seqs)
            tokens = torch.tensor([[d[-1] if d else 0] for d in (self.drafts[s.seq_id] for s in seqs)])
            hidden = self._mtp(depth, tokens, hidden[:, None], positions)[:, 0]

    # ------------------------------------------------------------------ verify

    def decode(self, seqs: list[Sequence]) -> list[StreamEvent]:
        """One verify forward for every running sequence: 1 .. draft_tokens + 1 tokens each."""
        engine = self.engine
        drafts = [self.drafts.get(s.seq_id, [])[: self._budget(s)] for s in seqs]
        b, t = len(seqs), 1 + max(len(d) for d in drafts)
        tokens = torch.zeros(b, t, dtype=torch.long)
        for i, (seq, d) in enumerate(zip(seqs, drafts)):
            tokens[i, : 1 + len(d)] = torch.tensor([seq.last_token, *d])
        valid = torch.arange(t)[None] < torch.tensor([1 + len(d) for d in drafts])[:, None]
        start = torch.tensor([s.length - 1 for s in seqs])[:, None]
        positions = (start + torch.arange(t)[None]) * valid
        tables = engine._block_tables(seqs, -(-int(positions.max() + 1) // engine.config.block_size))
        positions = engine._set_step(tables, positions, valid, seqs)
        hidden = engine.runner.trunk(tokens.to(engine.device), positions, cache=engine._model_cache)[2]
        logits = engine.runner.output(hidden).float()
        events: list[StreamEvent] = []
        going = list(range(b))
        emitted = [0] * b
        for j in range(t):
            if not going:
                break
            events += engine._sample([seqs[i] for i in going], logits[going, j])
            for i in going:
                emitted[i] += 1
            going = [i for i in going if seqs[i].finish_reason is None and j < len(drafts[i])
                     and seqs[i].generated[-1] == drafts[i][j]]
        self.stats.verifies += b
        self.stats.emitted += sum(emitted)
        self.stats.drafted += sum(len(d) for d in drafts)
        self.stats.accepted += sum(emitted) - b
        # depth 1 over the verify columns: column j's next token is the j-th emitted one
        nxt = torch.zeros(b, t, dtype=torch.long)
        for i, seq in enumerate(seqs):
            nxt[i, : emitted[i]] = torch.tensor(seq.generated[len(seq.generated) - emitted[i]:])
        self.catch_up(seqs, nxt, hidden, positions, [e - 1 for e in emitted])
        return events

    def forget(self, seq_ids: Any) -> None:
        """Drop the drafts of sequences no longer running."""
        keep = set(seq_ids)
        for seq_id in [s for s in self.drafts if s not in keep]:
            del self.drafts[seq_id]
