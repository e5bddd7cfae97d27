"""RL environments against a policy behind an OpenAI chat endpoint (``lockstep serve``, vLLM, ...).

:class:`ChatPolicy` sends chat requests over HTTP (the standard library's client: no extra
dependency); :func:`run_episode` plays one episode of any :class:`~lockstep.rl.envs.base.Environment`
(e.g. the multi-turn calculator) with it, the way :mod:`lockstep.rl.rollout` does with an in-process
engine:

1. ``env.reset(seed)`` gives the opening messages and the task's stop strings (``</calc>``);
2. each model turn is one chat request; the environment sees the turn's text with the stop string
   that ended it re-attached (the server's ``stop_reason``, as vLLM names it);
3. the environment's reply is appended to the *same* assistant message, and the next request asks
   the model to continue that message (``add_generation_prompt: false, continue_final_message:
   true``, the vLLM extension this server implements), so the model sees ``turn + reply`` inside its
   turn, as in the token-level rollout.

Unlike the in-process rollout, the server re-tokenises the conversation text each turn, so token
boundaries at a turn/reply seam can differ from the model's own output ids; the text is the same.
Sampling seeds per turn are :func:`lockstep.rl.rollout.request_seed` (base seed, task seed, 0, turn).
"""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
from typing import Any

from lockstep.rl.envs.base import Environment, Task, environment_name
from lockstep.rl.rollout import request_seed


class PolicyError(RuntimeError):
    """The server answered with an error (its status and OpenAI error message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"policy server: HTTP {status}: {message}")
        self.status = status


@dataclasses.dataclass
class Completion:
    """One chat completion: the text, why it ended, the stop string or id that ended it, token counts."""

    text: str
    finish_reason: str
    stop_reason: int | str | None
    prompt_tokens: int
    completion_tokens: int


@dataclasses.dataclass(kw_only=True)
class ChatPolicy:
    """A policy behind ``base_url`` (``http://host:port``, with or without ``/v1``)."""

    base_url: str
    #: the served model name (``GET /v1/models``)
    model: str
    max_tokens: int = 256
    #: 0 = greedy
    temperature: float = 0.0
    top_p: float = 1.0
    #: seconds per request
    timeout: float = 300.0

    def complete(self, messages: list[dict[str, str]], *, stop: list[str] | None = None, seed: int | None = None,
                 continue_final: bool = False) -> Completion:
        """One completion of ``messages``; ``continue_final``: continue the last (assistant) message."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                                "temperature": self.temperature, "top_p": self.top_p}
        if stop:
            body["stop"] = list(stop)
        if seed is not None:
            body["seed"] = seed
        if continue_final:
            body.update(add_generation_prompt=False, continue_final_message=True)
        out = self._post("/chat/completions", body)
        choice = out["choices"][0]
        usage = out.get("usage") or {}
        return Completion(choice["message"]["content"] or "", choice["finish_reason"], choice.get("stop_reason"),
                          int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)))

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        root = self.base_url.rstrip("/")
        url = (root if root.endswith("/v1") else root + "/v1") + path
        request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            try:
                message = json.loads(err.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = err.reason
            raise PolicyError(err.code, str(message)) from None


@dataclasses.dataclass
class AgentEpisode:
    """One episode played over HTTP."""

    task: Task
    env_name: str
    task_seed: int
    #: the text of each model turn as the environment saw it (stop string re-attached)
    turns: list[str] = dataclasses.field(default_factory=list)
    #: the environment's replies (one per turn that did not end the episode)
    replies: list[str] = dataclasses.field(default_factory=list)
    #: the whole assistant message: turns and replies interleaved
    assistant: str = ""
    reward: float | None = None
    done: bool = False
    #: "max_turns" when the episode was cut, else None
    truncated: str | None = None
    completion_tokens: int = 0
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


def run_episode(env: Environment, policy: ChatPolicy, task_seed: int, *, max_turns: int = 4, seed: int = 0,
                truncated_reward: float = 0.0) -> AgentEpisode:
    """Play one episode of ``env`` against ``policy`` (see the module docstring)."""
    task = env.reset(task_seed)
    ep = AgentEpisode(task=task, env_name=environment_name(env), task_seed=task_seed)
    for turn in range(max_turns):
        messages = [dict(m) for m in task.messages]
        if ep.assistant:
            messages.append({"role": "assistant", "content": ep.assistant})
        out = policy.complete(messages, stop=task.stop, seed=request_seed(seed, task_seed, 0, turn),
                              continue_final=bool(ep.assistant))
        text = out.text + (out.stop_reason if out.finish_reason == "stop" and isinstance(out.stop_reason, str)
                           else "")
        ep.turns.append(text)
        ep.assistant += text
        ep.completion_tokens += out.completion_tokens
        step = env.step(task, text)
        step.check(f"{ep.env_name}.step")
        ep.info = dict(step.info)
        if step.done:
            ep.reward, ep.done = float(step.reward), True  # type: ignore[arg-type]
            return ep
        ep.replies.append(step.reply)  # type: ignore[arg-type]
        ep.assistant += step.reply  # type: ignore[operator]
    ep.truncated, ep.reward, ep.done = "max_turns", float(truncated_reward), True
    return ep
