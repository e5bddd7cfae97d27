"""Kimi K2.5 <-> Hugging Face ``kimi_k25`` checkpoints (transformers' ``Kimi_K25ForConditionalGeneration``).

Config: ``text_config`` is DeepSeek-V3's (``model_type`` ``deepseek_v3`` or ``kimi_k2``), read and written by
:class:`~lockstep.models.deepseek_v3.hf.DeepSeekV3Adapter`; the top-level ``tie_word_embeddings`` (default
True in transformers) decides the head tying. ``vision_config`` uses transformers' field names.

Tensors: the text decoder under ``model.language_model.`` (converted by the DeepSeek-V3 adapter after
swapping the prefix), ``lm_head.weight`` the head. MoonViT (``model.vision_tower.``) and the projector
(``model.mm_projector.``) map as:

=================================================  ==============================================
HF                                                 lockstep
=================================================  ==============================================
vision_tower.patch_embed.proj.weight [D, C, p, p]  visual.patch_embed.proj.weight [D, C*p*p] (reshape)
vision_tower.patch_embed.pos_emb.position_embeddings  visual.pos_embed [side, side, D]
vision_tower.layers.{i}.attn.{q,k,v}_proj          visual.blocks.{i}.attn.qkv (concatenated on dim 0)
vision_tower.layers.{i}.mlp.fc1 / fc2              visual.blocks.{i}.mlp.linear_fc1 / linear_fc2
vision_tower.layers.{i}.norm1 / norm2 / attn.proj  visual.blocks.{i}.(same)
vision_tower.final_layernorm                       visual.final_norm
mm_projector.{pre_norm, in_proj, out_proj}         visual.projector.(same)
=================================================  ==============================================

Every conversion is a reshape, a concatenation or a split: load -> save -> load is bitwise.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from lockstep.config.base import ConfigError
from lockstep.models.common.moonvit import MoonViTConfig
from lockstep.models.deepseek_v3.hf import DeepSeekV3Adapter
from lockstep.models.kimi_k25.config import KimiK25Config, kimi_k25_config

_TEXT_HF, _TEXT_FLAT = "model.language_model.", "model."
_TOWER_HF, _PROJ_HF, _VISUAL = "model.vision_tower.", "model.mm_projector.", "visual."
_TEXT = DeepSeekV3Adapter()
_RENAMES = [  # (HF name under the tower, lockstep name under visual.), regex over the remainder
    (r"patch_embed\.proj\.(weight|bias)", r"patch_embed.proj.\1"),
    (r"patch_embed\.pos_emb\.position_embeddings", "pos_embed"),
    (r"layers\.(\d+)\.mlp\.fc1\.(weight|bias)", r"blocks.\1.mlp.linear_fc1.\2"),
    (r"layers\.(\d+)\.mlp\.fc2\.(weight|bias)", r"blocks.\1.mlp.linear_fc2.\2"),
    (r"layers\.(\d+)\.(norm1|norm2|attn\.proj)\.(weight|bias)", r"blocks.\1.\2.\3"),
    (r"final_layernorm\.(weight|bias)", r"final_norm.\1"),
]
_QKV = re.compile(r"layers\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)")


def _unsupported(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json {field}={value!r} is not supported by lockstep: {why}")


def _vision_from_hf(v: dict[str, Any], projection_eps: float) -> MoonViTConfig:
    if v.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise _unsupported("vision_config.hidden_act", v["hidden_act"], "the MoonViT MLP is GELU (tanh approximation)")
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise _unsupported("vision_config.rope_parameters.rope_type", rope["rope_type"], "only axial 2-D RoPE")
    height, width = v.get("pos_emb_height", 64), v.get("pos_emb_width", 64)
    if height != width:
        raise _unsupported("vision_config.pos_emb_width", width, f"the position table must be square "
                           f"(pos_emb_height={height}), as transformers resamples it")
    merge = list(v.get("merge_kernel_size", [2, 2]))
    if merge[0] != merge[1]:
        raise _unsupported("vision_config.merge_kernel_size", merge, "only square merges")
    return MoonViTConfig(depth=v.get("num_hidden_layers", 27), dim=v.get("hidden_size", 1152),
                         ffn_dim=v.get("intermediate_size", 4304), n_heads=v.get("num_attention_heads", 16),
                         patch_size=v.get("patch_size", 14), pos_emb_side=height, merge_size=merge[0],
                         rope_theta=float(rope.get("rope_theta", 10000.0)), projection_norm_eps=projection_eps)


class KimiK25Adapter:
    """``HFAdapter`` for ``model_type: kimi_k25``."""

    def config_from_hf(self, hf_config: dict[str, Any]) -> KimiK25Config:
        hf = hf_config
        if hf.get("model_type") != "kimi_k25":
            raise ConfigError(f"config.json model_type {hf.get('model_type')!r}: this adapter reads kimi_k25")
        text = dict(hf.get("text_config") or {})
        if text.get("model_type", "deepseek_v3") not in ("deepseek_v3", "kimi_k2"):
            raise _unsupported("text_config.model_type", text["model_type"], "the text model is DeepSeek-V3's")
        vision_dict = hf.get("vision_config") or {}
        width = vision_dict.get("hidden_size", 1152)
        if hf.get("projection_hidden_size", 1152) != width:
            raise ConfigError(f"config.json projection_hidden_size={hf.get('projection_hidden_size', 1152)} must "
                              f"equal vision_config.hidden_size={width} (the projector normalises each patch)")
        text["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
        vision = _vision_from_hf(vision_dict, float(hf.get("projection_layer_norm_eps", 1e-5)))
        config = kimi_k25_config(_TEXT.config_from_hf(text), vision, **{
            k: hf.get(k, default) for k, default in (("image_token_id", 163605), ("video_token_id", 163840),
                                                     ("vision_start_token_id", 163602),
                                                     ("vision_end_token_id", 163604))})
        config.validate()
        return config

    def config_to_hf(self, config: KimiK25Config) -> dict[str, Any]:
        if not isinstance(config, KimiK25Config):
            raise ConfigError("model: the kimi_k25 adapter writes KimiK25Config models only")
        text = _TEXT.config_to_hf(config)
        text.pop("architectures", None)
        v = config.vision
        return {
            "architectures": ["Kimi_K25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": text,
            "vision_config": {
                "model_type": "kimi_k25_vision", "patch_size": v.patch_size, "pos_emb_height": v.pos_emb_side,
                "pos_emb_width": v.pos_emb_side, "num_attention_heads": v.n_heads, "num_hidden_layers": v.depth,
                "hidden_size": v.dim, "intermediate_size": v.ffn_dim, "hidden_act": "gelu_pytorch_tanh",
                "merge_kernel_size": [v.merge_size, v.merge_size],
                "rope_parameters": {"rope_type": "axial", "rope_theta": float(v.rope_theta)}},
            "projection_hidden_size": v.dim, "projection_layer_norm_eps": v.projection_norm_eps,
            "image_token_id": config.image_token_id, "video_token_id": config.video_token_id,
            "vision_start_token_id": config.vision_start_token_id, "vision_end_token_id": config.vision_end_token_id,
            "tie_word_embeddings": config.tie_embeddings,
        }

    def state_from_hf(self, hf_state: dict[str, torch.Tensor], config: KimiK25Config) -> dict[str, torch.Tensor]:
        n_heads = config.vision.n_heads
        text: dict[str, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        unknown = []
        for name, tensor in hf_state.items():
            name = _memory_name(name)
            if m := _WQKV.fullmatch(name):  # the checkpoint's fused, pair-interleaved layout
                q, k, v = tensor.chunk(3)
                out[f"{_VISUAL}blocks.{m.group(1)}.attn.qkv.{m.group(2)}"] = torch.cat(
                    [_rope_halves(q, n_heads), _rope_halves(k, n_heads), v])
            elif name.startswith(_PROJ_HF):
                out[_VISUAL + "projector." + name[len(_PROJ_HF):]] = tensor
            elif name.startswith(_TOWER_HF):
                short = name[len(_TOWER_HF):]
                if m := _QKV.fullmatch(short):
                    qkv.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = tensor
                    continue
                for pattern, target in _RENAMES:
                    if re.fullmatch(pattern, short):
                        out[_VISUAL + re.sub(pattern, target, short)] = tensor
                        break
                else:
                    unknown.append(name)
            elif name.startswith(_TEXT_HF):
                text[_TEXT_FLAT + name[len(_TEXT_HF):]] = tensor
            else:
                text[name] = tensor
        if unknown:
            raise ValueError(f"kimi_k25: {len(unknown)} vision tensors have no lockstep counterpart: {unknown[:20]}")
        for (layer, kind), parts in qkv.items():
            if set(parts) != {"q", "k", "v"}:
                raise ValueError(f"kimi_k25: vision layer {layer} {kind} lacks {sorted({'q', 'k', 'v'} - set(parts))}")
            out[f"{_VISUAL}blocks.{layer}.attn.qkv.{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
        patch = _VISUAL + "patch_embed.proj.weight"
        if patch in out:
            out[patch] = out[patch].flatten(1)
        out.update(_TEXT.state_from_hf(text, config))
        return out

    def state_to_hf(self, state: dict[str, torch.Tensor], config: KimiK25Config) -> dict[str, torch.Tensor]:
        """The checkpoint layout transformers' ``save_pretrained`` writes (and ``from_pretrained`` reads)."""
        v = config.vision
        text = {k: t for k, t in state.items() if not k.startswith(_VISUAL)}
        out: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            if not name.startswith(_VISUAL):
                continue
            short = name[len(_VISUAL):]
            if m := re.fullmatch(r"blocks\.(\d+)\.attn\.qkv\.(weight|bias)", short):
                q, k, val = tensor.chunk(3)
                out[f"{_DISK_TOWER}blocks.{m.group(1)}.wqkv.{m.group(2)}"] = torch.cat(
                    [_rope_pairs(q, v.n_heads), _rope_pairs(k, v.n_heads), val])
            elif short == "patch_embed.proj.weight":
                out[_DISK_TOWER + short] = tensor.view(v.dim, v.in_channels, v.patch_size, v.patch_size)
            else:
                out[_disk_vision_name(short)] = tensor
        for name, tensor in _TEXT.state_to_hf(text, config).items():
            if name.startswith(_TEXT_FLAT):  # transformers writes its blocks -> layers rename back, text included
                out[_DISK_TEXT + re.sub(r"^layers\.", "blocks.", name[len(_TEXT_FLAT):])] = tensor
            else:
                out[_DISK_HEAD + name] = tensor
        return out


def _rope_halves(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head from the checkpoint's interleaved rotary pairs ``(x0, y0, x1, y1, ...)`` to the
    half-split order ``(x0, x1, ..., y0, y1, ...)`` that ``rotate_half`` uses (transformers' PermuteForRope)."""
    rows = t.shape[0]
    return t.reshape(n_heads, rows // n_heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()


def _rope_pairs(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`_rope_halves`."""
    rows = t.shape[0]
    return t.reshape(n_heads, 2, rows // n_heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()


_DISK_TOWER, _DISK_TEXT, _DISK_HEAD = "vision_tower.encoder.", "language_model.model.", "language_model."
# checkpoint name -> transformers' in-memory name, in transformers' order (its kimi_k25 conversion mapping)
_DISK_TO_MEMORY = [
    (r"^language_model\.model\.", "model.language_model."),
    (r"^language_model\.lm_head\.", "lm_head."),
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.(norm|mlp\.fc)([01])\.",  # numbered from 0 in the checkpoint
     lambda m: f"model.vision_tower.layers.{m[1]}.{m[2]}{int(m[3]) + 1}."),
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.wo\.", r"model.vision_tower.layers.\1.attn.proj."),
    (r"^vision_tower\.encoder\.blocks\.(\d+)\.wqkv\.", r"model.vision_tower.layers.\1.wqkv."),
    (r"^vision_tower\.encoder\.", "model.vision_tower."),
    (r"^vision_tower\.patch_embed\.pos_emb\.weight$", "model.vision_tower.patch_embed.pos_emb.position_embeddings"),
    (r"^vision_tower\.", "model.vision_tower."),
    (r"^(model\.)?mm_projector\.proj\.0\.", "model.mm_projector.in_proj."),
    (r"^(model\.)?mm_projector\.proj\.2\.", "model.mm_projector.out_proj."),
    (r"^mm_projector\.", "model.mm_projector."),
]
_WQKV = re.compile(r"model\.vision_tower\.layers\.(\d+)\.wqkv\.(weight|bias)")


def _memory_name(name: str) -> str:
    """transformers' in-memory name of a checkpoint tensor (in-memory names pass unchanged)."""
    for pattern, target in _DISK_TO_MEMORY:  # anchored: each rule's output matches no later rule
        name = re.sub(pattern, target, name)
    return name.replace("model.language_model.blocks.", "model.language_model.layers.")


def _disk_vision_name(short: str) -> str:
    """The checkpoint name of a lockstep tower tensor ``visual.<short>`` (not qkv nor the patch weight)."""
    if short == "pos_embed":
        return "vision_tower.patch_embed.pos_emb.weight"
    if short.startswith("projector."):
        short = short[len("projector."):]
        return {"in_proj": "mm_projector.proj.0", "out_proj": "mm_projector.proj.2"}.get(
            short.split(".")[0], "model.mm_projector." + short.split(".")[0]) + "." + short.split(".", 1)[1]
    if short.startswith("final_norm."):
        return _DISK_TOWER + "final_layernorm." + short[len("final_norm."):]
    if short.startswith("patch_embed."):
        return _DISK_TOWER + short
    m = re.fullmatch(r"blocks\.(\d+)\.(norm1|norm2|mlp\.linear_fc1|mlp\.linear_fc2|attn\.proj)\.(weight|bias)", short)
    if m is None:
        raise ValueError(f"kimi_k25: lockstep tensor visual.{short} has no checkpoint name")
    part = {"norm1": "norm0", "norm2": "norm1", "mlp.linear_fc1": "mlp.fc0", "mlp.linear_fc2": "mlp.fc1",
            "attn.proj": "wo"}[m.group(2)]
    return f"{_DISK_TOWER}blocks.{m.group(1)}.{part}.{m.group(3)}"


ADAPTER = KimiK25Adapter()
