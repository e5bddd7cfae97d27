"""Trainer-side scoring: the log-probability of each response token under the model.

``score_logprobs(model, sequences, prompt_lengths)`` is the trainer's half of the agreement the RL
loop measures: the engine records ``token_logprobs`` of each token as it samples it, the trainer
recomputes them here from one full-sequence forward, with the same function
(:func:`lockstep.generate.sampling.token_logprobs`). In batch-invariant mode
(:func:`lockstep.numerics.set_batch_invariant`) the two are bitwise equal; see docs/numerics.md.

A vision-language model (Qwen3-VL) scores sequences with images: ``images[i]`` is sequence ``i``'s
``(pixel_values [P, D], grid_thw [N, 3])`` (:mod:`lockstep.data.images`; None: text only), its prompt holding
each image's placeholder run. The images of the batch go through the tower once, in sequence order, and
the rows take the mRoPE positions of their grids -- the computation of ``model(tokens, pixel_values=...,
grid_thw=...)`` on the same padded batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lockstep import numerics
from lockstep.config.base import ConfigError
from lockstep.generate.sampling import token_logprobs


def _as_ids(seq) -> list[int]:
    return seq.tolist() if isinstance(seq, torch.Tensor) else [int(t) for t in seq]


#: one sequence's images: ``(pixel_values [P, D], grid_thw [N, 3])``, or None (text only)
SequenceImages = Optional[tuple[torch.Tensor, torch.Tensor]]


def _image_batch(model: nn.Module, ids: list[list[int]], images: Sequence[SequenceImages] | None,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """``pixel_values``/``grid_thw`` of the batch's images in sequence order (empty: no images), checked
    against the placeholders of each row."""
    if images is None or all(im is None for im in images):
        return {}
    if len(images) != len(ids):
        raise ConfigError(f"score_logprobs: images: {len(images)} entries for {len(ids)} sequences")
    config = model.config
    if not hasattr(model, "visual_inputs") or not hasattr(config, "image_token_id"):
        raise ConfigError(f"score_logprobs: images: model family {getattr(config, 'family', '?')!r} has no vision "
                          "tower")
    tower = config.vision
    merge = getattr(tower, "spatial_merge_size", None) or tower.merge_size  # Qwen3-VL's / MoonViT's name
    pixels, grids = [], []
    for i, im in enumerate(images):
        placeholders = ids[i].count(config.image_token_id)
        expected = 0 if im is None else int(im[1].prod(dim=1).sum()) // (merge * merge)
        if placeholders != expected:
            raise ConfigError(f"score_logprobs: images[{i}]: sequence {i} holds {placeholders} image placeholders, "
                              f"its images take {expected}")
        if im is not None:
            pixels.append(im[0].to(device))
            grids.append(im[1].to(device))
    return {"pixel_values": torch.cat(pixels), "grid_thw": torch.cat(grids)}


def check_sequences(sequences: Sequence[Sequence[int] | torch.Tensor], prompt_lengths: Sequence[int],
                    temperature: float | Sequence[float], vocab_size: int
                    ) -> tuple[list[list[int]], list[int], list[float]]:
    """``(token ids, prompt lengths, temperatures)`` as lists, checked (a ConfigError naming what is wrong):
    a prompt length in ``[1, len]``, ids inside the vocabulary, one temperature > 0 per sequence. Shared by
    ``score_logprobs`` and a pipeline's scoring (``PolicyObjective.pipeline_batch``)."""
    ids = [_as_ids(s) for s in sequences]
    lengths = [int(p) for p in prompt_lengths]
    if len(ids) != len(lengths):
        raise ConfigError(f"score_logprobs: {len(ids)} sequences but {len(lengths)} prompt_lengths")
    if not ids:
        return [], [], []
    temps = [float(temperature)] * len(ids) if isinstance(temperature, (int, float)) else [float(t) for t in temperature]
    if len(temps) != len(ids):
        raise ConfigError(f"score_logprobs: temperature: {len(temps)} values for {len(ids)} sequences")
    for i, (seq, p, t) in enumerate(zip(ids, lengths, temps)):
        if not 1 <= p <= len(seq):
            raise ConfigError(f"score_logprobs: prompt_lengths[{i}]: {p} is outside [1, {len(seq)}] "
                              f"(sequence {i} has {len(seq)} tokens)")
        if any(not 0 <= tok < vocab_size for tok in seq):
            raise ConfigError(f"score_logprobs: sequences[{i}] has token ids outside the vocabulary [0, {vocab_size})")
        if t <= 0:
            raise ConfigError(f"score_logprobs: temperature: must be > 0, got {t} (use 1 for greedy)")
    return ids, lengths, temps


def score_logprobs(model: nn.Module, sequences: Sequence[Sequence[int] | torch.Tensor],
                   prompt_lengths: Sequence[int], *, temperature: float | Sequence[float] = 1.0,
                   full_forward: bool = False, images: Sequence[SequenceImages] | None = None,
                   pad_to: int = 1) -> list[torch.Tensor]:
    """Per sequence, the fp32 log-probabilities ``[len - prompt_len]`` of its tokens after the prompt.

    ``sequences[i]`` is prompt + response token ids; ``prompt_lengths[i]`` (>= 1) how many are
    prompt. ``temperature`` (one, or one per sequence) is the T of ``log_softmax(logits / T)``, the
    distribution the engine sampled from (1 for greedy). The batch is right-padded to the longest
    sequence and run through ``model.trunk`` + ``model.output`` once; gradients flow unless the
    caller disables them. ``full_forward`` calls ``model(tokens)`` (every position through the head)
    instead of ``trunk`` + ``output`` on the response rows: a model wrapped by FSDP must be called
    through its root forward, and a tensor-parallel one's vocabulary-sharded logits are gathered whole. In batch-invariant mode both give the same bits (the head's rows do
    not depend on how many rows it gets). ``images``: per sequence, its images or None (module docstring).
    ``pad_to``: the padded width is a multiple of it (sequence parallelism splits the sequence evenly over
    the tp ranks; padding on the right changes no earlier position's logits).
    """
    ids, lengths, temps = check_sequences(sequences, prompt_lengths, temperature, model.config.vocab_size)
    if not ids:
        return []
    numerics.prepare_model(model)
    device = model.tok_embeddings.weight.device
    width = -(-max(len(s) for s in ids) // pad_to) * pad_to
    # one tensor from the padded lists (a graph capture records it as one constant)
    tokens = torch.tensor([seq + [0] * (width - len(seq)) for seq in ids], dtype=torch.long).to(device)
    rows = [(i, p - 1, len(s) - 1) for i, (s, p) in enumerate(zip(ids, lengths))]
    vision = _image_batch(model, ids, images, device)
    if full_forward:
        everything = model(tokens, **vision)
        if isinstance(everything, DTensor):  # a tensor-parallel head: logits sharded on the vocabulary
            everything = everything.full_tensor()  # gathered whole, as the generator's (differentiable)
        logits = torch.cat([everything[i, a:b] for i, a, b in rows])
    else:
        if vision:  # what the model's forward does with images, before the head
            # mRoPE (Qwen3-VL) from the grids; a family without it (Kimi K2.5) keeps plain positions
            image_positions = getattr(model, "image_positions", None)
            positions = image_positions(tokens, vision["grid_thw"])[0] if image_positions is not None else None
            h = model.trunk(tokens, positions, visual=model.visual_inputs(tokens, **vision))[2]
        else:
            h = model.trunk(tokens)[2]
        # only the rows that predict a response token go through the head
        logits = model.output(torch.cat([h[i, a:b] for i, a, b in rows]))
    targets = torch.cat([tokens[i, a + 1:b + 1] for i, a, b in rows])
    temp = torch.cat([torch.full((b - a,), t) for (_, a, b), t in zip(rows, temps)])
    scored = token_logprobs(logits, targets, temp)
    return list(scored.split([b - a for _, a, b in rows]))
