"""``echo``: repeat a few words; the reward is how similar the reply is (dense, in [0, 1]).

A debugging environment: even a random model's replies get different, non-zero rewards, so every
GRPO group has reward variance and every step a non-zero policy gradient. That is what smoke tests
of the RL plumbing (weight sync, staleness, trainer/generator agreement) need; a task a random
model never solves gives all-zero advantages and leaves the weights unchanged.
"""

from __future__ import annotations

import dataclasses
import difflib
import random

from lockstep.config.base import Config, require
from lockstep.rl.envs.base import StepResult, Task
from lockstep.rl.envs.registry import register_environment

WORDS = ("apple", "river", "stone", "light", "green", "seven", "cloud", "tiger", "music", "house",
         "bread", "night", "storm", "glass", "honey", "ocean", "paper", "smile", "train", "water")


class EchoEnv:
    name = "echo"

    def __init__(self, config: "EchoConfig") -> None:
        self.config = config

    def reset(self, seed: int) -> Task:
        rng = random.Random(seed)
        target = " ".join(rng.choice(WORDS) for _ in range(self.config.words))
        content = f"Repeat exactly: {target}"
        if self.config.preamble_words:  # long-prompt runs: a document to read past, then the instruction
            document = " ".join(rng.choice(WORDS) for _ in range(self.config.preamble_words))
            content = f"{document}\n\n{content}"
        messages = [{"role": "user", "content": content}]
        return Task(messages=messages, answer=target, data={"target": target}, task_id=f"echo#{seed}")

    def step(self, task: Task, response: str) -> StepResult:
        reply = response.strip()
        reward = difflib.SequenceMatcher(None, reply, task.data["target"]).ratio()
        return StepResult(reward=float(reward), done=True, info={"reply": reply[:80]})


@register_environment("echo")
@dataclasses.dataclass(kw_only=True)
class EchoConfig(Config):
    """Repeat a few words; reward = character similarity (difflib ratio), dense, for smoke tests."""

    #: words to repeat
    words: int = 3
    #: words of random filler text before the instruction (0: none): long prompts at no cost to the task
    preamble_words: int = 0

    def validate(self, path: str = "environment") -> None:
        require(isinstance(self.preamble_words, int) and self.preamble_words >= 0, f"{path}.preamble_words",
                f"must be an integer >= 0, got {self.preamble_words!r}")
        require(isinstance(self.words, int) and self.words >= 1, f"{path}.words", f"must be an integer >= 1, got {self.words!r}")

    def build(self) -> EchoEnv:
        self.validate()
        return EchoEnv(self)
