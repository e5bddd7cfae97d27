"""A multi-turn tool environment: the model may call a calculator before it answers.

Protocol (stated in the system prompt):

- the model writes ``<calc>EXPRESSION</calc>``; generation stops at ``</calc>`` (the task's stop
  string) and the environment replies ``<result>VALUE</result>`` (or ``<result>error: ...</result>``),
  which the rollout appends (masked out of the loss) before the model continues its turn;
- the model ends with ``<answer>...</answer>``: the episode is done and scored.

A turn that neither ends in a calculator call nor contains an answer is scored as it stands (no
answer: 0). After ``max_calls`` calls the next call is answered with an error telling the model to
answer now; one more turn without an answer ends the episode with reward 0.

Expressions go to a :class:`~lockstep.rl.envs.sandbox.Sandbox` (an AST-whitelisted arithmetic
evaluator, by default in a time- and memory-limited child process). Problems come from the
arithmetic generator (big operands, so the calculator helps; scored by math-verify) or from a
reasoning-gym dataset (scored by the dataset's ``score_answer``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from lockstep.config.base import Config, require
from lockstep.rl.envs.base import StepResult, Task, extract_answer
from lockstep.rl.envs.registry import register_environment
from lockstep.rl.envs.sandbox import Sandbox, SandboxConfig
from lockstep.rl.envs.sources import (ARITHMETIC, ArithmeticConfig, ArithmeticSource, Problem, ReasoningGymSource,
                                      check_reasoning_gym_dataset, math_equal)

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
#: a calculator call at the very end of a turn (where the stop string cut it)
_TRAILING_CALL = re.compile(r"<calc>((?:(?!<calc>).)*)</calc>\s*$", re.DOTALL)

SYSTEM = ("You can use a calculator. To compute something, write <calc>expression</calc>, for example "
          "<calc>2*(3+4)</calc>, and stop; the result comes back as <result>14</result>. Expressions may use "
          "numbers, + - * / // % ** and sqrt, log, exp, sin, cos, floor, ceil, abs, round, min, max. "
          "When you know the answer, give it inside <answer></answer> tags, for example <answer>42</answer>.")


@register_environment("calculator", argument="source")
@dataclasses.dataclass(kw_only=True)
class CalculatorConfig(Config):
    """Multi-turn: calculator calls <calc>...</calc> -> <result>...</result>, then a scored <answer>."""

    #: "arithmetic" (generated, scored by math-verify) or a reasoning-gym dataset (its score_answer)
    source: str = ARITHMETIC
    #: the generator, when source is "arithmetic": large operands make the calculator worth calling
    arithmetic: ArithmeticConfig = dataclasses.field(
        default_factory=lambda: ArithmeticConfig(min_terms=2, max_terms=4, max_value=9999))
    #: reasoning-gym dataset size, seed and options (other sources)
    size: int = 100_000
    seed: int = 0
    dataset_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: calculator calls answered per episode
    max_calls: int = 4
    #: where expressions are evaluated, and their limits
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)
    #: the system prompt ("" = the built-in one describing the protocol)
    system_prompt: str = ""

    def validate(self, path: str = "environment") -> None:
        if self.source == ARITHMETIC:
            self.arithmetic.validate(f"{path}.arithmetic")
        else:
            check_reasoning_gym_dataset(self.source, f"{path}.source")
        require(isinstance(self.size, int) and self.size >= 1, f"{path}.size", f"must be >= 1, got {self.size!r}")
        require(isinstance(self.max_calls, int) and self.max_calls >= 0, f"{path}.max_calls",
                f"must be an integer >= 0, got {self.max_calls!r}")
        self.sandbox.validate(f"{path}.sandbox")

    def build(self) -> "CalculatorEnv":
        return CalculatorEnv(self)


class CalculatorEnv:
    """See the module docstring."""

    def __init__(self, config: CalculatorConfig) -> None:
        config.validate()
        self.config = config
        self.name = f"calculator:{config.source}"
        self.sandbox = Sandbox(config.sandbox)
        if config.source == ARITHMETIC:
            self._problem = ArithmeticSource(config.arithmetic).problem
            self._score = lambda p, answer: 1.0 if math_equal(p.answer, answer) else 0.0
        else:
            rg = ReasoningGymSource(config.source, size=config.size, seed=config.seed, kwargs=config.dataset_kwargs)
            self._problem, self._score = rg.problem, rg.score

    def reset(self, seed: int) -> Task:
        p: Problem = self._problem(seed)
        messages = [{"role": "system", "content": self.config.system_prompt or SYSTEM},
                    {"role": "user", "content": p.question}]
        return Task(messages=messages, answer=p.answer, data={"problem": p}, stop=[CALL_CLOSE],
                    state={"calls": 0, "errors": 0}, task_id=f"{self.name}#{seed}")

    def step(self, task: Task, response: str) -> StepResult:
        answer = extract_answer(response, "tags")
        call = _TRAILING_CALL.search(response) if answer is None else None
        if call is None:
            reward = self._score(task.data["problem"], answer)
            return StepResult(reward=float(reward), done=True, info={"answer": answer, **task.state})
        if task.state.get("over_budget"):
            return StepResult(reward=0.0, done=True, info={"answer": None, "error": "too many calls", **task.state})
        task.state["calls"] += 1
        if task.state["calls"] > self.config.max_calls:
            task.state["over_budget"] = True
            text = f"error: no calculator calls left ({self.config.max_calls} used); give the answer now"
        else:
            result = self.sandbox.evaluate(call.group(1))
            text = result.text
            task.state["errors"] += 0 if result.ok else 1
        return StepResult(reply=f"{RESULT_OPEN}{text}{RESULT_CLOSE}", done=False,
                          info={"expression": call.group(1), "result": text})
