"""The layer-type schedule of hybrid models: which blocks mix tokens by linear attention (Gated
DeltaNet) and which by full attention.

``HybridTransformerConfig.layer_types`` names each block's mixer ("linear_attention" or
"full_attention", Hugging Face's ``layer_types``); left empty it follows ``full_attention_interval``
(every ``interval``-th block is full attention: 4 -> three linear, then one full, as HF's default).
Full-attention blocks use the model's ``attention`` config, linear ones ``linear_attention``; both
sit in the block's ``attention`` slot, so overrides address them by path like any other.
"""

from __future__ import annotations

import dataclasses

from lockstep.config.base import Config, require, require_positive
from lockstep.models.common.attention import AttentionConfig
from lockstep.models.common.gated_deltanet import GatedDeltaNetConfig
from lockstep.models.common.transformer import TransformerConfig

LINEAR, FULL = "linear_attention", "full_attention"
LAYER_TYPES = (LINEAR, FULL)


def interval_layer_types(n_layers: int, full_attention_interval: int) -> list[str]:
    """Block i is full attention when (i + 1) % interval == 0, linear otherwise (HF's rule)."""
    return [FULL if (i + 1) % full_attention_interval == 0 else LINEAR for i in range(n_layers)]


@dataclasses.dataclass(kw_only=True)
class HybridTransformerConfig(TransformerConfig):
    """A TransformerConfig whose blocks mix tokens by linear or full attention per ``layer_types``."""

    #: per block: "linear_attention" or "full_attention"; empty: from full_attention_interval
    layer_types: list[str] = dataclasses.field(default_factory=list)
    #: with layer_types empty, every interval-th block is full attention
    full_attention_interval: int = 4
    #: the token mixer of the linear-attention blocks
    linear_attention: AttentionConfig = dataclasses.field(default_factory=GatedDeltaNetConfig)

    def resolved_layer_types(self) -> list[str]:
        return list(self.layer_types) or interval_layer_types(self.n_layers, self.full_attention_interval)

    def linear_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.resolved_layer_types()) if kind == LINEAR]

    def validate(self, path: str = "model") -> None:
        require_positive(self.full_attention_interval, f"{path}.full_attention_interval")
        if self.layer_types:
            require(len(self.layer_types) == self.n_layers, f"{path}.layer_types",
                    f"has {len(self.layer_types)} entries for n_layers={self.n_layers}")
            bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
            require(not bad, f"{path}.layer_types", f"unknown type(s) {bad}; choose from {list(LAYER_TYPES)}")
        super().validate(path)

    def default_slots(self) -> dict[str, Config]:
        slots = super().default_slots()
        for i in self.linear_layers():
            slots[f"layers.{i}.attention"] = self.linear_attention
        return slots
