"""The HF adapter of dense Llama-style decoders (Llama 2/3, SmolLM, Qwen3).

Both sides use the half-rotation RoPE layout, so weights map one to one, by name only:

=====================================================  ===========================================
Hugging Face                                           lockstep
=====================================================  ===========================================
``model.embed_tokens.weight``                          ``tok_embeddings.weight``
``model.layers.{i}.input_layernorm.weight``            ``layers.{i}.attention_norm.weight``
``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``   ``layers.{i}.attention.{wq,wk,wv,wo}.weight``
``model.layers.{i}.self_attn.{q,k}_norm.weight``       ``layers.{i}.attention.{q,k}_norm.weight``
``model.layers.{i}.post_attention_layernorm.weight``   ``layers.{i}.ffn_norm.weight``
``model.layers.{i}.mlp.{gate,up,down}_proj.weight``    ``layers.{i}.feed_forward.{w1,w3,w2}.weight``
``model.norm.weight``                                  ``norm.weight``
``lm_head.weight`` (absent when tied)                  ``output.weight``
=====================================================  ===========================================

Config features lockstep does not implement (other RoPE types, partial rotary, sliding windows,
biases, other activations, quantised weights) raise :class:`ConfigError` naming the field rather
than loading a model that computes something else.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from lockstep.config.base import ConfigError
from lockstep.models.common.attention import AttentionConfig
from lockstep.models.common.mlp import SwiGLUConfig
from lockstep.models.common.norm import RMSNormConfig
from lockstep.models.common.rope import RopeConfig
from lockstep.models.common.transformer import TransformerConfig

#: HF names of tensors that carry no weights (old checkpoints saved the RoPE table), or that belong to
#: parts lockstep does not build (Qwen3-Next/Qwen3.5 MTP heads, Qwen3.5's vision tower); skipped.
IGNORED_HF_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$|^mtp\.|^model\.visual\.")

_LAYER_MAP = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
_LAYER_MAP_INV = {v: k for k, v in _LAYER_MAP.items()}
_GLOBAL_MAP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_GLOBAL_MAP_INV = {v: k for k, v in _GLOBAL_MAP.items()}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")

_ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


def hf_to_lockstep_name(name: str) -> str | None:
    """The lockstep state-dict name of an HF tensor name, or None when it has none."""
    if name in _GLOBAL_MAP:
        return _GLOBAL_MAP[name]
    match = _HF_LAYER.match(name)
    if match and match.group(2) in _LAYER_MAP:
        return f"layers.{match.group(1)}.{_LAYER_MAP[match.group(2)]}"
    return None


def lockstep_to_hf_name(name: str) -> str | None:
    """The HF tensor name of a lockstep state-dict name, or None when it has none."""
    if name in _GLOBAL_MAP_INV:
        return _GLOBAL_MAP_INV[name]
    match = _LS_LAYER.match(name)
    if match and match.group(2) in _LAYER_MAP_INV:
        return f"model.layers.{match.group(1)}.{_LAYER_MAP_INV[match.group(2)]}"
    return None


def _unsupported(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json {field}={value!r} is not supported by lockstep: {why}")


def rope_from_hf(hf: dict[str, Any], default_theta: float = 10000.0) -> RopeConfig:
    """RopeConfig of an HF config: transformers 5 ``rope_parameters`` or legacy ``rope_scaling``
    plus top-level ``rope_theta`` (legacy ``rope_scaling`` wins, as in transformers)."""
    source = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = dict(hf.get(source) or {})
    layer_keys = [k for k in params if isinstance(params[k], dict)]
    if layer_keys:
        raise _unsupported(source, {k: params[k] for k in layer_keys},
                           "per-layer-type RoPE parameters (lockstep uses one RoPE for all layers)")
    theta = params.get("rope_theta", hf.get("rope_theta")) or default_theta
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise _unsupported("partial_rotary_factor", partial, "lockstep rotates the whole head")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type == "llama3":
        missing = [k for k in _LLAMA3_KEYS if params.get(k) is None]
        if missing:
            raise ConfigError(f"config.json {source}: rope_type 'llama3' needs {missing}")
        original = (hf.get("original_max_position_embeddings")
                    or params.get("original_max_position_embeddings")
                    or hf.get("max_position_embeddings"))
        if original is None:
            raise ConfigError(f"config.json {source}: rope_type 'llama3' needs original_max_position_embeddings")
        return RopeConfig(theta=float(theta), scaling="llama3", factor=float(params["factor"]),
                          low_freq_factor=float(params["low_freq_factor"]),
                          high_freq_factor=float(params["high_freq_factor"]),
                          original_max_position_embeddings=int(original))
    raise _unsupported(f"{source}.rope_type", rope_type, f"lockstep implements {list(_ROPE_TYPES)}")


def rope_to_hf(rope: RopeConfig) -> dict[str, Any]:
    if rope.scaling == "none":
        return {"rope_type": "default", "rope_theta": float(rope.theta)}
    if rope.scaling == "llama3":
        return {"rope_type": "llama3", "rope_theta": float(rope.theta), "factor": float(rope.factor),
                "low_freq_factor": float(rope.low_freq_factor),
                "high_freq_factor": float(rope.high_freq_factor),
                "original_max_position_embeddings": int(rope.original_max_position_embeddings)}
    raise ConfigError(f"model.rope.scaling={rope.scaling!r} has no Hugging Face equivalent here")


@dataclasses.dataclass(frozen=True)
class DenseHFAdapter:
    """HFAdapter of one dense family (see :mod:`lockstep.models.hf.adapter`)."""

    #: lockstep family name
    family: str
    #: HF ``model_type`` written to config.json
    model_type: str
    #: HF architecture class written to config.json
    architecture: str
    #: whether the HF architecture has per-head q/k RMSNorm (Qwen3) or not (Llama)
    qk_norm: bool
    #: HF config defaults used when config.json leaves a field out
    default_rms_norm_eps: float = 1e-6
    default_max_position_embeddings: int = 2048
    default_rope_theta: float = 10000.0

    # -- config ---------------------------------------------------------------------------------

    def config_from_hf(self, hf_config: dict[str, Any]) -> TransformerConfig:
        hf = hf_config
        model_type = hf.get("model_type")
        if model_type != self.model_type:
            raise ConfigError(f"config.json model_type {model_type!r}: the {self.family} adapter reads "
                              f"{self.model_type!r}")
        self._check_supported(hf)
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if hf.get(k) is None]
        if missing:
            raise ConfigError(f"config.json lacks required field(s) {missing}")
        dim, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or dim // n_heads)
        return TransformerConfig(
            family=self.family,
            flavor="hf",
            vocab_size=int(hf["vocab_size"]),
            dim=dim,
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=0 if n_heads * head_dim == dim else head_dim,
            ffn_dim=int(hf["intermediate_size"]),
            norm_eps=float(hf.get("rms_norm_eps") or self.default_rms_norm_eps),
            max_seq_len=int(hf.get("max_position_embeddings") or self.default_max_position_embeddings),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope=rope_from_hf(hf, self.default_rope_theta),
            attention=AttentionConfig(qk_norm=self.qk_norm),
            feed_forward=SwiGLUConfig(),
            norm=RMSNormConfig(),
        )

    def _check_supported(self, hf: dict[str, Any]) -> None:
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise _unsupported("hidden_act", act, "lockstep's SwiGLU uses silu")
        if hf.get("attention_bias"):
            raise _unsupported("attention_bias", True,
                               "it adds biases to q/k/v and o_proj; lockstep's attention has no o_proj bias")
        if hf.get("mlp_bias"):
            raise _unsupported("mlp_bias", True, "lockstep's SwiGLU has no biases")
        if hf.get("quantization_config"):
            raise _unsupported("quantization_config", hf["quantization_config"],
                               "quantised checkpoints must be dequantised first")
        if hf.get("use_sliding_window"):
            raise _unsupported("use_sliding_window", True, "lockstep attention is full causal attention")
        layer_types = hf.get("layer_types") or []
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            raise _unsupported("layer_types", other, "lockstep attention is full causal attention")
        if (hf.get("pretraining_tp") or 1) != 1:
            raise _unsupported("pretraining_tp", hf["pretraining_tp"], "only pretraining_tp=1 is exact")

    def config_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        self._check_representable(config)
        head_dim = config.resolved_head_dim
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": config.vocab_size,
            "hidden_size": config.dim,
            "intermediate_size": config.ffn_dim,
            "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads,
            "num_key_value_heads": config.n_kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": config.max_seq_len,
            "rms_norm_eps": config.norm_eps,
            "tie_word_embeddings": config.tie_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rope_parameters": rope_to_hf(config.rope),
            "initializer_range": config.init_std,
            "use_cache": True,
        }
        if self.model_type == "llama":
            out["mlp_bias"] = False
        if self.model_type == "qwen3":
            out.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.n_layers,
                       layer_types=["full_attention"] * config.n_layers)
        return out

    def _check_representable(self, config: TransformerConfig) -> None:
        """Every slot (after overrides) must be something the HF architecture computes."""
        if config.family != self.family:
            raise ConfigError(f"model.family {config.family!r}: this is the {self.family} adapter")
        if self.model_type == "llama" and config.head_dim and config.dim % config.n_heads:
            raise ConfigError(f"model.n_heads={config.n_heads} must divide dim={config.dim} for a "
                              f"transformers LlamaConfig (it checks this even with head_dim set)")
        for path, slot in config.slots().items():
            if path.endswith("attention"):
                if type(slot) is not AttentionConfig:
                    raise ConfigError(f"{path}: {type(slot).__name__} has no {self.architecture} equivalent")
                if slot.qk_norm != self.qk_norm:
                    raise ConfigError(f"{path}.qk_norm={slot.qk_norm}: {self.architecture} "
                                      f"{'always has' if self.qk_norm else 'has no'} q/k norm")
                if slot.qkv_bias:
                    raise ConfigError(f"{path}.qkv_bias=True: {self.architecture} has no q/k/v-only bias")
            elif path.endswith("feed_forward"):
                if type(slot) is not SwiGLUConfig:
                    raise ConfigError(f"{path}: {type(slot).__name__} has no {self.architecture} equivalent")
            elif type(slot) is not RMSNormConfig:
                raise ConfigError(f"{path}: {type(slot).__name__} has no {self.architecture} equivalent")
            elif slot.eps and slot.eps != config.norm_eps:
                raise ConfigError(f"{path}.eps={slot.eps}: HF uses one rms_norm_eps ({config.norm_eps}) "
                                  f"for every norm")

    # -- tensors --------------------------------------------------------------------------------

    def state_from_hf(self, hf_state: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        unknown = []
        for name, tensor in hf_state.items():
            if IGNORED_HF_TENSORS.search(name):
                continue
            target = hf_to_lockstep_name(name)
            if target is None or (not self.qk_norm and ("q_norm" in target or "k_norm" in target)):
                unknown.append(name)
                continue
            out[target] = tensor
        if unknown:
            raise ConfigError(f"tensor(s) with no {self.family} equivalent: {sorted(unknown)}")
        if config.tie_embeddings:
            head = out.pop("output.weight", None)
            embed = out.get("tok_embeddings.weight")
            if head is not None and embed is not None and not torch.equal(head, embed):
                raise ConfigError("tie_word_embeddings is true but lm_head.weight differs from "
                                  "model.embed_tokens.weight")
            if embed is None and head is not None:
                out["tok_embeddings.weight"] = head
            if "tok_embeddings.weight" in out:
                out["output.weight"] = out["tok_embeddings.weight"]
        return out

    def state_to_hf(self, state: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        unknown = []
        for name, tensor in state.items():
            if config.tie_embeddings and name == "output.weight":
                continue  # transformers re-ties lm_head to the embedding; the file holds it once
            target = lockstep_to_hf_name(name)
            if target is None:
                unknown.append(name)
                continue
            out[target] = tensor
        if unknown:
            raise ConfigError(f"lockstep tensor(s) with no {self.architecture} equivalent: {sorted(unknown)}")
        return out
