"""What a step's forward computes: the objective, the one piece a workload plugs into the step seam.

``ParallelRuntime.loss_and_backward(batch, accumulate, timer, objective=...)`` wraps an
:class:`Objective` with the layout's pieces (the batch on the device, autocast, ``loss_parallel``
under tensor parallelism, the ``forward``/``backward`` timer stages, ``1 / accumulate`` and the
backward itself). The objective only runs the model and builds the loss:
``objective(model, batch) -> (loss, report)``, ``loss`` the tensor to differentiate and
``report`` a :class:`~lockstep.run.step.StepLoss` of detached values. Pretraining uses
:class:`LMObjective` (the default); RL's policy-gradient objective is
:class:`lockstep.rl.objective.PolicyObjective`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.compile.local import local_compile
from lockstep.run.step import StepLoss


class Objective(Protocol):
    def __call__(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, StepLoss]:
        """One micro-batch's forward: the loss to backpropagate (before the runtime's
        ``1 / accumulate``) and the micro-batch's report (detached tensors, no host sync)."""
        ...


@local_compile("loss")
def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class LMObjective:
    """Next-token cross-entropy of ``(inputs, targets)`` ``[B, T]`` plus the model's auxiliary
    losses (MoE balance terms), with its module metrics in the report. An image+text batch
    (:class:`~lockstep.data.image_samples.ImageTextBatch`) passes its images to the model; its
    ``IGNORE`` targets (image placeholders, padding) are not scored.

    ``context``: a ContextParallel (cp > 1): each rank runs its share of every sequence
    (``shard_batch``) and backpropagates its part of the global mean; the report holds that mean.
    """

    def __init__(self, context=None) -> None:
        self.context = context

    def __call__(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, StepLoss]:
        if not isinstance(batch, (tuple, list)):  # an ImageTextBatch: its images go to the model
            if self.context is not None:
                raise ValueError("LMObjective: image+text batches do not run under context parallel (cp > 1)")
            local = main = lm_loss(model(batch.tokens, **batch.model_inputs()), batch.targets)
        elif self.context is None:
            inputs, targets = batch
            local = main = lm_loss(model(inputs), targets)
        else:
            inputs, targets = batch
            inputs, targets, positions = self.context.shard_batch(inputs, targets)
            local, main = self.context.cross_entropy(model(inputs, positions=positions), targets)
        aux_losses, metrics = model.pop_auxiliary()
        # under cp each auxiliary loss is this rank's part of the whole sequences' value
        aux_report = ({k: v.detach() for k, v in aux_losses.items()} if self.context is None
                      else self.context.report_auxiliary(aux_losses))
        report = StepLoss(main.detach(), aux_report, metrics)
        return local + sum(aux_losses.values()), report
