"""RL environments against a served policy over HTTP (:mod:`lockstep.serve.agent`): the multi-turn
calculator end to end, and a scripted multi-turn environment whose turns are checked against the
lockstep Engine in-process (the first turn against the token-level rollout, later turns against the
engine continuing the assistant message)."""

from __future__ import annotations

import pytest

from lockstep.generate import Request, SamplingParams
from lockstep.rl.envs.base import StepResult, Task
from lockstep.rl.envs.calculator import CalculatorConfig
from lockstep.rl.rollout import RolloutConfig, rollout_batch
from lockstep.serve.agent import ChatPolicy, PolicyError, run_episode
from tests.serve.conftest import MODEL_NAME, reference_engine

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference(model_dir):
    return reference_engine(model_dir)


@pytest.fixture(scope="module")
def policy(server) -> ChatPolicy:
    return ChatPolicy(base_url=server.base_url, model=MODEL_NAME, max_tokens=MAX_TOKENS, temperature=0.0)


def greedy_text(reference, messages: list[dict[str, str]], stop: list[str], continue_final: bool) -> str:
    """What the engine writes for the conversation, continuing the final assistant message or not."""
    engine, source = reference
    text = source.chat_template.render(messages, add_generation_prompt=not continue_final)
    if continue_final:
        final = messages[-1]["content"]
        text = text[:text.rfind(final) + len(final)]
    [result] = engine.generate([Request(prompt_ids=source.tokenizer.encode(text), sampling=SamplingParams(
        max_new_tokens=MAX_TOKENS, temperature=0, stop=stop))])
    rest = source.tokenizer.decode(result.token_ids)[len(result.text):]
    return result.text + next((s for s in stop if result.finish_reason == "stop" and rest.startswith(s)), "")


class ScriptedEnv:
    """Replies ``<result>7</result>`` to the first two turns, then scores 1; stops turns at ``stop``."""

    name = "scripted"

    def __init__(self, stop: list[str]) -> None:
        self.stop, self.seen = stop, []

    def reset(self, seed: int) -> Task:
        return Task(messages=[{"role": "user", "content": f"what is {seed} + 7?"}], stop=list(self.stop),
                    state={"turns": 0}, task_id=f"scripted#{seed}")

    def step(self, task: Task, response: str) -> StepResult:
        self.seen.append(response)
        task.state["turns"] += 1
        if task.state["turns"] < 3:
            return StepResult(reply="<result>7</result>")
        return StepResult(reward=1.0, done=True, info={"turns": task.state["turns"]})


def test_calculator_environment_runs_against_the_server(policy, reference):
    env = CalculatorConfig(max_calls=2).build()
    ep = run_episode(env, policy, task_seed=3, max_turns=3)
    assert ep.done and ep.reward in (0.0, 1.0) and ep.env_name == "calculator:arithmetic"
    assert 1 <= len(ep.turns) <= 3 and ep.completion_tokens >= len(ep.turns)
    # the first turn is what the in-process token-level rollout gets (greedy, same engine configuration)
    engine, source = reference
    [episode] = rollout_batch(engine, env, [3], RolloutConfig(max_turns=1, sampling=SamplingParams(
        max_new_tokens=MAX_TOKENS, temperature=0)), chat_template=source.chat_template)
    assert ep.turns[0] == episode.turns[0].text


def test_multi_turn_continues_the_assistant_message(policy, reference):
    task_messages = [{"role": "user", "content": "what is 5 + 7?"}]
    free = greedy_text(reference, task_messages, [], continue_final=False)
    stop = [free[3:5]]  # the model writes this: the first turn ends at it (stop re-attached)
    env = ScriptedEnv(stop)
    ep = run_episode(env, policy, task_seed=5, max_turns=4)
    assert ep.done and ep.reward == 1.0 and len(ep.turns) == 3 and ep.replies == ["<result>7</result>"] * 2
    assert env.seen == ep.turns
    assert ep.turns[0] == free[:free.find(stop[0])] + stop[0]
    assert ep.assistant == ep.turns[0] + ep.replies[0] + ep.turns[1] + ep.replies[1] + ep.turns[2]
    for turn in (1, 2):  # later turns: the engine continuing turn + reply inside the assistant message
        so_far = "".join(t + r for t, r in zip(ep.turns[:turn], ep.replies[:turn]))
        want = greedy_text(reference, [*task_messages, {"role": "assistant", "content": so_far}], stop,
                           continue_final=True)
        assert ep.turns[turn] == want


def test_policy_errors_carry_the_server_message(server):
    bad = ChatPolicy(base_url=server.base_url + "/v1", model="nope")
    with pytest.raises(PolicyError, match="HTTP 400: model: unknown model 'nope'"):
        bad.complete([{"role": "user", "content": "hi"}])
