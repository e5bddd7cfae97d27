"""What a run does when a step's loss or gradient norm is not finite (``training.on_nonfinite``).

The check costs no extra host synchronisation: the step's loss is reduced once per step anyway and the
clipped gradient norm (a tensor, the same on every rank) is read once for the record; both are looked
at after the backward and BEFORE the optimizer step, so a non-finite gradient never reaches the
weights. Every rank takes the same decision (both values are global).

- ``stop`` (default): raise :class:`NonFiniteError` naming the step; nothing is saved from that state
  (the run's last checkpoint stays the newest, the final weights are not written).
- ``skip_step``: drop the update (no optimizer step, gradients discarded); the LR schedule still
  advances (it is a function of the step number), the step is counted in ``nonfinite/skipped_steps``.
- ``rollback``: drop the update, reload model and optimizer from the newest checkpoint and continue
  from its step; the data loader is NOT rewound, so the offending batches are skipped. Counted in
  ``nonfinite/rollbacks``; at most ``training.max_rollbacks`` per run, then it stops as ``stop`` does.
  No checkpoint to go back to is a stop, too. RL (``lockstep.rl.trainer``) reloads the same way but
  its step count and policy version go on (generators only see increasing versions): the restored
  weights are the next version sent.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from lockstep.config.base import require, require_choice

#: the choices of ``training.on_nonfinite``
NONFINITE_POLICIES = ["stop", "skip_step", "rollback"]


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm was not finite and the policy says stop (a one-line message)."""


def validate_nonfinite(policy: str, max_rollbacks: int, path: str) -> None:
    require_choice(policy, NONFINITE_POLICIES, f"{path}.on_nonfinite")
    require(max_rollbacks >= 1, f"{path}.max_rollbacks", f"must be >= 1, got {max_rollbacks}")


def nonfinite_values(**values: float | None) -> list[str]:
    """The names of the values that are not finite (None: not computed on this rank, skipped)."""
    return [name for name, v in values.items() if v is not None and not math.isfinite(v)]


class NonFiniteGuard:
    """Applies the policy. ``rollback``: a callable reloading the newest checkpoint and returning its
    step (None when there is none), given by the loop that owns the checkpoints."""

    def __init__(self, policy: str, *, max_rollbacks: int = 3,
                 rollback: Callable[[], int | None] | None = None) -> None:
        self.policy, self.max_rollbacks, self._rollback = policy, max_rollbacks, rollback
        self.skipped = 0
        self.rollbacks = 0

    def handle(self, step: int, bad: list[str], values: dict[str, float | None]) -> int | None:
        """Called for a non-finite step (its update already dropped). Returns the step to continue
        after (rollback), or None to carry on (skip_step); raises NonFiniteError to stop."""
        what = ", ".join(f"{name}={values[name]!r}" for name in bad)
        if self.policy == "skip_step":
            self.skipped += 1
            return None
        if self.policy == "rollback":
            if self.rollbacks >= self.max_rollbacks:
                raise NonFiniteError(f"step {step}: non-finite {what} after {self.rollbacks} rollback(s) "
                                     f"(training.max_rollbacks={self.max_rollbacks}); stopped, nothing saved "
                                     "from the non-finite state")
            restored = self._rollback() if self._rollback is not None else None
            if restored is None:
                raise NonFiniteError(f"step {step}: non-finite {what}; training.on_nonfinite=rollback, but there "
                                     "is no checkpoint to roll back to (set checkpoint.every); stopped")
            self.rollbacks += 1
            return restored
        raise NonFiniteError(f"step {step}: non-finite {what}; stopped (training.on_nonfinite=stop), nothing "
                             "saved from the non-finite state: the last checkpoint is intact")

    def record(self) -> dict[str, int]:
        """The counters for the step's metrics record (only the policy's own counter)."""
        if self.policy == "skip_step":
            return {"nonfinite/skipped_steps": self.skipped}
        if self.policy == "rollback":
            return {"nonfinite/rollbacks": self.rollbacks}
        return {}
