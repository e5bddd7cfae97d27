"""RL's objective for the step seam: the policy-gradient loss of one micro-batch of episodes.

The learner hands each micro-batch to ``ParallelRuntime.loss_and_backward(batch,
objective=PolicyObjective(...))``, as pretraining hands its token batches with the LM objective:
the runtime places the batch, wraps the forward (autocast, timer stages) and runs the backward.
:class:`PolicyObjective` is what differs: ``score_logprobs`` of the episodes (the one
log-probability function the engine also uses), the frozen reference's scores without gradients
(when ``kl_coef > 0``), and the policy loss against the generator's (or the trainer's own)
log-probabilities.

Under a pipeline (``parallel.pp > 1``) the runtime runs the objective's pipeline halves instead:
``pipeline_batch`` packs the micro-batch into the schedule's inputs (token ids ``[B, W]``) and target
(per position, float32 ``[B, W, k]``: the next token, its mask, the generator's log-prob, the advantage,
the row's temperature, row index and keep flag, and the reference's log-prob), which torch's schedule
splits into its micro-batches like LM targets; ``pipeline_loss`` is the last stage's loss of one of them
(``token_logprobs`` of its logits, the policy loss with the whole step's normaliser: the pieces add up
to the micro-batch's loss); ``pipeline_report`` assembles the scores in episode order and reports what
the one-forward path reports. The frozen reference runs forward-only through its own pipeline
(``ParallelRuntime.shard_frozen``) before the step. Context parallel is refused by ``RLConfig``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import nn

from lockstep.generate.sampling import token_logprobs
from lockstep.rl.losses import PolicyLoss
from lockstep.rl.scoring import check_sequences, score_logprobs
from lockstep.run.step import StepLoss


#: channels of the packed per-position target of a pipeline step (``PolicyObjective.pipeline_batch``)
_ID, _MASK, _GEN, _ADV, _TEMP, _ROW, _KEEP, _REF = range(8)
_CHANNELS = 8
#: float32 holds every integer up to 2 ** 24 exactly (the token ids of the target)
_EXACT_IDS = 2 ** 24


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
        # a pipeline step's state: the step's normaliser, the schedule micro-batches' scores (row index, logp)
        # and the reference's scores by position
        self._normaliser: float | None = None
        self._pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._last_ref: torch.Tensor | None = None
        self._tp_mesh = None  # a tensor-parallel pipeline's tp mesh (the last stage's logits are vocabulary shards)

    def _score(self, model: nn.Module, batch: PolicyBatch, full_forward: bool) -> list[torch.Tensor]:
        out = score_logprobs(model, batch.sequences, batch.prompt_lengths, temperature=batch.temperatures,
                             full_forward=full_forward, images=batch.images, pad_to=self.tp)
        if hasattr(model, "pop_auxiliary"):
            model.pop_auxiliary()  # MoE balance terms of this forward are not part of the RL loss
        return out

    def __call__(self, model: nn.Module, batch: PolicyBatch) -> tuple[torch.Tensor, PolicyStepLoss]:
        scored = self._score(model, batch, full_forward=self.full_forward)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = pad_rows(self._score(self.reference, batch, full_forward=self.full_forward), batch.width)
        loss, report = self._loss(scored, ref, batch)
        return loss * self.dp, report

    def _loss(self, scored: list[torch.Tensor], ref: torch.Tensor | None,
              batch: PolicyBatch) -> tuple[torch.Tensor, PolicyStepLoss]:
        """The policy loss of a micro-batch's response scores and its report (both paths)."""
        gen = batch.generator_logp
        old = gen if self.ratio_to == "generator" else None
        loss, metrics = self.loss(pad_rows(scored, batch.width), batch.mask, batch.advantages, old_logp=old,
                                  ref_logp=ref, generator_logp=gen, keep=batch.keep, normaliser=batch.normaliser)
        report = PolicyStepLoss(loss.detach(), metrics={f"loss/{k}": v.detach() for k, v in metrics.items()},
                                logprobs=[s.detach() for s in scored])
        return loss, report

    # ------------------------------------------------------------------ the pipeline halves

    def pipeline_batch(self, pipeline, batch: PolicyBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens [B, W], target [B, W, k])`` for ``pipeline``'s schedule (collective over the pipeline
        when a reference scores first). Position ``j`` of row ``i`` predicts token ``j + 1``: response token
        ``r`` is predicted at ``prompt_len - 1 + r``. ``W``: the longest sequence rounded up to a multiple
        of 16 and of tp (right padding changes no earlier position; fewer shapes, fewer schedule set-ups;
        sequence parallelism splits it evenly)."""
        if batch.images is not None:
            raise ValueError("PolicyObjective: image batches do not run through a pipeline (parallel.pp > 1)")
        if self.reference is not None and getattr(self.reference, "pipeline", None) is None:
            raise ValueError("PolicyObjective: a pipelined policy's KL reference must be split like it "
                             "(ParallelRuntime.shard_frozen)")
        config = pipeline.model_parts[0].config
        if config.vocab_size > _EXACT_IDS:
            raise ValueError(f"PolicyObjective: token ids travel in a float32 target, exact below {_EXACT_IDS}; "
                             f"vocab_size is {config.vocab_size}")
        ids, _, temps = check_sequences(batch.sequences, batch.prompt_lengths, batch.temperatures, config.vocab_size)
        multiple = math.lcm(16, self.tp)
        rows, width = len(ids), -(-max(len(s) for s in ids) // multiple) * multiple
        tokens = torch.zeros(rows, width, dtype=torch.long)
        target = torch.zeros(rows, width, _CHANNELS, dtype=torch.float32)
        mask, gen = batch.mask.detach().cpu().float(), batch.generator_logp.detach().cpu().float()
        for i, (seq, p) in enumerate(zip(ids, batch.prompt_lengths)):
            n = len(seq) - p
            tokens[i, :len(seq)] = torch.tensor(seq)
            target[i, p - 1:p - 1 + n, _ID] = torch.tensor(seq[p:], dtype=torch.float32)
            target[i, p - 1:p - 1 + n, _MASK] = mask[i, :n]
            target[i, p - 1:p - 1 + n, _GEN] = gen[i, :n]
        target[..., _ADV] = batch.advantages.detach().cpu().float()[:, None]
        target[..., _TEMP] = torch.tensor(temps, dtype=torch.float32)[:, None]
        target[..., _ROW] = torch.arange(rows, dtype=torch.float32)[:, None]
        target[..., _KEEP] = batch.keep.detach().cpu().float()[:, None]
        device = batch.mask.device
        tokens, target = tokens.to(device), target.to(device)
        self._normaliser, self._pieces, self._tp_mesh = batch.normaliser, [], pipeline.tp_mesh
        if self.reference is not None:
            reference = self.reference.pipeline
            reference.eval_loss(tokens, target, loss_fn=self._reference_scores)
            if reference.has_last_stage:
                self._last_ref = self._assemble(rows, width)
                target[..., _REF] = self._last_ref
            self._pieces = []
        return tokens, target

    def _scores(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The log-probabilities ``[b, W]`` of one schedule micro-batch's next tokens (kept, by row)."""
        if self._tp_mesh is not None:  # the last stage's vocabulary shard: gathered whole (differentiable)
            from torch.distributed.tensor import DTensor, Shard

            logits = DTensor.from_local(logits, self._tp_mesh, [Shard(-1)], run_check=False).full_tensor()
        logp = token_logprobs(logits, target[..., _ID].long(), target[..., _TEMP])
        self._pieces.append((target[:, 0, _ROW].long(), logp.detach()))
        return logp

    def _reference_scores(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self._scores(logits, target)
        return logits.new_zeros((), dtype=torch.float32)

    def pipeline_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one schedule micro-batch (``* dp``: FSDP averages over the data ranks)."""
        logp = self._scores(logits, target)
        gen = target[..., _GEN]
        loss, _ = self.loss(logp, target[..., _MASK], target[..., _ADV],
                            old_logp=gen if self.ratio_to == "generator" else None,
                            ref_logp=target[..., _REF] if self.reference is not None else None, generator_logp=gen,
                            keep=target[:, 0, _KEEP].bool(), normaliser=self._normaliser)
        return loss * self.dp

    def _assemble(self, rows: int, width: int) -> torch.Tensor:
        """The schedule micro-batches' scores back in row order, ``[B, W]``."""
        out = torch.zeros(rows, width, dtype=torch.float32, device=self._pieces[0][1].device)
        for index, logp in self._pieces:
            out[index] = logp.float()
        return out

    def pipeline_report(self, pipeline, batch: PolicyBatch, loss: torch.Tensor | None) -> PolicyStepLoss:
        """On the last stage, the one-forward path's report from the schedule's scores (loss and metrics
        of the whole micro-batch; ``loss``, the pieces' sum, agrees to rounding); elsewhere an empty one."""
        if not pipeline.has_last_stage:
            self._pieces = []
            return PolicyStepLoss(None)
        ids = batch.sequences
        positions = self._assemble(len(ids), self._pieces[0][1].shape[1])
        self._pieces = []
        scored = [positions[i, p - 1:len(seq) - 1] for i, (seq, p) in enumerate(zip(ids, batch.prompt_lengths))]
        ref = None
        if self.reference is not None:  # the reference's scores travelled in the target; read them back
            ref = pad_rows([self._last_ref[i, p - 1:len(seq) - 1] for i, (seq, p) in
                            enumerate(zip(ids, batch.prompt_lengths))], batch.width)
        with torch.no_grad():
            return self._loss(scored, ref, batch)[1]
