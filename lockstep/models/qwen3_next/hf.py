"""Qwen3-Next / Qwen3.5 <-> Hugging Face checkpoints (the ``HFAdapter`` of both hybrid families).

Model types read: ``qwen3_next`` (``Qwen3NextForCausalLM``), ``qwen3_5_text`` / ``qwen3_5_moe_text``
(``Qwen3_5[Moe]ForCausalLM``) and the text part of the multimodal ``qwen3_5`` / ``qwen3_5_moe``
(``text_config``, weights under ``model.language_model.``; ``model.visual.*`` and ``mtp.*`` are
skipped here: :mod:`lockstep.models.qwen3_5.hf` reads the multimodal checkpoints with their tower).
Per block (``model.layers.{i}.``, lockstep ``layers.{i}.``)::

    input_layernorm / post_attention_layernorm        -> attention_norm / ffn_norm
    self_attn.{q,k,v,o}_proj, q_norm, k_norm           -> attention.{wq,wk,wv,wo}, q_norm, k_norm
    linear_attn.<p> (in_proj_*, conv1d, dt_bias, A_log, norm) -> attention.<p>;  out_proj -> attention.wo
    mlp.{gate,up,down}_proj                            -> feed_forward.w1/w3/w2 (dense layers)
    mlp.gate, mlp.shared_expert.*, mlp.shared_expert_gate -> feed_forward.gate, shared_experts.*, shared_expert_gate
    mlp.experts.{e}.{gate,up,down}_proj  (or fused gate_up_proj [E, 2F, D] / down_proj)  -> experts.w1/w3/w2

Tensors are copied as they are (zero-centred norms store scale - 1 on both sides), so a
load -> save -> load round trip is bitwise.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lockstep.config.base import ConfigError
from lockstep.models.common.gated_attention import GatedAttentionConfig, PartialRopeConfig
from lockstep.models.common.gated_deltanet import GatedDeltaNetConfig
from lockstep.models.common.hybrid import FULL, LINEAR
from lockstep.models.common.mlp import SwiGLUConfig
from lockstep.models.common.moe import MoEConfig
from lockstep.models.common.norm import ZeroCenteredRMSNormConfig
from lockstep.models.hf.dense import IGNORED_HF_TENSORS
from lockstep.models.qwen3_next.config import Qwen3NextTransformerConfig, hybrid_config

#: HF model_type -> (lockstep family, is the multimodal wrapper)
MODEL_TYPES = {"qwen3_next": ("qwen3_next", False), "qwen3_5_text": ("qwen3_5", False),
               "qwen3_5_moe_text": ("qwen3_5", False), "qwen3_5": ("qwen3_5", True),
               "qwen3_5_moe": ("qwen3_5", True)}
_LINEAR_PARAMS = {"grouped": ["in_proj_qkvz", "in_proj_ba"],
                  "split": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]}
_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _rope_from_hf(hf: dict[str, Any]) -> PartialRopeConfig:
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"config.json rope_parameters.rope_type={rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    return PartialRopeConfig(theta=float(theta), partial_rotary_factor=float(partial))


class HybridHFAdapter:
    """``HFAdapter`` of ``family`` ("qwen3_next" or "qwen3_5")."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.projection = "grouped" if family == "qwen3_next" else "split"

    # ---- config -------------------------------------------------------------------------------

    def config_from_hf(self, hf_config: dict[str, Any]) -> Qwen3NextTransformerConfig:
        model_type = hf_config.get("model_type")
        if MODEL_TYPES.get(model_type, (None,))[0] != self.family:
            raise ConfigError(f"config.json model_type {model_type!r}: the {self.family} adapter reads "
                              f"{[t for t, (f, _) in MODEL_TYPES.items() if f == self.family]}")
        multimodal = MODEL_TYPES[model_type][1]
        hf = hf_config.get("text_config") if multimodal else hf_config
        if not isinstance(hf, dict):
            raise ConfigError(f"config.json: model_type {model_type!r} needs a text_config object")
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
                   if hf.get(k) is None]
        if missing:
            raise ConfigError(f"config.json lacks required field(s) {missing}")
        if hf.get("attention_bias"):
            raise ConfigError("config.json attention_bias=true is not supported by lockstep's qwen3_next/qwen3_5")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json hidden_act={hf['hidden_act']!r}: only 'silu' is supported")
        is_moe = hf.get("model_type") in ("qwen3_next", "qwen3_5_moe_text") and bool(hf.get("num_experts", 0))
        moe = dict(n_experts=hf["num_experts"], top_k=hf.get("num_experts_per_tok", 8),
                   moe_ffn_dim=hf.get("moe_intermediate_size", 512),
                   shared_ffn_dim=hf.get("shared_expert_intermediate_size", 512),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", True))) if is_moe else {}
        n_layers, dim, n_heads = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
        config = hybrid_config(
            self.family, "hf", projection=self.projection,
            linear_heads=(hf.get("linear_num_key_heads", 16), hf.get("linear_num_value_heads", 32)),
            linear_head_dims=(hf.get("linear_key_head_dim", 128), hf.get("linear_value_head_dim", 128)),
            conv_kernel=hf.get("linear_conv_kernel_dim", 4), **moe,
            rope_theta=_rope_from_hf(hf).theta, partial_rotary_factor=_rope_from_hf(hf).partial_rotary_factor,
            full_attention_interval=hf.get("full_attention_interval", 4),
            vocab_size=hf["vocab_size"], dim=dim, n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads", n_heads), head_dim=hf.get("head_dim") or dim // n_heads,
            ffn_dim=hf.get("intermediate_size") or 512, max_seq_len=hf.get("max_position_embeddings", 32768),
            tie_embeddings=bool(hf_config.get("tie_word_embeddings", hf.get("tie_word_embeddings", False))),
            init_std=hf.get("initializer_range", 0.02),
            layer_types=list(hf.get("layer_types") or []),
            decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
            mlp_only_layers=list(hf.get("mlp_only_layers") or []),
            hf_multimodal=multimodal, norm_eps=hf.get("rms_norm_eps", 1e-6),
        )
        return config

    def config_to_hf(self, config: Qwen3NextTransformerConfig) -> dict[str, Any]:
        linear, moe = self._check_representable(config)
        text: dict[str, Any] = {
            "vocab_size": config.vocab_size, "hidden_size": config.dim, "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
            "head_dim": config.resolved_head_dim, "hidden_act": "silu",
            "max_position_embeddings": config.max_seq_len, "initializer_range": config.init_std,
            "rms_norm_eps": config.norm_eps, "tie_word_embeddings": config.tie_embeddings,
            "attention_bias": False, "attention_dropout": 0.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": float(config.rope.theta),
                                "partial_rotary_factor": float(config.rope.partial_rotary_factor)},
            "layer_types": config.resolved_layer_types(),
            "linear_conv_kernel_dim": linear.conv_kernel, "linear_key_head_dim": linear.k_head_dim,
            "linear_value_head_dim": linear.v_head_dim, "linear_num_key_heads": linear.n_k_heads,
            "linear_num_value_heads": linear.n_v_heads,
        }
        if moe is not None:
            text.update(num_experts=moe.n_routed_experts, num_experts_per_tok=moe.n_activated,
                        moe_intermediate_size=moe.moe_ffn_dim or config.ffn_dim,
                        shared_expert_intermediate_size=moe.shared_ffn_dim or moe.moe_ffn_dim or config.ffn_dim,
                        router_aux_loss_coef=0.001, output_router_logits=False)
        if self.family == "qwen3_next":
            text.update(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"],
                        intermediate_size=config.ffn_dim, decoder_sparse_step=config.decoder_sparse_step,
                        mlp_only_layers=list(config.mlp_only_layers),
                        norm_topk_prob=moe.norm_topk_prob if moe else True)
            if moe is None:
                text.update(num_experts=0, num_experts_per_tok=1)
            return text
        if config.rope.rotary_dim(config.resolved_head_dim) == 64:  # the published Qwen3.5 sections
            text["rope_parameters"].update(mrope_section=[11, 11, 10], mrope_interleaved=True)
        kind = "qwen3_5_moe" if moe is not None else "qwen3_5"
        arch = "Qwen3_5MoeForCausalLM" if moe is not None else "Qwen3_5ForCausalLM"
        if moe is None:
            text["intermediate_size"] = config.ffn_dim
        if not config.hf_multimodal:
            return {**text, "model_type": f"{kind}_text", "architectures": [arch]}
        text["model_type"] = f"{kind}_text"
        return {"model_type": kind, "architectures": [arch.replace("ForCausalLM", "ForConditionalGeneration")],
                "text_config": text, "tie_word_embeddings": config.tie_embeddings}

    def _check_representable(self, config: Any) -> tuple[GatedDeltaNetConfig, MoEConfig | None]:
        """The one linear-attention config and the one MoE config (or None); ConfigError naming
        the slot that HF's layout cannot express."""
        if not isinstance(config, Qwen3NextTransformerConfig) or config.family != self.family:
            raise ConfigError(f"model.family: the {self.family} adapter needs a {self.family} config")
        slots, types = config.slots(), config.resolved_layer_types()
        linear: GatedDeltaNetConfig | None = None
        moe: MoEConfig | None = None
        dense = False
        for i, kind in enumerate(types):
            attn, ff = slots[f"layers.{i}.attention"], slots[f"layers.{i}.feed_forward"]
            if kind == LINEAR:
                if type(attn) is not GatedDeltaNetConfig or attn.projection != self.projection:
                    raise ConfigError(f"model layers.{i}.attention: HF {self.family} needs a GatedDeltaNet "
                                      f"with projection={self.projection!r}")
                if linear is not None and _differ(attn, linear, "chunk_size", "backend"):
                    raise ConfigError(f"model layers.{i}.attention: HF {self.family} needs one linear-attention config")
                linear = linear or attn
            elif type(attn) is not GatedAttentionConfig or not (attn.qk_norm and attn.output_gate
                                                                 and attn.zero_centered_norm) or attn.qkv_bias:
                raise ConfigError(f"model layers.{i}.attention: HF {self.family} needs gated attention with "
                                  "zero-centred q/k norm and no bias")
            if isinstance(ff, MoEConfig):
                if moe is not None and ff != moe:
                    raise ConfigError(f"model layers.{i}.feed_forward: HF {self.family} needs one MoE config")
                if not (ff.n_shared_experts == 1 and ff.shared_expert_gate and ff.score_func == "softmax"
                        and ff.routed_scaling_factor == 1.0 and ff.n_group == 1 and ff.routing == "learned"):
                    raise ConfigError(f"model layers.{i}.feed_forward: HF {self.family} MoE is softmax top-k with "
                                      "one sigmoid-gated shared expert (n_shared_experts=1, shared_expert_gate)")
                moe = ff
            elif type(ff) is SwiGLUConfig:
                dense = True
            else:
                raise ConfigError(f"model layers.{i}.feed_forward: {type(ff).__name__} has no HF {self.family} form")
        bad = [i for i in range(config.n_layers)
               if moe is not None and isinstance(slots[f"layers.{i}.feed_forward"], MoEConfig) != config.is_moe_layer(i)]
        if bad:
            raise ConfigError(f"model layers.{bad[0]}.feed_forward: dense/MoE does not follow "
                              "decoder_sparse_step/mlp_only_layers as HF does")
        if linear is None:
            linear = config.linear_attention  # all-full-attention models still write the linear fields
        for path, norm in slots.items():
            if path.endswith("norm") and not (type(norm) is ZeroCenteredRMSNormConfig and norm.eps in (0.0, config.norm_eps)):
                raise ConfigError(f"model {path}: HF {self.family} has zero-centred RMSNorm with eps=norm_eps only")
        if self.family == "qwen3_5" and moe is not None and (dense or not moe.norm_topk_prob):
            raise ConfigError("model.feed_forward: HF qwen3_5_moe has every layer MoE with norm_topk_prob=True")
        if not isinstance(config.rope, PartialRopeConfig) or config.rope.scaling != "none":
            raise ConfigError(f"model.rope: HF {self.family} needs plain partial RoPE (PartialRopeConfig, no scaling)")
        return linear, moe

    # ---- state dict ---------------------------------------------------------------------------

    def _pairs(self, config: Qwen3NextTransformerConfig) -> list[tuple[str, str]]:
        """(HF name, lockstep name) of every tensor copied 1:1 (routed experts are apart)."""
        top = "model.language_model." if config.hf_multimodal else "model."
        pairs = [(top + "embed_tokens.weight", "tok_embeddings.weight"), (top + "norm.weight", "norm.weight")]
        if not config.tie_embeddings:
            pairs.append(("lm_head.weight", "output.weight"))
        slots = config.slots()
        for i, kind in enumerate(config.resolved_layer_types()):
            hf, ls = f"{top}layers.{i}.", f"layers.{i}."
            pairs += [(hf + "input_layernorm.weight", ls + "attention_norm.weight"),
                      (hf + "post_attention_layernorm.weight", ls + "ffn_norm.weight")]
            if kind == FULL:
                pairs += [(f"{hf}self_attn.{p}_proj.weight", f"{ls}attention.w{p}.weight") for p in "qkvo"]
                pairs += [(f"{hf}self_attn.{n}.weight", f"{ls}attention.{n}.weight") for n in ("q_norm", "k_norm")]
            else:
                proj = slots[f"{ls}attention"].projection
                names = [f"{p}.weight" for p in _LINEAR_PARAMS[proj]] + ["conv1d.weight", "dt_bias", "A_log",
                                                                         "norm.weight"]
                pairs += [(f"{hf}linear_attn.{n}", f"{ls}attention.{n}") for n in names]
                pairs.append((f"{hf}linear_attn.out_proj.weight", f"{ls}attention.wo.weight"))
            if isinstance(slots[f"{ls}feed_forward"], MoEConfig):
                pairs.append((f"{hf}mlp.gate.weight", f"{ls}feed_forward.gate.weight"))
                pairs += [(f"{hf}mlp.shared_expert.{p}.weight", f"{ls}feed_forward.shared_experts.{w}.weight")
                          for w, p in _EXPERT_PROJ.items()]
                pairs.append((f"{hf}mlp.shared_expert_gate.weight", f"{ls}feed_forward.shared_expert_gate.weight"))
            else:
                pairs += [(f"{hf}mlp.{p}.weight", f"{ls}feed_forward.{w}.weight") for w, p in _EXPERT_PROJ.items()]
        return pairs

    def _moe_layers(self, config: Qwen3NextTransformerConfig) -> dict[int, MoEConfig]:
        slots = config.slots()
        return {i: ff for i in range(config.n_layers) if isinstance(ff := slots[f"layers.{i}.feed_forward"], MoEConfig)}

    def state_from_hf(self, hf_state: dict[str, torch.Tensor], config: Qwen3NextTransformerConfig
                      ) -> dict[str, torch.Tensor]:
        remaining = {k: v for k, v in hf_state.items() if not IGNORED_HF_TENSORS.search(k)}
        top = "model.language_model." if config.hf_multimodal else "model."
        if config.tie_embeddings:
            head = remaining.pop("lm_head.weight", None)
            if top + "embed_tokens.weight" not in remaining and head is not None:
                remaining[top + "embed_tokens.weight"] = head
        out: dict[str, torch.Tensor] = {}
        missing: list[str] = []
        for hf_name, ls_name in self._pairs(config):
            if hf_name in remaining:
                out[ls_name] = remaining.pop(hf_name)
            else:
                missing.append(hf_name)
        if config.tie_embeddings and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        for i, moe in self._moe_layers(config).items():
            experts, ls = f"{top}layers.{i}.mlp.experts.", f"layers.{i}.feed_forward."
            device = out[ls + "gate.weight"].device if ls + "gate.weight" in out else "cpu"
            out[ls + "e_score_correction_bias"] = torch.zeros(moe.n_routed_experts, dtype=torch.float32, device=device)
            if experts + "gate_up_proj" in remaining:  # fused layout (transformers' in-memory form)
                w1, w3 = remaining.pop(experts + "gate_up_proj").chunk(2, dim=1)
                out[ls + "experts.w1"], out[ls + "experts.w3"] = w1.contiguous(), w3.contiguous()
                if experts + "down_proj" in remaining:
                    out[ls + "experts.w2"] = remaining.pop(experts + "down_proj")
                else:
                    missing.append(experts + "down_proj")
                continue
            for w, proj in _EXPERT_PROJ.items():
                names = [f"{experts}{e}.{proj}.weight" for e in range(moe.n_routed_experts)]
                absent = [n for n in names if n not in remaining]
                if absent:
                    missing.extend(absent)
                    continue
                out[ls + f"experts.{w}"] = torch.stack([remaining.pop(n) for n in names])
        if missing or remaining:
            raise ConfigError(f"{self.family} checkpoint does not match the config: "
                              + (f"missing {_summary(missing)}" if missing else "")
                              + ("; " if missing and remaining else "")
                              + (f"unexpected {_summary(sorted(remaining))}" if remaining else ""))
        return out

    def state_to_hf(self, state: dict[str, torch.Tensor], config: Qwen3NextTransformerConfig,
                    fused_experts: bool = False) -> dict[str, torch.Tensor]:
        """lockstep -> HF names; routed experts one tensor per expert as on disk (copies: safetensors
        refuses shared storage), or transformers' fused in-memory layout with ``fused_experts``."""
        out = {hf: state[ls] for hf, ls in self._pairs(config)}
        top = "model.language_model." if config.hf_multimodal else "model."
        for i in self._moe_layers(config):
            experts, ls = f"{top}layers.{i}.mlp.experts.", f"layers.{i}.feed_forward."
            bias = state.get(ls + "e_score_correction_bias")
            if bias is not None and not bias.is_meta and bool(bias.any()):
                raise ConfigError(f"{ls}e_score_correction_bias is non-zero; HF {self.family} routing has no "
                                  "selection bias, so the exported model would route differently")
            w = {k: state[f"{ls}experts.{k}"] for k in _EXPERT_PROJ}
            if fused_experts:
                out[experts + "gate_up_proj"] = torch.cat([w["w1"], w["w3"]], dim=1)
                out[experts + "down_proj"] = w["w2"]
                continue
            for name, proj in _EXPERT_PROJ.items():
                for e in range(w[name].shape[0]):
                    out[f"{experts}{e}.{proj}.weight"] = w[name][e].clone()
        return out


def _differ(a: Any, b: Any, *ignored: str) -> bool:
    """Whether two configs differ outside ``ignored`` fields (knobs that keep the function)."""
    return dataclasses.replace(a, **{name: getattr(b, name) for name in ignored}) != b


def _summary(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"{len(names)} tensor(s): {shown}" + (", ..." if len(names) > limit else "")
