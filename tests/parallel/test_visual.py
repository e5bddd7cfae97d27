"""Image inputs under sequence parallelism (lockstep/parallel/visual.py), without processes: each rank's
share of the visual inputs does on its shard of the sequence exactly what the whole does on the whole.

The training parity (tp=2 qwen3_vl / qwen3_5, tp=2 x ep=2 qwen3_vl moe on image+text rows: losses and
parameters against one process) is in ``tests/parallel/test_loss_parity.py``.
"""

import pytest
import torch

from lockstep.models.common.vision import VisionFeatures, VisualInputs
from lockstep.parallel.tested_layouts import matching_parity_test
from lockstep.parallel.visual import sequence_bounds, shard_visual


@pytest.mark.parametrize("size", [2, 3])  # 3 does not divide T = 10: torch.chunk's uneven last shard
def test_each_shard_merges_and_adds_deepstack_like_the_whole(size):
    g = torch.Generator().manual_seed(0)
    batch, length, dim = 2, 10, 4
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, 1:5] = True  # an image across the shard boundaries
    mask[1, 6:10] = True
    rows = int(mask.sum())
    features = VisionFeatures(torch.randn(rows, dim, generator=g), [torch.randn(rows, dim, generator=g)
                                                                   for _ in range(2)])
    whole = VisualInputs(mask, features)
    embeddings, hidden = torch.randn(batch, length, dim, generator=g), torch.randn(batch, length, dim, generator=g)
    merged, added = whole.merge(embeddings), whole.after_block(1, hidden)
    shards = list(zip(embeddings.chunk(size, 1), hidden.chunk(size, 1), merged.chunk(size, 1), added.chunk(size, 1)))
    assert len(shards) == size
    for rank, (emb, h, want_merged, want_added) in enumerate(shards):
        start, end = sequence_bounds(length, rank, size)
        assert end - start == emb.shape[1]  # the columns Shard(1) gives this rank
        local = shard_visual(whole, rank, size)
        assert torch.equal(local.merge(emb), want_merged)
        assert torch.equal(local.after_block(1, h), want_added)
        assert torch.equal(local.after_block(2, h), h)  # past the last DeepStack layer: unchanged


def test_a_run_on_images_names_the_image_layout_test():
    tp2 = {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "ep": 1, "pp": 1, "cp": 1}
    images = matching_parity_test(tp2, "qwen3_5", "1F1B", "allgather", images=True)
    text = matching_parity_test(tp2, "qwen3_5", "1F1B", "allgather")
    assert images.endswith("[tp=2 qwen3_5 (Gated DeltaNet, vision tower, images)]")
    assert text.endswith("[tp=2 qwen3_5 (Gated DeltaNet, gated attention)]")
    # qwen3_vl's entries are all on images: a text-only qwen3_vl run at tp=2 has no parity test
    assert matching_parity_test(tp2, "qwen3_vl", "1F1B", "allgather") is None


def test_plan_sizes_the_tower_under_tp_and_names_the_refused_image_layouts():
    from lockstep.parallel.plan.cli import plan_from_args

    plan, _, _ = plan_from_args(["--recipe", "debug-qwen3-vl", "--world", "2", "--tp", "2"])
    assert not any("refuses" in n for n in plan.notes) and not any("no TP rule" in n for n in plan.notes)
    tp = [c.what for c in plan.worst.collectives if c.group == "tp"]
    assert any(w.startswith("vision tower output grads (bwd, x3 features") for w in tp)  # embeds + 2 DeepStack
    for field in ("cp", "pp"):
        plan, _, _ = plan_from_args(["--recipe", "debug-qwen3-vl", "--world", "2", f"--{field}", "2"])
        assert any(n.startswith(f"lockstep's trainer refuses this layout today: parallel.{field}: image+text")
                   for n in plan.notes), plan.notes
