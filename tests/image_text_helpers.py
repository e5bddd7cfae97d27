"""Test helpers shared by the vision-language parity tests (qwen3_vl, qwen3_5, kimi_k25): random
image+token inputs and the per-tensor gradient comparison (a helper module, no tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def image_inputs(grids: list[tuple[int, int, int]], rows: list[list[int]], *, pixel_shape: tuple[int, ...],
                 image: int, start: int, end: int, merge: int, seed: int = 0, length: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B, T], pixel_values [P, *pixel_shape], grid_thw [N, 3]): row ``b`` holds random text with
    the images ``rows[b]`` (indices into ``grids``, in order) as ``start``, ``t*h*w/merge**2`` ``image``
    placeholders, ``end``; rows are padded with text (ids below ``start - 10``) to one length."""
    gen = torch.Generator().manual_seed(seed)
    grid_thw = torch.tensor(grids, dtype=torch.long)
    pixels = torch.randn(int(grid_thw.prod(-1).sum()), *pixel_shape, generator=gen)

    def text(n: int) -> list[int]:
        return torch.randint(0, start - 10, (n,), generator=gen).tolist()

    seqs = []
    for images in rows:
        seq = text(3)
        for i in images:
            t, h, w = grids[i]
            seq += [start] + [image] * (t * h * w // merge ** 2) + [end] + text(2)
        seqs.append(seq)
    width = length or max(len(s) for s in seqs) + 2
    tokens = torch.tensor([s + text(width - len(s)) for s in seqs])
    order = [i for images in rows for i in images]  # the tower sees images in token order
    starts = torch.cat([torch.zeros(1, dtype=torch.long), grid_thw.prod(-1).cumsum(0)])
    pixels = torch.cat([pixels[starts[i]:starts[i + 1]] for i in order]) if order else pixels[:0]
    return tokens, pixels, grid_thw[order] if order else grid_thw[:0]


def assert_grads_close(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], rtol: float) -> float:
    """Every gradient within ``rtol`` of the reference's, relative to the reference tensor's largest
    entry; an all-zero reference (an expert no token chose) must be all zero here too. The worst ratio."""
    worst = 0.0
    for name, ref_grad in reference.items():
        scale = ref_grad.abs().max().item()
        if scale == 0.0:
            assert grads[name].abs().max().item() == 0.0, name
            continue
        rel = (grads[name] - ref_grad).abs().max().item() / scale
        worst = max(worst, rel)
        assert rel <= rtol, (name, rel)
    return worst


def load_pair(hf, directory: Path) -> tuple[Any, Any, Path]:
    """(transformers model, the lockstep model loaded from its ``save_pretrained`` in ``directory``, that
    directory): what every parity test module's ``pair`` fixture holds."""
    from lockstep.models.hf import load_hf

    hf.save_pretrained(directory)
    return hf, load_hf(directory, dtype=torch.float32, allow_unverified=True).eval(), directory


def mrope_hf_logits(hf, tokens: torch.Tensor, image_token_id: int, pixels: torch.Tensor | None = None,
                    grid: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of a transformers Qwen3-VL / Qwen3.5 image-text model (mRoPE from ``mm_token_type_ids``)."""
    kwargs = {}
    if pixels is not None:
        kwargs = dict(pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(tokens == image_token_id).int())
    hf.model.rope_deltas = None  # transformers caches rope deltas between calls
    return hf(input_ids=tokens, **kwargs).logits


def assert_first_row_batch_invariant(directory: Path, tokens: torch.Tensor, pixels: torch.Tensor,
                                     grid: torch.Tensor) -> None:
    """In batch-invariant mode the first row's logits (its images: the first of ``grid``) alone and in the
    batch are bitwise equal. The tower's frames attend alone, so its kernel needs no causal-only refusal."""
    from lockstep import numerics
    from lockstep.models.hf import load_hf

    model = numerics.prepare_model(load_hf(directory, dtype=torch.float32, allow_unverified=True).eval())
    first = int(grid[0].prod())
    with torch.no_grad(), numerics.batch_invariant():
        batch = model(tokens, pixel_values=pixels, grid_thw=grid)
        alone = model(tokens[:1], pixel_values=pixels[:first], grid_thw=grid[:1])
    assert torch.equal(batch[:1], alone)


def train_vision_recipe(recipe: str, run_dir: Path, steps: int = 8):
    """Train ``recipe`` (an image+text debug recipe) for ``steps`` on CPU; (config, its first batch, the fit
    result, the names of the vision tower's tensors that did not move from their initial values)."""
    from safetensors.torch import load_file

    from lockstep.cli import resolve_config
    from lockstep.models.common.transformer import build_model
    from lockstep.train.trainer import Trainer

    cfg, _ = resolve_config(["--recipe", recipe, "--steps", str(steps), "--run-dir", str(run_dir),
                             "--validation.every", "0", "--output.no-progress", "--output.sample-tokens", "0",
                             "--training.device", "cpu"])
    trainer = Trainer(cfg)
    batch = next(iter(trainer.data.train.iter_epoch()))
    result = trainer.fit()
    print(f"{recipe} losses {result.losses}")
    trained = load_file(run_dir / "model.safetensors")
    initial = build_model(cfg.model, seed=cfg.seed).state_dict()
    tower = [k for k in initial if k.startswith("visual.")]
    assert tower, f"{recipe}: the model has no visual.* tensors"
    return cfg, batch, result, [k for k in tower if torch.equal(trained[k], initial[k])]
