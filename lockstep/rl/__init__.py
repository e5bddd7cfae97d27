"""RL post-training on the shared model. So far: trainer-side scoring (``score_logprobs``)."""

from lockstep.rl.scoring import score_logprobs

__all__ = ["score_logprobs"]
