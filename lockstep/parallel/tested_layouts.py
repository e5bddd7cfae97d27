"""The parallel layouts proven by loss-parity tests, in one list the test and the manifest share.

Each entry: test id, recipe, world size, degrees (ParallelConfig fields that differ from the
defaults) and extra CLI flags (model flags: the one-process reference runs with them too).
``tests/parallel/test_loss_parity.py`` runs every entry against one process; a run's manifest names the entry its layout corresponds to, or says it has none.
"""

from __future__ import annotations

from typing import Any

FOUR_LAYERS = ["--model.n-layers", "4"]  # interleaved / V schedules place 2 stages per rank
# DeepSeek-V3's aux-loss-free bias update and sequence-wise balance loss (off in the debug recipe)
BALANCING = ["--model.feed-forward.bias-update-speed", "0.01", "--model.feed-forward.seq-aux-loss-coef", "0.01"]
#: layouts whose parameters after the steps are compared with one process as well as their losses
PARAMS_CHECKED = {"tp=2 deepseek (MLA, expert TP, MTP)", "tp=2 moe (expert TP)", "tp=2 x ep=2 moe",
                  "tp=2 x ep=2 deepseek", "cp=2 x tp=2 qwen3",
                  "cp=2 moe (whole-sequence aux loss)", "cp=2 deepseek (MLA, MTP)",
                  "ep=4 over dp_shard=2 x cp=2 moe", "cp=2 x tp=2 deepseek (MLA, expert TP, MTP)"}

TESTED_LAYOUTS: list[tuple[str, str, int, dict, list[str]]] = [
    ("dp_shard=2", "debug", 2, {"dp_shard": 2}, []),
    ("dp_replicate=2", "debug", 2, {"dp_replicate": 2, "dp_shard": 1}, []),
    ("tp=2", "debug", 2, {"tp": 2}, []),
    ("tp=2 qwen3 (q/k norm, tied)", "debug-qwen3", 2, {"tp": 2}, []),
    ("dp_shard=2 x tp=2", "debug", 4, {"dp_shard": 2, "tp": 2}, []),
    ("dp_replicate=2 x dp_shard=2 (HSDP)", "debug", 4, {"dp_replicate": 2, "dp_shard": 2}, []),
    ("dp_shard=2 moe", "debug-moe", 2, {"dp_shard": 2}, []),
    ("ep=2 x dp_shard=2 moe", "debug-moe", 2, {"dp_shard": 2, "ep": 2}, []),
    # MLA + MoE whose aux-loss-free bias update must see the counts of both ranks, + MTP loss
    ("dp_shard=2 deepseek", "debug-deepseek", 2, {"dp_shard": 2}, []),
    # tensor parallel over MLA (heads split, latent replicated), MoE (expert TP: each expert's hidden
    # dim split, router replicated) and the MTP layer, with bias balancing and the sequence aux loss on
    ("tp=2 deepseek (MLA, expert TP, MTP)", "debug-deepseek", 2, {"tp": 2}, BALANCING),
    ("tp=2 moe (expert TP)", "debug-moe", 2, {"tp": 2}, []),
    ("tp=2 x ep=2 moe", "debug-moe", 4, {"dp_shard": 2, "ep": 2, "tp": 2}, []),
    # all of it at once: MLA + expert TP inside the ep exchange + MTP, bias counts summed over ep only
    ("tp=2 x ep=2 deepseek", "debug-deepseek", 4, {"dp_shard": 2, "ep": 2, "tp": 2}, BALANCING),
    ("cp=2 allgather", "debug", 2, {"cp": 2}, []),
    ("cp=2 ring x dp_shard=2", "debug", 4, {"cp": 2, "cp_method": "ring", "dp_shard": 2}, []),
    # MoE under cp: every rank's expert-load metrics reach the record; the sequence balance loss and
    # the bias counts are whole-sequence (parallel/context_losses.py): aux losses equal one process
    ("cp=2 moe (whole-sequence aux loss)", "debug-moe", 2, {"cp": 2}, BALANCING),
    # ep borrows the cp ranks: experts split over dp_shard x cp (ep=4 at world 4), expert gradients
    # not summed over cp, bias counts over dp x cp, sequence balance loss whole-sequence
    ("ep=4 over dp_shard=2 x cp=2 moe", "debug-moe", 4, {"dp_shard": 2, "cp": 2, "ep": 4}, BALANCING),
    # MTP under cp: depth k's tokens and targets cross the shard boundary (all-gathered token ids),
    # its loss is the whole-sequence mean (aux losses equal one process)
    ("cp=2 deepseek (MLA, MTP)", "debug-deepseek", 2, {"cp": 2}, []),
    # heads split by tp, the sequence by cp (q/k norms, tied embeddings, loss-parallel CE over cp)
    ("cp=2 x tp=2 qwen3", "debug-qwen3", 4, {"cp": 2, "tp": 2}, []),
    # MLA heads and each expert's hidden dim split by tp, the sequence (and MTP's shift) by cp
    ("cp=2 x tp=2 deepseek (MLA, expert TP, MTP)", "debug-deepseek", 4, {"cp": 2, "tp": 2}, []),
    ("pp=2 1F1B", "debug", 2, {"pp": 2}, []),
    ("pp=2 ZBVZeroBubble", "debug", 2, {"pp": 2, "pp_schedule": "ZBVZeroBubble"}, FOUR_LAYERS),
    ("pp=2 x dp_shard=2 Interleaved1F1B", "debug", 4,
     {"pp": 2, "dp_shard": 2, "pp_schedule": "Interleaved1F1B", "pp_microbatches": 2}, FOUR_LAYERS),
    # pipelines of every model kind: the MoE balance loss and bias counts of each stage, DeepSeek's
    # dense first layer + MLA + MTP heads on the last stage (their loss and the embedding copy's
    # gradient joining the first stage's), tied embeddings reduced between first and last stage
    ("pp=2 moe (aux losses)", "debug-moe", 2, {"pp": 2}, BALANCING),
    ("pp=2 deepseek (MTP, dense first)", "debug-deepseek", 2, {"pp": 2}, BALANCING),
    ("pp=2 x ep=2 deepseek (MTP)", "debug-deepseek", 4, {"pp": 2, "dp_shard": 2, "ep": 2}, BALANCING),
    ("pp=2 x tp=2 qwen3 (tied)", "debug-qwen3", 4, {"pp": 2, "tp": 2}, []),
    # V placement: rank 0 holds the first and the last stage (MTP's embedding copy summed locally)
    ("pp=2 ZBVZeroBubble deepseek (MTP)", "debug-deepseek", 2, {"pp": 2, "pp_schedule": "ZBVZeroBubble"},
     FOUR_LAYERS + BALANCING),
    # world 8: the last stage's MTP heads keep the TP residual stream as DTensors (received hidden
    # states wrapped back), experts TP-split inside the ep exchange
    ("pp=2 x dp_shard=2 x tp=2 deepseek (MTP)", "debug-deepseek", 8, {"pp": 2, "dp_shard": 2, "tp": 2}, []),
    ("pp=2 x dp_shard=2 x ep=2 x tp=2 deepseek (MTP)", "debug-deepseek", 8,
     {"pp": 2, "dp_shard": 2, "ep": 2, "tp": 2}, BALANCING),
    # pp=3: the tied head's gradient is summed over a 2-rank group of the first and last stage's ranks
    ("pp=3 qwen3 (tied)", "debug-qwen3", 3, {"pp": 3, "pp_microbatches": 4}, ["--model.n-layers", "3"]),
    # EP that borrows part of the data-parallel ranks: experts split over ep=2, FSDP-sharded over the
    # other dp_shard / ep = 2 (dp_shard_mod_ep), and under HSDP replicated over dp_replicate=2
    ("dp_shard=4 x ep=2 moe (experts FSDP over dp_shard_mod_ep)", "debug-moe", 4, {"dp_shard": 4, "ep": 2}, []),
    ("dp_replicate=2 x dp_shard=2 x ep=2 moe (HSDP x EP)", "debug-moe", 4,
     {"dp_replicate": 2, "dp_shard": 2, "ep": 2}, []),
    ("dp_replicate=2 x dp_shard=2 x ep=2 deepseek (HSDP x EP, MTP)", "debug-deepseek", 4,
     {"dp_replicate": 2, "dp_shard": 2, "ep": 2}, BALANCING),
    # world 8: each expert's hidden dim over tp, experts over ep, FSDP over dp_shard_mod_ep (2-D DTensors)
    ("tp=2 x dp_shard=4 x ep=2 moe (experts FSDP x TP)", "debug-moe", 8, {"dp_shard": 4, "ep": 2, "tp": 2}, []),
]
PARAMS_CHECKED |= {"pp=2 moe (aux losses)", "pp=2 deepseek (MTP, dense first)", "pp=2 x ep=2 deepseek (MTP)",
                   "pp=2 x tp=2 qwen3 (tied)", "pp=2 ZBVZeroBubble deepseek (MTP)",
                   "pp=2 x dp_shard=2 x tp=2 deepseek (MTP)", "pp=2 x dp_shard=2 x ep=2 x tp=2 deepseek (MTP)",
                   "pp=3 qwen3 (tied)"}
PARAMS_CHECKED |= {"dp_shard=4 x ep=2 moe (experts FSDP over dp_shard_mod_ep)",
                   "dp_replicate=2 x dp_shard=2 x ep=2 moe (HSDP x EP)",
                   "dp_replicate=2 x dp_shard=2 x ep=2 deepseek (HSDP x EP, MTP)",
                   "tp=2 x dp_shard=4 x ep=2 moe (experts FSDP x TP)"}

# cp x pp: the sequences are cp-sharded before the schedule splits micro-batches; each stage's attention
# runs over the cp group with its shard's global positions, the last stage's loss is the cp one (tokens
# counted over cp, gradients summed over cp), the tied head's gradient summed between first and last stage
TESTED_LAYOUTS += [("cp=2 x pp=2 qwen3 (tied)", "debug-qwen3", 4, {"cp": 2, "pp": 2}, []),
                   ("cp=2 ring x pp=2 Interleaved1F1B", "debug", 4,
                    {"cp": 2, "cp_method": "ring", "pp": 2, "pp_schedule": "Interleaved1F1B", "pp_microbatches": 2},
                    FOUR_LAYERS),
                   # each stage's MoE sequence balance loss and bias counts whole-sequence over cp
                   ("cp=2 x pp=2 moe (whole-sequence aux loss)", "debug-moe", 4, {"cp": 2, "pp": 2}, BALANCING),
                   # the last stage's MTP heads shift by global position across the shard boundary
                   ("cp=2 x pp=2 deepseek (MLA, MTP)", "debug-deepseek", 4, {"cp": 2, "pp": 2}, []),
                   # each stage's experts split over its cp ranks (ep borrows them), not summed over cp
                   ("ep=2 over cp=2 x pp=2 moe", "debug-moe", 4, {"cp": 2, "pp": 2, "ep": 2, "dp_shard": 1},
                    BALANCING),
                   # world 8: heads by tp, the sequence by cp, the layers by pp (loss-parallel CE over cp)
                   ("cp=2 x pp=2 x tp=2 qwen3 (tied)", "debug-qwen3", 8, {"cp": 2, "pp": 2, "tp": 2}, [])]
PARAMS_CHECKED |= {"cp=2 x pp=2 x tp=2 qwen3 (tied)", "cp=2 x pp=2 qwen3 (tied)", "cp=2 ring x pp=2 Interleaved1F1B",
                   "cp=2 x pp=2 moe (whole-sequence aux loss)", "cp=2 x pp=2 deepseek (MLA, MTP)",
                   "ep=2 over cp=2 x pp=2 moe"}

# the new families (#16): Gated DeltaNet hybrids (split / grouped projections, output-gated attention,
# gated shared expert) and GPT-OSS (sinks, sliding windows, biased clamped-SwiGLU experts)
TESTED_LAYOUTS += [
    ("dp_shard=2 qwen3_5", "debug-qwen35", 2, {"dp_shard": 2}, []),
    ("dp_shard=2 qwen3_next", "debug-qwen3next", 2, {"dp_shard": 2}, []),
    ("dp_shard=2 gpt_oss", "debug-gptoss", 2, {"dp_shard": 2}, []),
    ("ep=2 x dp_shard=2 qwen3_5 moe", "debug-qwen35-moe", 2, {"dp_shard": 2, "ep": 2}, []),
    ("ep=2 x dp_shard=2 gpt_oss", "debug-gptoss", 2, {"dp_shard": 2, "ep": 2}, []),
    ("dp_replicate=2 x dp_shard=2 qwen3_5 (HSDP)", "debug-qwen35", 4, {"dp_replicate": 2, "dp_shard": 2}, []),
    # tensor parallel (parallel/tp_blocks.py): Gated DeltaNet heads split by whole key-head groups,
    # output-gated attention, GPT-OSS sinks / q-k-v-o biases / expert biases, the gated shared expert
    ("tp=2 qwen3_5 (Gated DeltaNet, gated attention)", "debug-qwen35", 2, {"tp": 2}, []),
    ("tp=2 qwen3_next (grouped projections, expert TP, shared gate)", "debug-qwen3next", 2, {"tp": 2}, []),
    ("tp=2 gpt_oss (sinks, biases, biased experts)", "debug-gptoss", 2, {"tp": 2}, []),
    ("tp=2 x ep=2 gpt_oss", "debug-gptoss", 4, {"dp_shard": 2, "ep": 2, "tp": 2}, []),
    # FSDP over TP: the whole-on-every-rank in_proj_qkv / conv and the DTensor per-head parameters
    ("dp_shard=2 x tp=2 qwen3_5", "debug-qwen35", 4, {"dp_shard": 2, "tp": 2}, []),
    # Gated DeltaNet (grouped projections) under tp, experts split over ep and their hidden dim over tp
    ("tp=2 x ep=2 qwen3_next", "debug-qwen3next", 4, {"dp_shard": 2, "ep": 2, "tp": 2}, []),
    # DeepSeek-V3.2: the sparse indexer and its KL warm-up loss (an aux loss, compared like the others)
    ("dp_shard=2 deepseek_v32 (indexer KL loss)", "debug-deepseek-v32", 2, {"dp_shard": 2}, []),
    # DeepSeek-V4: hyper-connections, compressed attention, hash-routed MoE
    ("dp_shard=2 deepseek_v4 (hyper-connections, compressed attention)", "debug-deepseek-v4", 2, {"dp_shard": 2}, []),
]
PARAMS_CHECKED |= {"dp_shard=2 qwen3_5", "dp_shard=2 qwen3_next", "dp_shard=2 gpt_oss", "ep=2 x dp_shard=2 qwen3_5 moe",
                   "ep=2 x dp_shard=2 gpt_oss", "dp_replicate=2 x dp_shard=2 qwen3_5 (HSDP)",
                   "tp=2 qwen3_5 (Gated DeltaNet, gated attention)",
                   "tp=2 qwen3_next (grouped projections, expert TP, shared gate)",
                   "tp=2 gpt_oss (sinks, biases, biased experts)", "tp=2 x ep=2 gpt_oss",
                   "dp_shard=2 x tp=2 qwen3_5", "tp=2 x ep=2 qwen3_next",
                   "dp_shard=2 deepseek_v32 (indexer KL loss)",
                   "dp_shard=2 deepseek_v4 (hyper-connections, compressed attention)"}

# Qwen3-VL on image+text rows (#24): the vision tower is part of the root FSDP unit (sharded with the
# embeddings and head); every row holds the same number of scored tokens, so dp ranks' means are one mean
TESTED_LAYOUTS += [("dp_shard=2 qwen3_vl (vision tower, images)", "debug-qwen3-vl", 2, {"dp_shard": 2}, []),
                   ("ep=2 x dp_shard=2 qwen3_vl moe (images)", "debug-qwen3-vl-moe", 2, {"dp_shard": 2, "ep": 2}, [])]
PARAMS_CHECKED |= {"dp_shard=2 qwen3_vl (vision tower, images)", "ep=2 x dp_shard=2 qwen3_vl moe (images)"}
# tensor + sequence parallel with images (parallel/visual.py): the tower replicated on the tp ranks, each
# rank's share of the placeholders and DeepStack rows, the tower's output gradient summed over tp
TESTED_LAYOUTS += [("tp=2 qwen3_vl (DeepStack, mRoPE, images)", "debug-qwen3-vl", 2, {"tp": 2}, []),
                   # world 4: dense and MoE qwen3_vl are one family, tp=2 alone would name the dense entry
                   ("tp=2 x ep=2 qwen3_vl moe (expert TP, images)", "debug-qwen3-vl-moe", 4,
                    {"dp_shard": 2, "ep": 2, "tp": 2}, []),
                   ("dp_shard=2 qwen3_5 (vision tower, images)", "debug-qwen35-vl", 2, {"dp_shard": 2}, []),
                   ("tp=2 qwen3_5 (Gated DeltaNet, vision tower, images)", "debug-qwen35-vl", 2, {"tp": 2}, []),
                   # MoonViT (no DeepStack) over DeepSeek-V3's MLA + MoE: heads and expert hidden dims split
                   ("tp=2 kimi_k25 (MLA, expert TP, images)", "debug-kimi-k25-vl", 2, {"tp": 2}, [])]
PARAMS_CHECKED |= {"tp=2 qwen3_vl (DeepStack, mRoPE, images)", "tp=2 x ep=2 qwen3_vl moe (expert TP, images)",
                   "dp_shard=2 qwen3_5 (vision tower, images)", "tp=2 qwen3_5 (Gated DeltaNet, vision tower, images)",
                   "tp=2 kimi_k25 (MLA, expert TP, images)"}
# FSDP2 for Kimi K2.5 with images (MoonViT in the root unit) and HSDP with images
TESTED_LAYOUTS += [("dp_shard=2 kimi_k25 (MoonViT, images)", "debug-kimi-k25-vl", 2, {"dp_shard": 2}, []),
                   ("dp_replicate=2 x dp_shard=2 qwen3_vl (HSDP, images)", "debug-qwen3-vl", 4,
                    {"dp_replicate": 2, "dp_shard": 2}, [])]
PARAMS_CHECKED |= {"dp_shard=2 kimi_k25 (MoonViT, images)", "dp_replicate=2 x dp_shard=2 qwen3_vl (HSDP, images)"}

_DEGREES = ("dp_replicate", "dp_shard", "tp", "ep", "pp", "cp")


def degree_flags(degrees: dict) -> list[str]:
    """CLI flags for a degrees dict, e.g. {"dp_shard": 2} -> ["--parallel.dp-shard", "2"]."""
    flags: list[str] = []
    for key, value in degrees.items():
        flags += [f"--parallel.{key.replace('_', '-')}", str(value)]
    return flags


def matching_parity_test(resolved: dict, family: str, schedule: str, cp_method: str,
                         images: bool = False) -> str | None:
    """The test id proving a layout with these resolved degrees, for this model family, on image+text
    batches (``images``) or text."""
    from lockstep.recipes import get_recipe

    for test_id, recipe, world, degrees, _ in TESTED_LAYOUTS:
        config = get_recipe(recipe).config()
        if config.model.family != family or trains_on_images(config) != images:
            continue
        want = {k: 1 for k in _DEGREES} | {"dp_shard": world // max(1, _product(degrees))} | degrees
        if any(want[k] != resolved[k] for k in _DEGREES):
            continue
        if resolved["pp"] > 1 and degrees.get("pp_schedule", "1F1B") != schedule:
            continue
        if resolved["cp"] > 1 and degrees.get("cp_method", "allgather") != cp_method:
            continue
        return f"tests/parallel/test_loss_parity.py::test_layout_matches_one_process[{test_id}]"
    return None


def trains_on_images(config: Any) -> bool:
    """Whether a run config's batches hold images (``data.images``; configs without it: text)."""
    images = getattr(getattr(config, "data", None), "images", None)
    return bool(images is not None and images.enabled)


def _product(degrees: dict) -> int:
    out = 1
    for key in ("dp_replicate", "tp", "pp", "cp"):
        out *= degrees.get(key, 1)
    return out
