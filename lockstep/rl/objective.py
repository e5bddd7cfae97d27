"""RL's objective for the step seam: the policy-gradient loss of one micro-batch of episodes.

The learner hands each micro-batch to ``ParallelRuntime.loss_and_backward(batch,
objective=PolicyObjective(...))``, as pretraining hands its token batches with the LM objective:
the runtime places the batch, wraps the forward (autocast, timer stages) and runs the backward.
:class:`PolicyObjective` is what differs: ``score_logprobs`` of the episodes (the one
log-probability function the engine also uses), the frozen reference's scores without gradients
(when ``kl_coef > 0``), and the policy loss against the generator's (or the trainer's own)
log-probabilities. The RL trainer runs on data-parallel layouts only (``RLConfig`` refuses tp, pp,
cp and ep with a ``parallel.*`` error), so this objective needs no tensor/context/pipeline pieces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from lockstep.rl.losses import PolicyLoss
from lockstep.rl.scoring import score_logprobs
from lockstep.run.step import StepLoss


def pad_rows(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Right-pad 1-d tensors with zeros to ``[len(rows), width]`` (keeping any autograd graph)."""
    return torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])


@dataclasses.dataclass
class PolicyBatch:
    """One micro-batch of episodes. Per-token tensors are ``[B, width]`` over the response
    (``width``: the step's longest response); ``normaliser`` is the whole step's loss denominator,
    so micro-batching does not change the loss."""

    sequences: list[list[int]]  # prompt + response token ids
    prompt_lengths: list[int]
    temperatures: list[float]
    mask: torch.Tensor  # 1 on tokens the policy generated
    generator_logp: torch.Tensor
    advantages: torch.Tensor  # [B]
    keep: torch.Tensor  # [B] bool: groups in the loss
    normaliser: float
    #: per episode, its prompt's images ``(pixel_values, grid_thw)`` or None (vision-language policies)
    images: list | None = None

    def to(self, device: torch.device) -> "PolicyBatch":
        return dataclasses.replace(self, mask=self.mask.to(device), generator_logp=self.generator_logp.to(device),
                                   advantages=self.advantages.to(device), keep=self.keep.to(device))

    @property
    def width(self) -> int:
        return self.mask.shape[1]


@dataclasses.dataclass
class PolicyStepLoss(StepLoss):
    """The report, plus the trainer's log-probabilities of each episode's response (detached; the
    learner compares them with the generator's)."""

    logprobs: list[torch.Tensor] = dataclasses.field(default_factory=list)


class PolicyObjective:
    """``loss(score_logprobs(model, episodes), ...) * dp``: FSDP averages gradients over the ``dp``
    trainer ranks and the step's loss is the sum of theirs. ``reference``: the frozen reference
    policy (scored without gradients) when the loss has a KL term. ``ratio_to``: ``"generator"``
    (the importance ratio against the generator's log-probabilities) or ``"current"``. ``full_forward``:
    score through the model's root forward (a distributed model: FSDP's root hooks, TP's sharded head).
    ``tp``: the tensor-parallel degree (sequence parallelism needs the padded width a multiple of it)."""

    def __init__(self, loss: PolicyLoss, *, reference: nn.Module | None = None, ratio_to: str = "generator",
                 dp: int = 1, full_forward: bool | None = None, tp: int = 1) -> None:
        self.loss, self.reference, self.ratio_to, self.dp, self.tp = loss, reference, ratio_to, dp, tp
        self.full_forward = dp > 1 if full_forward is None else full_forward

    def _score(self, model: nn.Module, batch: PolicyBatch, full_forward: bool) -> list[torch.Tensor]:
        out = score_logprobs(model, batch.sequences, batch.prompt_lengths, temperature=batch.temperatures,
                             full_forward=full_forward, images=batch.images, pad_to=self.tp)
        if hasattr(model, "pop_auxiliary"):
            model.pop_auxiliary()  # MoE balance terms of this forward are not part of the RL loss
        return out

    def __call__(self, model: nn.Module, batch: PolicyBatch) -> tuple[torch.Tensor, PolicyStepLoss]:
        scored = self._score(model, batch, full_forward=self.full_forward)
        logp = pad_rows(scored, batch.width)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = pad_rows(self._score(self.reference, batch, full_forward=self.full_forward), batch.width)
        gen = batch.generator_logp
        old = gen if self.ratio_to == "generator" else None
        loss, metrics = self.loss(logp, batch.mask, batch.advantages, old_logp=old, ref_logp=ref, generator_logp=gen,
                                  keep=batch.keep, normaliser=batch.normaliser)
        report = PolicyStepLoss(loss.detach(), metrics={f"loss/{k}": v.detach() for k, v in metrics.items()},
                                logprobs=[s.detach() for s in scored])
        return loss * self.dp, report
