"""GPT-OSS <-> Hugging Face ``gpt_oss`` checkpoints (``GptOssForCausalLM``).

Tensor names (transformers 5 writes the in-memory names; the hub checkpoints use the same ones,
with MXFP4 experts, see :mod:`lockstep.models.gpt_oss.mxfp4`)::

    model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}  -> attention.{wq,wk,wv,wo}.{weight,bias}
    model.layers.{i}.self_attn.sinks               [H]       -> attention.sinks
    model.layers.{i}.mlp.router.{weight,bias}      [E, D]    -> feed_forward.gate.{weight,bias}
    model.layers.{i}.mlp.experts.gate_up_proj      [E, D, 2F] gate/up interleaved (even/odd columns)
                                                             -> feed_forward.experts.w1 / w3 [E, F, D]
    model.layers.{i}.mlp.experts.gate_up_proj_bias [E, 2F]   -> feed_forward.experts.b1 / b3 [E, F]
    model.layers.{i}.mlp.experts.down_proj         [E, F, D] -> feed_forward.experts.w2 [E, D, F]
    model.layers.{i}.mlp.experts.down_proj_bias    [E, D]    -> feed_forward.experts.b2

Norms and embeddings are named as in dense Llama (:mod:`lockstep.models.hf.dense`). Conversions
are exact copies (slicing and transposing), so load -> save -> load is bitwise. MXFP4 checkpoints
(``{proj}_blocks`` / ``{proj}_scales``) are dequantised on load; saving writes unquantised weights.
"""

from __future__ import annotations

from typing import Any

import torch

from lockstep.config.base import ConfigError
from lockstep.models.common.moe import MoEConfig
from lockstep.models.common.norm import RMSNormConfig
from lockstep.models.common.transformer import TransformerConfig
from lockstep.models.gpt_oss.config import (
    SLIDING,
    GptOssTransformerConfig,
    alternating_layer_types,
    gpt_oss_attention,
    gpt_oss_moe,
    gpt_oss_rope,
)
from lockstep.models.gpt_oss.mxfp4 import dequantize_mxfp4
from lockstep.models.hf.dense import IGNORED_HF_TENSORS, lockstep_to_hf_name
from lockstep.models.hf.yarn import yarn_rope_from_hf, yarn_rope_to_hf

_NORMS = {"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
_ATTN = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
_EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


class GptOssAdapter:
    """``HFAdapter`` for ``model_type: gpt_oss``."""

    # ---- config -------------------------------------------------------------------------------

    def config_from_hf(self, hf: dict[str, Any]) -> GptOssTransformerConfig:
        if hf.get("model_type", "gpt_oss") != "gpt_oss":
            raise ConfigError(f"config.json model_type {hf['model_type']!r}: this adapter reads 'gpt_oss'")
        quant = hf.get("quantization_config")
        if quant and quant.get("quant_method") != "mxfp4":
            raise ConfigError(f"config.json quantization_config.quant_method={quant.get('quant_method')!r} is not "
                              "supported for gpt_oss (unquantised or mxfp4 experts, dequantised on load)")
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
                   if hf.get(k) is None]
        if missing:
            raise ConfigError(f"config.json lacks required field(s) {missing}")
        n_layers, dim, n_heads = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
        layer_types = list(hf.get("layer_types") or alternating_layer_types(n_layers))
        window = hf.get("sliding_window") or 0
        if SLIDING in layer_types and not window:
            raise ConfigError("config.json sliding_window is unset but layer_types has sliding_attention layers")
        ffn = hf.get("intermediate_size", 2880)
        return GptOssTransformerConfig(
            family="gpt_oss", flavor="hf", vocab_size=hf["vocab_size"], dim=dim, n_layers=n_layers,
            n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or dim // n_heads, ffn_dim=ffn,
            norm_eps=hf.get("rms_norm_eps", 1e-5), max_seq_len=hf.get("max_position_embeddings", 131072),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)), init_std=hf.get("initializer_range", 0.02),
            rope=yarn_rope_from_hf(hf, "gpt_oss", default=_DEFAULT_ROPE),
            attention=gpt_oss_attention(bias=bool(hf.get("attention_bias", True))),
            feed_forward=gpt_oss_moe(hf.get("num_local_experts", hf.get("num_experts", 128)),
                                     hf.get("num_experts_per_tok", 4), ffn, hf.get("swiglu_alpha", 1.702),
                                     hf.get("swiglu_limit", 7.0)),
            layer_types=layer_types, sliding_window=window or 128,
        )

    def config_to_hf(self, config: TransformerConfig) -> dict[str, Any]:
        moe, bias = self._check_representable(config)
        return {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "vocab_size": config.vocab_size,
            "hidden_size": config.dim,
            "intermediate_size": moe.moe_ffn_dim or config.ffn_dim,
            "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads,
            "num_key_value_heads": config.n_kv_heads,
            "head_dim": config.resolved_head_dim,
            "sliding_window": config.sliding_window,
            "layer_types": config.resolved_layer_types(),
            "hidden_act": "silu",
            "max_position_embeddings": config.max_seq_len,
            "initializer_range": config.init_std,
            "rms_norm_eps": config.norm_eps,
            "tie_word_embeddings": config.tie_embeddings,
            "rope_parameters": yarn_rope_to_hf(config.rope, "gpt_oss"),
            "attention_bias": bias,
            "attention_dropout": 0.0,
            "num_local_experts": moe.n_routed_experts,
            "num_experts_per_tok": moe.n_activated,
            "swiglu_alpha": moe.swiglu_alpha,
            "swiglu_limit": moe.swiglu_limit,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        }

    def _check_representable(self, config: TransformerConfig) -> tuple[MoEConfig, bool]:
        """The one MoEConfig of every layer and the attention bias flag; ConfigError naming what HF
        gpt_oss cannot express."""
        if not isinstance(config, GptOssTransformerConfig):
            raise ConfigError(f"model: a {type(config).__name__} is not a gpt_oss config")
        slots, types = config.slots(), config.resolved_layer_types()
        moe, bias = slots["layers.0.feed_forward"], slots["layers.0.attention"].qkv_bias
        for i in range(config.n_layers):
            ff, attn = slots[f"layers.{i}.feed_forward"], slots[f"layers.{i}.attention"]
            if not isinstance(ff, MoEConfig) or ff != moe:
                raise ConfigError(f"model layers.{i}.feed_forward: HF gpt_oss needs one MoE config for all layers")
            window = config.sliding_window if types[i] == SLIDING else 0
            if (not attn.sinks or attn.qk_norm or attn.qkv_bias != bias or attn.o_bias != bias
                    or attn.sliding_window != window):
                raise ConfigError(f"model layers.{i}.attention: HF gpt_oss needs sinks, no q/k norm, q/k/v/o biases "
                                  f"all on or all off, and sliding_window={window} (layer_types)")
        needed = {"score_func": "topk_softmax", "router_bias": True, "expert_bias": True,
                  "activation": "clamped_swiglu", "n_shared_experts": 0, "routed_scaling_factor": 1.0,
                  "routing": "learned"}
        for name, value in needed.items():
            if getattr(moe, name) != value:
                raise ConfigError(f"model.feed_forward.{name}: HF gpt_oss needs {value!r}, got {getattr(moe, name)!r}")
        for path, norm in slots.items():
            if path.endswith("norm") and not (type(norm) is RMSNormConfig and norm.eps in (0.0, config.norm_eps)):
                raise ConfigError(f"model {path}: HF gpt_oss has RMSNorm with eps=norm_eps only")
        return moe, bias

    def stored_hf_shapes(self, expected: dict[str, tuple[int, ...]], hf_config: dict[str, Any]
                         ) -> dict[str, tuple[int, ...]]:
        """The tensors an MXFP4 checkpoint holds instead of the unquantised expert weights."""
        if (hf_config.get("quantization_config") or {}).get("quant_method") != "mxfp4":
            return expected
        out = dict(expected)
        for name in [n for n in expected if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            e, inputs, outputs = out.pop(name)
            out[name + "_blocks"] = (e, outputs, inputs // 32, 16)
            out[name + "_scales"] = (e, outputs, inputs // 32)
        return out

    # ---- state dict ---------------------------------------------------------------------------

    def state_from_hf(self, hf_state: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
        remaining = {k: v for k, v in hf_state.items() if not IGNORED_HF_TENSORS.search(k)}
        out: dict[str, torch.Tensor] = {}
        missing: list[str] = []

        def take(hf_name: str, ls_name: str) -> torch.Tensor | None:
            if hf_name not in remaining:
                missing.append(hf_name)
                return None
            out[ls_name] = remaining.pop(hf_name)
            return out[ls_name]

        if config.tie_embeddings:
            head = remaining.pop("lm_head.weight", None)
            if "model.embed_tokens.weight" not in remaining and head is not None:
                remaining["model.embed_tokens.weight"] = head
        for name in ("tok_embeddings.weight", "norm.weight") + (() if config.tie_embeddings else ("output.weight",)):
            take(lockstep_to_hf_name(name), name)
        if config.tie_embeddings and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        for i in range(config.n_layers):
            hf_p, ls_p = f"model.layers.{i}.", f"layers.{i}."
            for ls, hf in _NORMS.items():
                take(hf_p + hf, ls_p + ls)
            for ls, hf in _ATTN.items():
                for kind in ("weight", "bias") if config.attention.qkv_bias else ("weight",):
                    take(f"{hf_p}self_attn.{hf}.{kind}", f"{ls_p}attention.{ls}.{kind}")
            take(hf_p + "self_attn.sinks", ls_p + "attention.sinks")
            gate = take(hf_p + "mlp.router.weight", ls_p + "feed_forward.gate.weight")
            take(hf_p + "mlp.router.bias", ls_p + "feed_forward.gate.bias")
            out[ls_p + "feed_forward.e_score_correction_bias"] = torch.zeros(
                config.feed_forward.n_routed_experts, dtype=torch.float32,
                device=gate.device if gate is not None else "cpu")
            ex = hf_p + "mlp.experts."
            dtype = remaining[ex + "down_proj_bias"].dtype if ex + "down_proj_bias" in remaining else torch.float32
            for proj in ("gate_up_proj", "down_proj"):
                if ex + proj + "_blocks" in remaining:
                    blocks, scales = remaining.pop(ex + proj + "_blocks"), remaining.pop(ex + proj + "_scales", None)
                    if scales is None:
                        missing.append(ex + proj + "_scales")
                        continue
                    remaining[ex + proj] = dequantize_mxfp4(blocks, scales, dtype)
            if any(ex + t not in remaining for t in _EXPERT_TENSORS):
                missing.extend(ex + t for t in _EXPERT_TENSORS if ex + t not in remaining)
                continue
            gate_up, gate_up_bias = remaining.pop(ex + "gate_up_proj"), remaining.pop(ex + "gate_up_proj_bias")
            out[ls_p + "feed_forward.experts.w1"] = gate_up[..., 0::2].transpose(1, 2).contiguous()
            out[ls_p + "feed_forward.experts.w3"] = gate_up[..., 1::2].transpose(1, 2).contiguous()
            out[ls_p + "feed_forward.experts.b1"] = gate_up_bias[..., 0::2].contiguous()
            out[ls_p + "feed_forward.experts.b3"] = gate_up_bias[..., 1::2].contiguous()
            out[ls_p + "feed_forward.experts.w2"] = remaining.pop(ex + "down_proj").transpose(1, 2).contiguous()
            out[ls_p + "feed_forward.experts.b2"] = remaining.pop(ex + "down_proj_bias")
        if missing or remaining:
            raise ConfigError(
                "gpt_oss checkpoint does not match the config: "
                + (f"missing {_summary(missing)}" if missing else "")
                + ("; " if missing and remaining else "")
                + (f"unexpected {_summary(sorted(remaining))}" if remaining else ""))
        return out

    def state_to_hf(self, state: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
        """lockstep -> HF names and layouts (transformers' in-memory layout is also its file layout)."""
        names = ["tok_embeddings.weight", "norm.weight"] + ([] if config.tie_embeddings else ["output.weight"])
        out: dict[str, torch.Tensor] = {lockstep_to_hf_name(n): state[n] for n in names}
        for i in range(config.n_layers):
            hf_p, ls_p = f"model.layers.{i}.", f"layers.{i}."
            for ls, hf in _NORMS.items():
                out[hf_p + hf] = state[ls_p + ls]
            for ls, hf in _ATTN.items():
                for kind in ("weight", "bias"):
                    if f"{ls_p}attention.{ls}.{kind}" in state:
                        out[f"{hf_p}self_attn.{hf}.{kind}"] = state[f"{ls_p}attention.{ls}.{kind}"]
            out[hf_p + "self_attn.sinks"] = state[ls_p + "attention.sinks"]
            bias = state.get(ls_p + "feed_forward.e_score_correction_bias")
            if bias is not None and not bias.is_meta and bool(bias.any()):
                raise ConfigError(f"{ls_p}feed_forward.e_score_correction_bias is non-zero; HF gpt_oss routing has "
                                  "no selection bias, so the exported model would route differently")
            out[hf_p + "mlp.router.weight"] = state[ls_p + "feed_forward.gate.weight"]
            out[hf_p + "mlp.router.bias"] = state[ls_p + "feed_forward.gate.bias"]
            ex, w = hf_p + "mlp.experts.", {k: state[f"{ls_p}feed_forward.experts.{k}"]
                                            for k in ("w1", "w2", "w3", "b1", "b2", "b3")}
            out[ex + "gate_up_proj"] = torch.stack([w["w1"].transpose(1, 2), w["w3"].transpose(1, 2)],
                                                   dim=-1).flatten(-2)
            out[ex + "gate_up_proj_bias"] = torch.stack([w["b1"], w["b3"]], dim=-1).flatten(-2)
            out[ex + "down_proj"] = w["w2"].transpose(1, 2).contiguous()
            out[ex + "down_proj_bias"] = w["b2"]
        return out


def _summary(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"{len(names)} tensor(s): {shown}" + (", ..." if len(names) > limit else "")
