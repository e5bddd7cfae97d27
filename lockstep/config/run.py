"""The fields every run's root config has (``TrainerConfig``, ``RLConfig``): recipe name, length,
interruption, resume, seed, run directory and initial weights, with their checks."""

from __future__ import annotations

import dataclasses

from lockstep.config.base import Config, check_finite, require


@dataclasses.dataclass(kw_only=True)
class RunConfig(Config):
    """A run's identity and extent; subclasses add the components."""

    #: the recipe this config came from (informational)
    recipe: str = "custom"
    #: optimizer steps to run (the LR schedule spans them)
    steps: int = 100
    #: end this invocation after this step, as an interruption would (0 = run to ``steps``)
    stop_after: int = 0
    #: continue from the latest complete checkpoint in run_dir (or checkpoint.storage)
    resume: bool = False
    #: seed of weights init, data order, sampling and everything random
    seed: int = 0
    #: run directory; empty means runs/<recipe>-<timestamp>
    run_dir: str = ""
    #: start from these weights: a Hugging Face dir, a lockstep/run dir, or a name ("smollm2"); empty = random init
    init_from: str = ""
    #: also load init_from weights that carry no lockstep checksums (third-party HF directories)
    allow_unverified_weights: bool = False

    def validate_run(self) -> None:
        check_finite(self)  # the whole tree: subclasses' validate() need not call Config.validate
        require(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        require(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")
        require(0 <= self.stop_after <= self.steps, "stop_after", f"must be in [0, steps={self.steps}], "
                f"got {self.stop_after}")
        require(not self.resume or bool(self.run_dir), "resume", "needs --run-dir: the run to continue")
