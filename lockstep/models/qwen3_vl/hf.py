"""Qwen3-VL <-> Hugging Face ``qwen3_vl`` / ``qwen3_vl_moe`` checkpoints (``Qwen3VL[Moe]ForConditionalGeneration``).

Names: the text decoder is dense Qwen3 / Qwen3-MoE under ``model.language_model.`` (converted by the
Qwen3-MoE adapter after swapping the prefix; experts in transformers 5's fused layout
``mlp.experts.gate_up_proj [E, 2F, D]`` / ``down_proj [E, D, F]``, which ``save_pretrained`` writes; the
released hub files hold them transposed, ``[E, D, 2F]`` / ``[E, F, D]``, which ``state_from_hf`` reads
too, as transformers does, by shape). ``lm_head.weight`` is the head. The vision tower keeps
transformers' module names, ``model.visual.X`` <-> ``visual.X``; only the patch embedding's Conv3d
weight ``[dim, C, tp, p, p]`` is held flat, ``[dim, C*tp*p*p]`` (a reshape: round trips are bitwise).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lockstep.config.base import ConfigError
from lockstep.models.common.moe import MoEConfig
from lockstep.models.common.mrope import MRopeConfig
from lockstep.models.common.vision import VisionConfig
from lockstep.models.qwen3_moe.hf import Qwen3MoEAdapter, _moe_layers
from lockstep.models.qwen3_vl.config import Qwen3VLConfig, qwen3_vl_config

_TEXT_HF, _TEXT_FLAT = "model.language_model.", "model."
_VISION_HF, _VISION_LS = "model.visual.", "visual."
_PATCH = "patch_embed.proj.weight"
_TEXT = Qwen3MoEAdapter()  # the text decoder's tensors are Qwen3(-MoE)'s


def _unsupported(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json {field}={value!r} is not supported by lockstep: {why}")


def vision_from_hf(v: dict[str, Any], deepstack: bool = True) -> VisionConfig:
    """The tower of a ``vision_config`` (Qwen3-VL, or Qwen3.5 with ``deepstack=False``: no DeepStack)."""
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise _unsupported("vision_config.hidden_act", act, "the vision MLP is GELU (tanh approximation)")
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise _unsupported("vision_config.rope_parameters.rope_type", rope["rope_type"], "only axial 2-D RoPE")
    return VisionConfig(depth=v.get("depth", 27), dim=v.get("hidden_size", 1152),
                        ffn_dim=v.get("intermediate_size", 4304), n_heads=v.get("num_heads", 16),
                        in_channels=v.get("in_channels", 3),
                        patch_size=v.get("patch_size", 16), temporal_patch_size=v.get("temporal_patch_size", 2),
                        spatial_merge_size=v.get("spatial_merge_size", 2),
                        num_position_embeddings=v.get("num_position_embeddings", 2304),
                        deepstack_layers=list(v.get("deepstack_visual_indexes", [8, 16, 24])) if deepstack else [],
                        rope_theta=float(rope.get("rope_theta", 10000.0)))


def vision_to_hf(v: VisionConfig, *, model_type: str, out_dim: int, init_std: float, deepstack: bool = True
                 ) -> dict[str, Any]:
    """``vision_config`` of a tower (``deepstack=False``: Qwen3.5's, without ``deepstack_visual_indexes``)."""
    vision = {
        "model_type": model_type, "depth": v.depth, "hidden_size": v.dim,
        "intermediate_size": v.ffn_dim, "num_heads": v.n_heads, "in_channels": v.in_channels,
        "patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size,
        "spatial_merge_size": v.spatial_merge_size, "out_hidden_size": out_dim,
        "num_position_embeddings": v.num_position_embeddings,
        "hidden_act": "gelu_pytorch_tanh", "initializer_range": init_std,
        "rope_parameters": {"rope_type": "axial", "rope_theta": float(v.rope_theta)},
    }
    if deepstack:
        vision["deepstack_visual_indexes"] = list(v.deepstack_layers)
    elif v.deepstack_layers:
        raise ConfigError(f"model.vision.deepstack_layers: {model_type} has no DeepStack, got {v.deepstack_layers}")
    return vision


def split_vision_state(hf_state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the tower's tensors under lockstep names, every other tensor as it was): ``model.visual.X`` ->
    ``visual.X``, the patch embedding's Conv3d weight flattened to ``[dim, C*tp*p*p]``."""
    vision, rest = {}, {}
    for name, tensor in hf_state.items():
        if name.startswith(_VISION_HF):
            short = name[len(_VISION_HF):]
            vision[_VISION_LS + short] = tensor.flatten(1) if short == _PATCH else tensor
        else:
            rest[name] = tensor
    return vision, rest


def vision_state_to_hf(state: dict[str, torch.Tensor], v: VisionConfig
                       ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the tower's tensors under HF names, every other lockstep tensor): the inverse of :func:`split_vision_state`."""
    vision, rest = {}, {}
    for name, tensor in state.items():
        if not name.startswith(_VISION_LS):
            rest[name] = tensor
            continue
        short = name[len(_VISION_LS):]
        if short == _PATCH:
            tensor = tensor.view(v.dim, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        vision[_VISION_HF + short] = tensor
    return vision, rest


class Qwen3VLAdapter:
    """``HFAdapter`` for ``model_type: qwen3_vl`` and ``qwen3_vl_moe``."""

    # ---- config -------------------------------------------------------------------------------

    def config_from_hf(self, hf_config: dict[str, Any]) -> Qwen3VLConfig:
        hf = hf_config
        model_type = hf.get("model_type")
        if model_type not in ("qwen3_vl", "qwen3_vl_moe"):
            raise ConfigError(f"config.json model_type {model_type!r}: this adapter reads qwen3_vl / qwen3_vl_moe")
        text, vision = hf.get("text_config") or {}, hf.get("vision_config") or {}
        for field, value, ok in (("hidden_act", text.get("hidden_act", "silu"), ("silu", "swish")),
                                 ("attention_bias", bool(text.get("attention_bias")), (False,))):
            if value not in ok:
                raise _unsupported(f"text_config.{field}", value, f"lockstep's Qwen3 decoder needs {ok[0]!r}")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
            raise _unsupported("text_config.rope_parameters.rope_type", rope.get("rope_type"), "only default mRoPE")
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in text]
        if missing:
            raise ConfigError(f"config.json text_config lacks required field(s) {missing}")
        out_dim = vision.get("out_hidden_size", 3584)
        if out_dim != text["hidden_size"]:
            raise ConfigError(f"config.json vision_config.out_hidden_size={out_dim} must equal text_config.hidden_size="
                              f"{text['hidden_size']}")
        moe = {}
        if model_type == "qwen3_vl_moe":
            moe = dict(n_experts=text.get("num_experts", text.get("num_local_experts", 60)),
                       top_k=text.get("num_experts_per_tok", 4), moe_ffn_dim=text.get("moe_intermediate_size", 1408))
        n_heads = text["num_attention_heads"]
        config = qwen3_vl_config(
            "hf", vision=vision_from_hf(vision), mrope_section=list(rope.get("mrope_section", [24, 20, 20])),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 500000.0))), **moe,
            vocab_size=text["vocab_size"], dim=text["hidden_size"], n_layers=text["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=text.get("num_key_value_heads") or n_heads,
            head_dim=text.get("head_dim") or text["hidden_size"] // n_heads,
            ffn_dim=text.get("intermediate_size", 22016),
            norm_eps=text.get("rms_norm_eps", 1e-6), max_seq_len=text.get("max_position_embeddings", 128000),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)), init_std=text.get("initializer_range", 0.02),
            decoder_sparse_step=text.get("decoder_sparse_step", 1),
            mlp_only_layers=list(text.get("mlp_only_layers") or []),
            image_token_id=hf.get("image_token_id", 151655), video_token_id=hf.get("video_token_id", 151656),
            vision_start_token_id=hf.get("vision_start_token_id", 151652),
            vision_end_token_id=hf.get("vision_end_token_id", 151653))
        return config

    def config_to_hf(self, config: Qwen3VLConfig) -> dict[str, Any]:
        if not isinstance(config, Qwen3VLConfig) or not isinstance(config.rope, MRopeConfig):
            raise ConfigError("model: the qwen3_vl adapter writes Qwen3VLConfig models with mRoPE only")
        moe = self._moe(config)
        suffix = "_moe" if moe else ""
        text: dict[str, Any] = {
            "model_type": f"qwen3_vl{suffix}_text", "vocab_size": config.vocab_size, "hidden_size": config.dim,
            "intermediate_size": config.ffn_dim, "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
            "head_dim": config.resolved_head_dim, "hidden_act": "silu", "max_position_embeddings": config.max_seq_len,
            "initializer_range": config.init_std, "rms_norm_eps": config.norm_eps, "attention_bias": False,
            "attention_dropout": 0.0, "tie_word_embeddings": config.tie_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": float(config.rope.theta),
                                "mrope_section": list(config.rope.mrope_section), "mrope_interleaved": True},
        }
        if moe:
            text.update(num_experts=moe.n_routed_experts, num_experts_per_tok=moe.n_activated,
                        moe_intermediate_size=moe.moe_ffn_dim, decoder_sparse_step=config.decoder_sparse_step,
                        mlp_only_layers=list(config.mlp_only_layers))
        vision = vision_to_hf(config.vision, model_type=f"qwen3_vl{suffix}_vision", out_dim=config.dim,
                              init_std=config.init_std)
        arch = "Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"
        return {"architectures": [arch], "model_type": f"qwen3_vl{suffix}", "text_config": text,
                "vision_config": vision, "tie_word_embeddings": config.tie_embeddings,
                "image_token_id": config.image_token_id, "video_token_id": config.video_token_id,
                "vision_start_token_id": config.vision_start_token_id,
                "vision_end_token_id": config.vision_end_token_id}

    @staticmethod
    def _moe(config: Qwen3VLConfig) -> MoEConfig | None:
        """The MoE config every MoE layer shares (None: dense); ConfigError for what HF cannot express."""
        layers = _moe_layers(config)
        kinds = {dataclasses.astuple(m) for m in layers.values()}
        if len(kinds) > 1:
            raise ConfigError("model feed_forward: HF qwen3_vl_moe needs one MoE config for all MoE layers")
        moe = next(iter(layers.values()), None)
        if moe is not None:
            wanted = {"score_func": "softmax", "norm_topk_prob": True, "n_shared_experts": 0,
                      "routed_scaling_factor": 1.0, "n_group": 1, "routing": "learned"}
            for name, needed in wanted.items():
                if getattr(moe, name) != needed:
                    raise ConfigError(f"model.feed_forward.{name}: HF qwen3_vl_moe needs {needed!r}, "
                                      f"got {getattr(moe, name)!r}")
        return moe

    # ---- state dict ---------------------------------------------------------------------------

    def state_from_hf(self, hf_state: dict[str, torch.Tensor], config: Qwen3VLConfig) -> dict[str, torch.Tensor]:
        out, rest = split_vision_state(hf_state)
        text: dict[str, torch.Tensor] = {}
        for name, tensor in rest.items():
            text[_TEXT_FLAT + name[len(_TEXT_HF):] if name.startswith(_TEXT_HF) else name] = tensor
        for i, moe in _moe_layers(config).items():  # hub files: experts transposed (transformers reads both)
            key = f"model.layers.{i}.mlp.experts."
            gate_up, down = text.get(key + "gate_up_proj"), text.get(key + "down_proj")
            if gate_up is not None and gate_up.shape[1] != 2 * moe.moe_ffn_dim:
                text[key + "gate_up_proj"] = gate_up.transpose(1, 2)
            if down is not None and down.shape[2] != moe.moe_ffn_dim:
                text[key + "down_proj"] = down.transpose(1, 2)
        out.update(_TEXT.state_from_hf(text, config))
        return out

    def state_to_hf(self, state: dict[str, torch.Tensor], config: Qwen3VLConfig) -> dict[str, torch.Tensor]:
        out, text = vision_state_to_hf(state, config.vision)
        for name, tensor in _TEXT.state_to_hf(text, config, fused_experts=True).items():
            out[_TEXT_HF + name[len(_TEXT_FLAT):] if name.startswith(_TEXT_FLAT) else name] = tensor
        return out


ADAPTER = Qwen3VLAdapter()
