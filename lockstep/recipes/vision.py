"""Vision-language recipes: a tiny Qwen3-VL trained on image+text rows (``lockstep train``) and RL on an
image question (``lockstep rl``).

- ``debug-qwen3-vl``: the ``qwen3_vl`` debug flavor (2-block ViT with DeepStack, 3-layer decoder with
  mRoPE) on rows that each hold a generated shape image with its caption and a Shakespeare window
  (``data.images.source = "shapes"``, :mod:`lockstep.data.image_mix`). The model's vocabulary is the
  Shakespeare tokenizer's 4096 ids plus the image token ids above them. ``debug-qwen3-vl-moe``: the same
  with the MoE text model (``debug-moe``: 8 experts, top-2). ``debug-qwen35-vl``: the same rows for
  Qwen3.5's image-text model (``qwen3_5`` ``debug-vl``). ``debug-kimi-k25-vl``: the same rows for Kimi K2.5
  (``kimi_k25`` ``debug``: MoonViT + projector, DeepSeek-V3 MLA + MoE decoder), its images through Kimi's
  processor (:mod:`lockstep.models.kimi_k25.images`).
- ``rl-qwen3-vl-shapes``: GRPO of that model (random init) on ``shape_count`` -- "How many circles are in
  the image?" over pictures drawn per task seed -- with the exact answer rewarded 1.0 and another reply
  0.2 x its similarity to the count's word (``shaping``: a random policy's groups get reward variance, so
  every step moves the weights); the rollouts' images go to
  the engine (``Request.images``) and to the trainer's scoring. A few steps in seconds, colocated or with
  a generator process; batch-invariant mode on (trainer == generator log-probabilities).
"""

from __future__ import annotations

import dataclasses

from lockstep.data.config import DataConfig
from lockstep.data.image_mix import ImageMixConfig
from lockstep.models.common.transformer import TransformerConfig
from lockstep.models.registry import model_config
from lockstep.recipes.pretrain import debug
from lockstep.numerics import NumericsConfig
from lockstep.recipes.registry import recipe
from lockstep.recipes.rl import rl_debug
from lockstep.rl.config import RLConfig, TaskConfig
from lockstep.train.config import TrainerConfig

#: the Shakespeare tokenizer's vocabulary (ids below it are text)
TEXT_VOCAB = 4096


def shakespeare_vl_model(flavor: str = "debug", family: str = "qwen3_vl") -> TransformerConfig:
    """A vision-language flavor (``qwen3_vl``, ``qwen3_5``'s ``-vl`` ones, ``kimi_k25``) whose vocabulary is the
    Shakespeare tokenizer's plus the vision tokens after it (the flavors put them at the top of a 4096
    vocabulary, where the tokenizer's own merges are)."""
    cfg = model_config(family, flavor)
    return dataclasses.replace(cfg, vocab_size=TEXT_VOCAB + 8, vision_start_token_id=TEXT_VOCAB,
                               vision_end_token_id=TEXT_VOCAB + 1, image_token_id=TEXT_VOCAB + 2,
                               video_token_id=TEXT_VOCAB + 3, flavor=f"{flavor}-shakespeare")


@recipe("debug-qwen3-vl", "tiny qwen3_vl (ViT + DeepStack + mRoPE) on rows of a shape image + caption and "
        "Shakespeare text: seconds per run, for tests")
def debug_qwen3_vl() -> TrainerConfig:
    cfg = debug()
    cfg.model = shakespeare_vl_model()
    cfg.data = DataConfig(images=ImageMixConfig(source="shapes"))
    cfg.training.seq_len = 64
    cfg.output.parity_check = False
    return cfg



@recipe("debug-qwen3-vl-moe", "debug-qwen3-vl with the MoE text model (qwen3_vl debug-moe: 8 experts, top-2), "
        "for tests")
def debug_qwen3_vl_moe() -> TrainerConfig:
    cfg = debug_qwen3_vl()
    cfg.model = shakespeare_vl_model("debug-moe")
    return cfg


@recipe("debug-qwen35-vl", "debug-qwen3-vl with Qwen3.5's image-text model (qwen3_5 debug-vl: Gated DeltaNet "
        "hybrid, mRoPE in the gated attention, tower without DeepStack), for tests")
def debug_qwen35_vl() -> TrainerConfig:
    cfg = debug_qwen3_vl()
    cfg.model = shakespeare_vl_model("debug-vl", family="qwen3_5")
    return cfg


@recipe("debug-kimi-k25-vl", "debug-qwen3-vl with Kimi K2.5 (kimi_k25 debug: MoonViT + projector, DeepSeek-V3 "
        "MLA + MoE decoder; Kimi's image processor), for tests")
def debug_kimi_k25_vl() -> TrainerConfig:
    cfg = debug_qwen3_vl()
    cfg.model = shakespeare_vl_model(family="kimi_k25")
    return cfg


@recipe("rl-qwen3-vl-shapes", "RL with images: random tiny qwen3_vl counts circles in generated pictures "
        "(shape_count), GRPO, batch-invariant; trainer + 1 generator, seconds")
def rl_qwen3_vl_shapes() -> RLConfig:
    cfg = rl_debug()
    cfg.model = shakespeare_vl_model()
    cfg.task = TaskConfig(env="shape_count", groups_per_step=2, options={"shaping": 0.2})
    cfg.rollout.sampling.max_new_tokens = 8
    cfg.engine.image_min_pixels = 64 * 64  # the 64x64 pictures as drawn: 8x8 patches, 16 image tokens
    cfg.numerics = NumericsConfig(batch_invariant=True)
    return cfg
