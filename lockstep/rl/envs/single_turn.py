"""Single-turn verifiable tasks: one prompt, one response, a reward from checking the final answer.

- ``reasoning_gym:<dataset>`` (:class:`ReasoningGymConfig`): a reasoning-gym procedural dataset
  (``basic_arithmetic``, ``chain_sum``, ``countdown``, ``gsm_symbolic``, ...), scored by the
  dataset's own ``score_answer`` (1.0 correct; some datasets give partial credit, e.g. countdown
  0.05 for a well-formed wrong expression).
- ``math[:<source>]`` (:class:`MathConfig`): generated arithmetic (``source="arithmetic"``, exact
  rational answers) or a reasoning-gym dataset's questions, scored 1/0 by ``math-verify``
  equivalence with the reference answer (so "0.5", "1/2" and "\\frac{1}{2}" all count).

The system prompt asks for the answer format (``answer_format``: ``<answer>...</answer>`` tags by
default, or the last number in the reply); :func:`lockstep.rl.envs.base.extract_answer` reads it.
A response without an answer in that format scores 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from lockstep.config.base import Config, require, require_choice, require_positive
from lockstep.rl.envs.base import ANSWER_FORMATS, StepResult, Task, extract_answer, format_instruction
from lockstep.rl.envs.registry import register_environment
from lockstep.rl.envs.sources import (ARITHMETIC, ArithmeticConfig, ArithmeticSource, Problem, ReasoningGymSource,
                                      check_reasoning_gym_dataset, math_equal)

DEFAULT_SYSTEM = "Solve the problem. Think step by step if it helps, then give the answer."


def system_prompt(custom: str, answer_format: str) -> str:
    """``custom`` (or the default instruction) followed by the answer-format instruction."""
    return f"{custom or DEFAULT_SYSTEM} {format_instruction(answer_format)}"


class SingleTurnEnv:
    """One question from ``problem(seed)``; the one response is scored by ``score(problem, answer)``."""

    def __init__(self, name: str, problem: Callable[[int], Problem],
                 score: Callable[[Problem, str | None], float], *, answer_format: str = "tags",
                 system: str = "") -> None:
        require_choice(answer_format, ANSWER_FORMATS, "answer_format")
        self.name, self._problem, self._score = name, problem, score
        self.answer_format, self.system = answer_format, system_prompt(system, answer_format)

    def reset(self, seed: int) -> Task:
        p = self._problem(seed)
        messages = [{"role": "system", "content": self.system}, {"role": "user", "content": p.question}]
        return Task(messages=messages, answer=p.answer, data={"problem": p}, task_id=f"{self.name}#{seed}")

    def step(self, task: Task, response: str) -> StepResult:
        answer = extract_answer(response, self.answer_format)
        reward = self._score(task.data["problem"], answer)
        return StepResult(reward=float(reward), done=True, info={"answer": answer})


def _rg_fields(path: str, size: int, dataset_kwargs: dict[str, Any]) -> None:
    require_positive(size, f"{path}.size")
    require(isinstance(dataset_kwargs, dict), f"{path}.dataset_kwargs",
            f"must be a dict of reasoning-gym options, got {type(dataset_kwargs).__name__}")


@register_environment("reasoning_gym", argument="dataset")
@dataclasses.dataclass(kw_only=True)
class ReasoningGymConfig(Config):
    """A reasoning-gym dataset, scored by its own score_answer (single turn)."""

    #: reasoning-gym dataset name (reasoning_gym.factory.DATASETS)
    dataset: str = "basic_arithmetic"
    #: entries in the procedural dataset; reset(seed) takes entry seed % size
    size: int = 100_000
    #: the dataset's generation seed
    seed: int = 0
    #: extra options of the dataset's config (e.g. {"min_terms": 2, "max_terms": 3})
    dataset_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: "tags" (<answer>...</answer>) or "last_number"
    answer_format: str = "tags"
    #: system prompt before the format instruction ("" = a generic one)
    system_prompt: str = ""

    def validate(self, path: str = "environment") -> None:
        check_reasoning_gym_dataset(self.dataset, f"{path}.dataset")
        _rg_fields(path, self.size, self.dataset_kwargs)
        require_choice(self.answer_format, ANSWER_FORMATS, f"{path}.answer_format")

    def build(self) -> SingleTurnEnv:
        self.validate()
        source = ReasoningGymSource(self.dataset, size=self.size, seed=self.seed, kwargs=self.dataset_kwargs)
        return SingleTurnEnv(f"reasoning_gym:{self.dataset}", source.problem, source.score,
                             answer_format=self.answer_format, system=self.system_prompt)


@register_environment("math", argument="source")
@dataclasses.dataclass(kw_only=True)
class MathConfig(Config):
    """Math answers checked by math-verify equivalence (single turn)."""

    #: "arithmetic" (generated, see ``arithmetic``) or a reasoning-gym dataset name (its questions and answers)
    source: str = ARITHMETIC
    #: the generator, when source is "arithmetic"
    arithmetic: ArithmeticConfig = dataclasses.field(
        default_factory=lambda: ArithmeticConfig(fraction_prob=0.3, decimal_prob=0.2, word_prob=0.3))
    #: reasoning-gym dataset size, seed and options (other sources)
    size: int = 100_000
    seed: int = 0
    dataset_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: "tags" (<answer>...</answer>) or "last_number"
    answer_format: str = "tags"
    system_prompt: str = ""
    #: math-verify's parse/verify timeout in seconds (signal based: main thread only); 0 = none
    timeout_s: int = 5

    def validate(self, path: str = "environment") -> None:
        if self.source == ARITHMETIC:
            self.arithmetic.validate(f"{path}.arithmetic")
        else:
            check_reasoning_gym_dataset(self.source, f"{path}.source")
        _rg_fields(path, self.size, self.dataset_kwargs)
        require_choice(self.answer_format, ANSWER_FORMATS, f"{path}.answer_format")
        require(isinstance(self.timeout_s, int) and self.timeout_s >= 0, f"{path}.timeout_s",
                f"must be an integer >= 0 (0 = no timeout), got {self.timeout_s!r}")

    def build(self) -> SingleTurnEnv:
        self.validate()
        problem = problem_source(self.source, self.arithmetic, self.size, self.seed, self.dataset_kwargs)
        timeout = self.timeout_s or None

        def score(p: Problem, answer: str | None) -> float:
            return 1.0 if math_equal(p.answer, answer, timeout_s=timeout) else 0.0

        return SingleTurnEnv(f"math:{self.source}", problem, score, answer_format=self.answer_format,
                             system=self.system_prompt)


def problem_source(source: str, arithmetic: ArithmeticConfig, size: int, seed: int,
                   dataset_kwargs: dict[str, Any]) -> Callable[[int], Problem]:
    """``problem(seed)`` of the generator (``source="arithmetic"``) or of a reasoning-gym dataset."""
    if source == ARITHMETIC:
        return ArithmeticSource(arithmetic).problem
    return ReasoningGymSource(source, size=size, seed=seed, kwargs=dataset_kwargs).problem
