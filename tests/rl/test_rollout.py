"""Rollouts with the real engine, a tiny random lockstep model and the Shakespeare tokenizer:
exact token-in/token-out, mask and logprob alignment, GRPO groups, stop strings, truncation, seeds."""

from __future__ import annotations

import math

import pytest
import torch

from lockstep.config.base import ConfigError
from lockstep.data import DataConfig, Tokenizer, prepare
from lockstep.generate import ChatTemplate, Engine, EngineConfig, Request, SamplingParams
from lockstep.models.common.transformer import build_model
from lockstep.recipes import get_recipe
from lockstep.rl.envs import SandboxConfig, StepResult, Task, get_environment
from lockstep.rl.rollout import (Episode, RolloutConfig, collate_episodes, encode_text, plain_prompt, prompt_ids,
                                 request_seed, rollout_batch)
from lockstep.rl.scoring import score_logprobs


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(prepare(DataConfig())["tokenizer_path"])


@pytest.fixture(scope="module")
def model():
    return build_model(get_recipe("debug").config().model, seed=0).eval()


@pytest.fixture(scope="module")
def engine(model, tokenizer) -> Engine:
    return Engine(model, tokenizer, EngineConfig(cache_memory_mb=16))


class ScriptedEnv:
    """Replies ``<result>k</result>`` to the first ``replies`` turns, then finishes with reward =
    the number of characters the model wrote; records every text it was shown."""

    name = "scripted"

    def __init__(self, replies: int = 2, stop: list[str] | None = None, reply_text: str | None = None) -> None:
        self.replies, self.stop, self.reply_text = replies, stop or [], reply_text

    def reset(self, seed: int) -> Task:
        return Task(messages=[{"role": "system", "content": "Count."}, {"role": "user", "content": f"From {seed}:"}],
                    stop=list(self.stop), state={"seen": []}, task_id=f"scripted#{seed}")

    def step(self, task: Task, response: str) -> StepResult:
        task.state["seen"].append(response)
        k = len(task.state["seen"])
        if k > self.replies:
            return StepResult(reward=float(sum(map(len, task.state["seen"]))), done=True)
        return StepResult(reply=self.reply_text if self.reply_text is not None else f"<result>{k}</result>")


def _sampling(**kw) -> SamplingParams:
    kw.setdefault("max_new_tokens", 5)
    return SamplingParams(temperature=1.0, **kw)


def _check_layout(ep: Episode, tokenizer: Tokenizer) -> None:
    """token_ids = prompt + (output, reply)*; mask 1 exactly on outputs; logprobs 0 elsewhere."""
    assert ep.token_ids[:ep.prompt_len] == prompt_ids(ep.task, tokenizer)
    assert len(ep.token_ids) == len(ep.loss_mask) == len(ep.logprobs)
    pos = ep.prompt_len
    expected_mask = [0] * ep.prompt_len
    for turn in ep.turns:
        assert turn.start == pos
        expected_mask += [1] * turn.num_tokens
        pos += turn.num_tokens
        if turn.reply_start is not None:
            assert turn.reply_start == pos
            assert ep.token_ids[pos:pos + turn.reply_tokens] == encode_text(tokenizer, turn.reply)
            expected_mask += [0] * turn.reply_tokens
            pos += turn.reply_tokens
    assert pos == len(ep.token_ids) and ep.loss_mask == expected_mask
    for m, lp in zip(ep.loss_mask, ep.logprobs):
        assert (lp == 0.0) if m == 0 else (math.isfinite(lp) and lp <= 0.0)


def test_multi_turn_token_in_token_out(engine, model, tokenizer):
    env = ScriptedEnv(replies=2)
    config = RolloutConfig(group_size=2, max_turns=3, sampling=_sampling(), seed=11)
    episodes = rollout_batch(engine, env, [5, 9], config, policy_version=3)
    assert [(e.group, e.sample, e.task_seed) for e in episodes] == [(0, 0, 5), (0, 1, 5), (1, 0, 9), (1, 1, 9)]
    for ep in episodes:
        _check_layout(ep, tokenizer)
        assert (ep.num_turns, ep.done, ep.truncated, ep.policy_version) == (3, True, None, 3)
        assert [t.reply for t in ep.turns] == ["<result>1</result>", "<result>2</result>", None]
        assert ep.task.state["seen"] == [t.text for t in ep.turns]
        assert ep.reward == float(sum(len(t.text) for t in ep.turns))
        for turn in ep.turns:  # no stop strings: the env saw the decoded output (eos, a stop token, not shown)
            out = ep.token_ids[turn.start:turn.start + turn.num_tokens]
            shown = out[:-1] if turn.finish_reason == "stop" else out
            assert turn.text == tokenizer.decode(shown)
    # the same task in a group, different samples; different tasks across groups
    assert episodes[0].task.messages == episodes[1].task.messages != episodes[2].task.messages
    assert episodes[0].token_ids[episodes[0].prompt_len:] != episodes[1].token_ids[episodes[1].prompt_len:]

    # every turn is exactly what the engine generates from the whole episode so far, with the turn's seed
    requests, spans = [], []
    for ep in episodes:
        for t, turn in enumerate(ep.turns):
            seed = request_seed(config.seed, ep.task_seed, ep.sample, t)
            requests.append(Request(prompt_ids=ep.token_ids[:turn.start], sampling=_sampling(seed=seed)))
            spans.append((ep, turn))
    for result, (ep, turn) in zip(engine.generate(requests), spans):
        assert result.token_ids == ep.token_ids[turn.start:turn.start + turn.num_tokens]
        # (another batch: logits differ by float rounding, ~1e-6; see docs/generation.md)
        assert result.logprobs == pytest.approx(ep.logprobs[turn.start:turn.start + turn.num_tokens], abs=1e-4)

    # the trainer's recomputed logprobs line up with the generator's on the masked positions
    scored = score_logprobs(model, [e.token_ids for e in episodes], [e.prompt_len for e in episodes])
    for ep, lp in zip(episodes, scored):
        mask = torch.tensor(ep.loss_mask[ep.prompt_len:], dtype=torch.bool)
        generated = torch.tensor(ep.logprobs[ep.prompt_len:])
        torch.testing.assert_close(lp[mask], generated[mask], atol=1e-4, rtol=0)

    # deterministic given the seeds; another base seed samples differently
    again = rollout_batch(engine, env, [5, 9], config, policy_version=3)
    assert [(e.token_ids, e.logprobs, e.reward) for e in again] == [(e.token_ids, e.logprobs, e.reward)
                                                                    for e in episodes]
    other = rollout_batch(engine, env, [5, 9], RolloutConfig(group_size=2, max_turns=3, sampling=_sampling(), seed=12))
    assert [e.token_ids for e in other] != [e.token_ids for e in episodes]


def test_task_stop_string_ends_the_turn_and_the_env_sees_it(engine, tokenizer):
    # find a stop string the model will produce: a piece of what it generates without one
    free = rollout_batch(engine, ScriptedEnv(replies=0), [3], RolloutConfig(sampling=_sampling(max_new_tokens=8)))[0]
    out = free.token_ids[free.prompt_len:]
    texts = [tokenizer.decode(out[:j]) for j in range(len(out) + 1)]
    k = next(j for j in range(2, len(out)) if texts[j + 1].startswith(texts[j]) and texts[j + 1] != texts[j]
             and "\ufffd" not in texts[j + 1])
    stop = texts[k + 1][len(texts[k]):]
    first = next(j for j in range(1, len(out) + 1) if stop in texts[j])  # where the engine must stop

    env = ScriptedEnv(replies=1, stop=[stop])
    ep = rollout_batch(engine, env, [3], RolloutConfig(max_turns=2, sampling=_sampling(max_new_tokens=8)))[0]
    _check_layout(ep, tokenizer)
    t0 = ep.turns[0]
    assert t0.finish_reason == "stop" and ep.token_ids[t0.start:t0.start + t0.num_tokens] == out[:first]
    assert t0.text == texts[first][:texts[first].index(stop)] + stop  # the engine's text + the stop string
    assert t0.reply == "<result>1</result>" and ep.num_turns == 2 and ep.done


def test_truncation_by_turns_and_by_context(engine, tokenizer):
    ep = rollout_batch(engine, ScriptedEnv(replies=10), [1],
                       RolloutConfig(max_turns=2, sampling=_sampling(max_new_tokens=3), truncated_reward=-1.0))[0]
    _check_layout(ep, tokenizer)
    assert (ep.truncated, ep.reward, ep.num_turns, ep.done) == ("max_turns", -1.0, 2, True)
    assert ep.turns[-1].reply == "<result>2</result>" and ep.turns[-1].reply_start is None  # not appended
    assert len(ep.token_ids) == ep.turns[-1].start + ep.turns[-1].num_tokens

    long_reply = " and" * 600  # more tokens than the debug model's 512-token context
    ep = rollout_batch(engine, ScriptedEnv(replies=1, reply_text=long_reply), [1],
                       RolloutConfig(max_turns=4, sampling=_sampling(max_new_tokens=3)))[0]
    assert (ep.truncated, ep.reward, ep.num_turns) == ("context", 0.0, 1)
    assert len(ep.token_ids) <= engine.max_seq_len


def test_builtin_environments_in_one_batch(engine, tokenizer):
    envs = [get_environment("reasoning_gym:basic_arithmetic"),
            get_environment("calculator", sandbox=SandboxConfig(isolation="inline"))]
    episodes = rollout_batch(engine, envs, [0, 4], RolloutConfig(group_size=2, sampling=_sampling(max_new_tokens=4)))
    assert [e.env_name for e in episodes] == ["reasoning_gym:basic_arithmetic"] * 2 + ["calculator:arithmetic"] * 2
    for ep in episodes:
        _check_layout(ep, tokenizer)
        assert ep.done and 0.0 <= ep.reward <= 1.0
        assert tokenizer.decode(ep.token_ids[:ep.prompt_len]) == plain_prompt(ep.task.messages)
    assert episodes[2].task.stop == ["</calc>"]
    meta = episodes[0].metadata
    assert meta["env"] == "reasoning_gym:basic_arithmetic" and meta["task_id"] == "reasoning_gym:basic_arithmetic#0"
    assert meta["reference"] == episodes[0].task.answer and meta["answer"] == episodes[0].turns[-1].info["answer"]


def test_chat_template_and_bos(engine, tokenizer):
    template = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                            "{% if add_generation_prompt %}<assistant>{% endif %}")
    config = RolloutConfig(add_bos=True, sampling=_sampling(max_new_tokens=2))
    ep = rollout_batch(engine, ScriptedEnv(replies=0), [2], config, chat_template=template)[0]
    text = "<system>Count.\n<user>From 2:\n<assistant>"
    assert ep.token_ids[:ep.prompt_len] == [tokenizer.bos_id] + tokenizer.encode(text)


def test_collate_episodes(engine):
    episodes = rollout_batch(engine, ScriptedEnv(replies=1), [0, 1],
                             RolloutConfig(group_size=2, max_turns=2, sampling=_sampling(max_new_tokens=3)))
    batch = collate_episodes(episodes, pad_id=7)
    width = max(len(e.token_ids) for e in episodes)
    assert batch["tokens"].shape == batch["loss_mask"].shape == batch["logprobs"].shape == (4, width)
    for i, ep in enumerate(episodes):
        n = len(ep.token_ids)
        assert batch["tokens"][i, :n].tolist() == ep.token_ids and batch["tokens"][i, n:].eq(7).all()
        assert batch["loss_mask"][i].tolist() == ep.loss_mask + [0.0] * (width - n)
        assert batch["logprobs"][i, :n].tolist() == pytest.approx(ep.logprobs)
    assert batch["rewards"].tolist() == [e.reward for e in episodes]
    assert batch["group"].tolist() == [0, 0, 1, 1] and batch["prompt_lengths"].tolist() == [e.prompt_len
                                                                                           for e in episodes]


def test_errors(engine, model):
    class Broken(ScriptedEnv):
        def step(self, task, response):
            return StepResult(done=False)

    with pytest.raises(ValueError, match=r"scripted.step.reply"):
        rollout_batch(engine, Broken(), [0], RolloutConfig(sampling=_sampling(max_new_tokens=1)))
    with pytest.raises(ConfigError, match="2 environments for 3 task seeds"):
        rollout_batch(engine, [ScriptedEnv(), ScriptedEnv()], [0, 1, 2])
    with pytest.raises(ConfigError, match="rollout.group_size"):
        RolloutConfig(group_size=0).validate()
    with pytest.raises(ConfigError, match="rollout.sampling.temperature"):
        RolloutConfig(sampling=SamplingParams(temperature=-1.0)).validate()
    with pytest.raises(ConfigError, match="give a tokenizer"):
        rollout_batch(Engine(model, None, EngineConfig(cache_memory_mb=4)), ScriptedEnv(), [0])


def test_request_seed():
    seeds = {request_seed(0, t, s, k) for t in range(3) for s in range(3) for k in range(3)}
    assert len(seeds) == 27 and all(0 <= x < 2**63 for x in seeds)
    assert request_seed(1, 2, 3, 4) == request_seed(1, 2, 3, 4) != request_seed(2, 2, 3, 4)


def test_encode_text_tokenizer_kinds(tokenizer):
    """lockstep Tokenizer, a raw tokenizers.Tokenizer (Encoding.ids) and a transformers-style
    encode(text, add_special_tokens=...) all give the ids without special tokens."""
    text = "Thou art <result>14</result>"
    expected = tokenizer.encode(text)
    assert encode_text(tokenizer, text) == expected
    assert encode_text(tokenizer.inner, text) == expected

    class TransformersStyle:
        def encode(self, text, add_special_tokens=True):
            return ([tokenizer.bos_id] if add_special_tokens else []) + tokenizer.encode(text)

    assert encode_text(TransformersStyle(), text) == expected
