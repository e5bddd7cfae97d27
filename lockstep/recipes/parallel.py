"""Recipes of parallel layouts: the update's DeepSeek-V3 + MTP pipeline layout, small and real-shape.

``dsv3-mtp-pp`` trains a small DeepSeek-V3 (MLA, a dense first layer, routed + shared experts with
aux-loss-free balancing and the sequence balance loss, one MTP head) under PP2 x EP2 x FSDP4 at
world 8 (``lockstep train --recipe dsv3-mtp-pp --nproc 8``): stage 0 holds the embedding, the
dense layer and a MoE layer; stage 1 two MoE layers, the head and the MTP head. The experts are
split over ep=2 and FSDP-sharded over the other dp_shard / ep = 2 ranks.

``dsv3-mtp-pp-671b`` is the same layout at the real shape (671B, MTP1), for ``lockstep plan``:
``--world 256`` (ep 32) and ``--world 512 --ep 64 --batch-size 2048`` are the update's two rows
(docs/parallelism.md). It is a planning recipe: nothing this size trains on one machine.
"""

from __future__ import annotations

from lockstep.models.registry import model_config
from lockstep.parallel.checkpointing import ActivationCheckpointConfig
from lockstep.parallel.dims import ParallelConfig
from lockstep.recipes.pretrain import debug
from lockstep.recipes.registry import recipe
from lockstep.train.config import TrainerConfig


@recipe("dsv3-mtp-pp", "small deepseek_v3 + MTP1 under PP2 x EP2 x FSDP4 (world 8): the update's layout, for CPUs")
def dsv3_mtp_pp() -> TrainerConfig:
    cfg = debug()
    cfg.model = model_config("deepseek_v3", "debug")
    cfg.model.n_layers = 4  # dense first layer + 3 MoE: two layers per stage
    cfg.model.feed_forward.bias_update_speed = 0.01
    cfg.model.feed_forward.seq_aux_loss_coef = 0.01
    cfg.steps = 10
    cfg.training.batch_size = 8  # 2 sequences per data-parallel rank = 2 micro-batches of 1
    cfg.parallel = ParallelConfig(pp=2, dp_shard=4, ep=2, pp_microbatches=2)
    return cfg


@recipe("dsv3-mtp-pp-671b", "DeepSeek-V3 671B + MTP1, PP2 x EP32 x FSDP128 in bf16: the update's layout at 256 "
        "ranks, for `lockstep plan` (not trainable on one machine)")
def dsv3_mtp_pp_671b() -> TrainerConfig:
    cfg = dsv3_mtp_pp()
    cfg.model = model_config("deepseek_v3", "671B")
    cfg.training.seq_len = 4096
    cfg.training.batch_size = 1024  # 8 sequences per data-parallel rank at 256 ranks
    cfg.training.dtype = "bfloat16"
    cfg.training.activation_checkpoint = ActivationCheckpointConfig(mode="full")
    cfg.parallel = ParallelConfig(pp=2, dp_shard=-1, ep=32, pp_microbatches=8, fsdp_param_dtype="bfloat16")
    return cfg


@recipe("qwen3-moe-64k-cp", "Qwen3-30B-A3B at 64K context, CP4 x FSDP10 (40 ranks) in bf16: for `lockstep plan` "
        "(Qwen3.5-35B-A3B's Gated DeltaNet recurrence is refused under cp)")
def qwen3_moe_64k_cp() -> TrainerConfig:
    """The update's long-context RL model is Qwen3.5-35B-A3B; lockstep refuses context parallel across
    its Gated DeltaNet layers (a recurrence's state would pass from rank to rank), so the 64K plan
    on 40 ranks is Qwen3-30B-A3B's. ``max_seq_len`` is raised to 64K; the model card's YaRN scaling
    beyond 32K is not modelled (lockstep's qwen3 rope has none), which changes no sizes."""
    cfg = debug()
    cfg.model = model_config("qwen3_moe", "30B-A3B")
    cfg.model.max_seq_len = 65536
    cfg.training.seq_len = 65536
    cfg.training.batch_size = 10  # one 64K sequence per data-parallel rank
    cfg.training.dtype = "bfloat16"
    cfg.training.activation_checkpoint = ActivationCheckpointConfig(mode="full")
    cfg.parallel = ParallelConfig(cp=4, dp_shard=-1, fsdp_param_dtype="bfloat16")
    return cfg
