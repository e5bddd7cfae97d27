"""RL environments: answer extraction, scoring of known-right and known-wrong answers for every
built-in environment, math-verify equivalence, the calculator sandbox and its limits, the registry."""

from __future__ import annotations

import dataclasses
import time
from fractions import Fraction

import pytest

from lockstep.config.base import Config, ConfigError
from lockstep.rl.envs import (ArithmeticConfig, ArithmeticSource, Environment, Sandbox,
                              SandboxConfig, StepResult, Task, environment_config, extract_answer, get_environment,
                              list_environments, math_equal, register_environment)
from lockstep.rl.envs import safe_eval

pytest.importorskip("reasoning_gym")
pytest.importorskip("math_verify")

INLINE = {"isolation": "inline"}


def _wrong(answer: str) -> str:
    """A different integer whose text does not contain ``answer`` (reasoning-gym gives partial
    credit when the oracle is a substring of the answer)."""
    wrong = str(int(answer) + 1)
    assert answer not in wrong
    return wrong


# ------------------------------------------------------------------------------ extraction


def test_extract_answer_tags_and_last_number():
    assert extract_answer("x <answer> 3 </answer> then <answer>-4\n</answer>.") == "-4"  # the last, stripped
    assert extract_answer("no tags here 42") is None
    assert extract_answer("<answer>unclosed") is None
    assert extract_answer("so 3 + 4 = 7, and the total is -1,234.5 apples", "last_number") == "-1234.5"
    assert extract_answer("half: 1/2", "last_number") == "1/2"
    assert extract_answer("none at all", "last_number") is None
    with pytest.raises(ValueError, match="answer_format"):
        extract_answer("x", "boxed")


# -------------------------------------------------------------------------- reasoning-gym


@pytest.mark.parametrize("dataset", ["basic_arithmetic", "chain_sum"])
def test_reasoning_gym_numeric_right_and_wrong(dataset):
    env = get_environment(f"reasoning_gym:{dataset}")
    assert isinstance(env, Environment)
    for seed in range(5):
        task = env.reset(seed)
        assert task.messages[0]["role"] == "system" and "<answer>" in task.messages[0]["content"]
        assert task.messages[1]["content"] == task.data["problem"].question and task.stop == []
        right = env.step(env.reset(seed), f"Thinking... <answer>{task.answer}</answer>")
        assert (right.reward, right.done, right.info["answer"]) == (1.0, True, task.answer)
        assert env.step(env.reset(seed), f"<answer>{_wrong(task.answer)}</answer>").reward == 0.0
        assert env.step(env.reset(seed), f"the answer is {task.answer}").reward == 0.0  # no tags: no answer


def test_reasoning_gym_reset_is_deterministic_and_varies_with_seed():
    env = get_environment("reasoning_gym:chain_sum", seed=7)
    questions = [env.reset(s).messages[1]["content"] for s in range(6)]
    assert questions == [env.reset(s).messages[1]["content"] for s in range(6)]
    assert len(set(questions)) > 3
    other = get_environment("reasoning_gym:chain_sum", seed=8)
    assert [other.reset(s).messages[1]["content"] for s in range(6)] != questions


def test_reasoning_gym_countdown_scored_by_the_dataset():
    env = get_environment("reasoning_gym:countdown")
    for seed in range(3):
        task = env.reset(seed)
        assert env.step(task, f"<answer>{task.answer}</answer>").reward == 1.0
        # a well-formed but wrong expression: countdown's score_answer gives small partial credit only
        assert env.step(task, "<answer>1 + 1</answer>").reward < 0.1


def test_reasoning_gym_last_number_format():
    env = get_environment("reasoning_gym:basic_arithmetic", answer_format="last_number")
    task = env.reset(1)
    assert "final answer as a number" in task.messages[0]["content"]
    assert env.step(task, f"We compute step by step; the result is {task.answer}").reward == 1.0
    assert env.step(task, f"the result is {_wrong(task.answer)}").reward == 0.0


# ---------------------------------------------------------------------------- math-verify


@pytest.mark.parametrize("gold,answer,equal", [
    ("1/2", "0.5", True), ("0.5", "\\frac{1}{2}", True), ("3", "3.0", True), ("-94/5", "-18.8", True),
    ("42", "The answer is 42", True), ("1/3", "0.333", False), ("3", "4", False), ("3", "", False),
    ("3", None, False), ("3", "x", False),
])
def test_math_equal(gold, answer, equal):
    assert math_equal(gold, answer) is equal


def test_arithmetic_source_answers_are_exact():
    src = ArithmeticSource(ArithmeticConfig(max_terms=4, fraction_prob=0.3, decimal_prob=0.3, word_prob=0.2))
    for seed in range(60):
        p = src.problem(seed)
        assert p == src.problem(seed)
        value = safe_eval.evaluate(p.data["expression"])  # Python's precedence, floats
        assert float(Fraction(p.answer)) == pytest.approx(value, rel=1e-9, abs=1e-9), (seed, p)


def test_math_env_generated_scores_equivalent_forms():
    env = get_environment("math")
    seen_fraction = False
    for seed in range(20):
        task = env.reset(seed)
        gold = Fraction(task.answer)
        assert env.step(task, f"<answer>{task.answer}</answer>").reward == 1.0
        if gold.denominator in (2, 4, 5, 8, 10):  # exact decimal: another form of the same number
            seen_fraction |= gold.denominator != 1
            assert env.step(task, f"<answer>{float(gold)}</answer>").reward == 1.0
        assert env.step(task, f"<answer>{gold + 1}</answer>").reward == 0.0
        assert env.step(task, "I do not know").reward == 0.0
    assert seen_fraction


def test_math_env_on_reasoning_gym_questions():
    env = get_environment("math:gsm_symbolic")
    task = env.reset(0)
    assert env.step(task, f"<answer>{task.answer}</answer>").reward == 1.0
    assert env.step(task, f"<answer>{float(task.answer) + 0.5}</answer>").reward == 0.0


# --------------------------------------------------------------------------- the sandbox


@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_sandbox_results(isolation):
    box = Sandbox(SandboxConfig(isolation=isolation))
    cases = {"2*(3+4)": "14", "2^10": "1024", "7/2": "3.5", "sqrt(16)": "4", "-(3)": "-3", "10//3": "3",
             "factorial(5)": "120", "max(2, 9, 4)": "9", "2**100": str(2**100), "1/3": "0.333333333333"}
    results = box.evaluate_many(list(cases))
    assert [r.text for r in results] == list(cases.values())
    assert all(r.ok for r in results)


@pytest.mark.parametrize("expr,message", [
    ("import os", "syntax error"), ("(1", "syntax error"), ("__import__('os')", "unknown function '__import__'"),
    ("(1).real", "attribute access not allowed"), ("x + 1", "unknown name 'x'"), ("'a' * 3", "only numbers"),
    ("[1, 2]", "lists not allowed"), ("(lambda: 1)()", "unknown function"), ("9**9**9", "result too large"),
    ("factorial(100000)", "result too large"), ("1 << 100000", "result too large"), ("1/0", "division by zero"),
    ("10.0**400", "overflow"), ("sqrt(-1)", "math error"), ("True + 1", "only numbers"), ("", "empty"),
    ("1+" * 300 + "1", "too long"), ("round(2.5, ndigits=1)", "keyword arguments"),
])
def test_sandbox_refuses_with_an_error_reply(expr, message):
    for isolation in ("inline", "process"):
        result = Sandbox(SandboxConfig(isolation=isolation)).evaluate(expr)
        assert not result.ok and message in result.error, (isolation, result)
        assert result.text.startswith("error: ")


def test_sandbox_time_limit_kills_the_process():
    # the size guard is off (max_int_bits=0), so only the process limit stops a power that takes minutes
    box = Sandbox(SandboxConfig(max_int_bits=0, timeout_s=1.0))
    start = time.monotonic()
    result = box.evaluate("3 ** (10 ** 8)")
    assert time.monotonic() - start < 10
    assert not result.ok and "time limit exceeded (1 s)" in result.error
    quick = Sandbox(SandboxConfig(max_int_bits=0)).evaluate_many(["1 + 1", "2 * 3"])
    assert [r.value for r in quick] == ["2", "6"]


def test_sandbox_memory_limit():
    # 1 << 2**33 needs a 1 GiB integer: refused by RLIMIT_AS (64 MiB) in the child, not allocated
    result = Sandbox(SandboxConfig(max_int_bits=0, memory_mb=64)).evaluate("1 << (8 * 2**30)")
    assert not result.ok and "memory limit exceeded" in result.error
    # the same expression under the default guard is refused before it runs
    assert "result too large" in Sandbox(SandboxConfig(**INLINE)).evaluate("1 << (8 * 2**30)").error


def test_sandbox_config_errors():
    with pytest.raises(ConfigError, match="sandbox.isolation"):
        SandboxConfig(isolation="docker").validate()
    with pytest.raises(ConfigError, match="sandbox.memory_mb"):
        SandboxConfig(memory_mb=8).validate()


# ---------------------------------------------------------------------------- calculator


def test_calculator_multi_turn_protocol():
    env = get_environment("calculator", sandbox=SandboxConfig(**INLINE))
    task = env.reset(2)
    assert task.stop == ["</calc>"] and "<calc>" in task.messages[0]["content"]
    step = env.step(task, "First <calc>2*(3+4)</calc>")
    assert (step.reply, step.done, step.reward) == ("<result>14</result>", False, None)
    step = env.step(task, "<calc>import os</calc>")
    assert not step.done and step.reply.startswith("<result>error: syntax error")
    assert task.state == {"calls": 2, "errors": 1}
    assert env.step(task, f"so <answer>{task.answer}</answer>") == StepResult(
        reward=1.0, done=True, info={"answer": task.answer, "calls": 2, "errors": 1})
    assert env.step(env.reset(2), f"<answer>{Fraction(task.answer) + 1}</answer>").reward == 0.0
    assert env.step(env.reset(2), "I give up").reward == 0.0  # neither a call nor an answer: scored as is


def test_calculator_call_budget():
    env = get_environment("calculator", max_calls=1, sandbox=SandboxConfig(**INLINE))
    task = env.reset(0)
    assert env.step(task, "<calc>1+1</calc>").reply == "<result>2</result>"
    over = env.step(task, "<calc>2+2</calc>")
    assert not over.done and "no calculator calls left" in over.reply
    assert env.step(task, "<calc>3+3</calc>") == StepResult(
        reward=0.0, done=True, info={"answer": None, "error": "too many calls", **task.state})


def test_calculator_process_sandbox_and_reasoning_gym_source():
    env = get_environment("calculator:basic_arithmetic")  # default sandbox: a child process
    assert env.sandbox.config.isolation == "process"
    task = env.reset(0)
    assert env.step(task, "<calc>-1515 / 5</calc>").reply == "<result>-303</result>"
    assert env.step(task, f"<answer>{task.answer}</answer>").reward == 1.0


# ------------------------------------------------------------------------------ registry


def test_registry_names_and_errors():
    names = list_environments()
    assert {"reasoning_gym:<dataset>", "math:<source>", "calculator:<source>"} <= set(names)
    cfg = environment_config("reasoning_gym:countdown", size=10)
    assert (cfg.dataset, cfg.size) == ("countdown", 10)
    with pytest.raises(ConfigError, match="unknown environment 'nope'"):
        get_environment("nope")
    with pytest.raises(ConfigError, match=r"\.dataset: 'not_a_dataset' is neither"):
        get_environment("reasoning_gym:not_a_dataset")
    with pytest.raises(ConfigError, match=r"no field\(s\) \['colour'\]"):
        environment_config("math", colour="red")
    with pytest.raises(ConfigError, match="given twice"):
        environment_config("math:gsm_symbolic", source="chain_sum")
    with pytest.raises(ConfigError, match="max_calls"):
        environment_config("calculator", max_calls=-1)


class _ConstantEnv:
    name = "constant"

    def __init__(self, reward: float) -> None:
        self.reward = reward

    def reset(self, seed: int) -> Task:
        return Task(messages=[{"role": "user", "content": f"say anything ({seed})"}])

    def step(self, task: Task, response: str) -> StepResult:
        return StepResult(reward=self.reward, done=True)


@register_environment("test_constant")
@dataclasses.dataclass(kw_only=True)
class _ConstantConfig(Config):
    """Always the same reward (a user-defined environment)."""

    reward: float = 0.5

    def build(self) -> _ConstantEnv:
        return _ConstantEnv(self.reward)


def test_register_a_user_environment():
    env = get_environment("test_constant", reward=0.25)
    assert isinstance(env, Environment)
    assert env.step(env.reset(0), "hi").reward == 0.25
    assert list_environments()["test_constant"] == "Always the same reward (a user-defined environment)."
    with pytest.raises(ConfigError, match="takes no ':argument'"):
        get_environment("test_constant:x")
    with pytest.raises(ValueError, match="already registered"):
        register_environment("test_constant")(dataclasses.dataclass(kw_only=True)(type("Other", (Config,), {})))


def test_step_result_check():
    StepResult(reward=1.0, done=True).check()
    StepResult(reply="", done=False).check()
    with pytest.raises(ValueError, match="StepResult.reward"):
        StepResult(done=True).check()
    with pytest.raises(ValueError, match="StepResult.reply"):
        StepResult(reward=1.0).check()


def test_echo_rewards_similarity_and_is_deterministic():
    env = get_environment("echo", words=3)
    task = env.reset(7)
    assert task == env.reset(7) and len(task.answer.split()) == 3
    assert env.step(task, task.answer).reward == 1.0
    partial = env.step(task, task.answer[:5]).reward
    assert 0 < partial < 1
    assert env.step(task, "").reward == 0.0
