"""The environment interface: a task's prompt, the environment's answer to each model turn, a reward.

An environment is any object with two methods (:class:`Environment`)::

    task = env.reset(seed)                  # Task: the opening chat messages + what scoring needs
    result = env.step(task, response_text)  # StepResult: reply (turn goes on) or reward (done)

``reset`` is deterministic in ``seed`` and is called once per episode, so the ``group_size``
samples of one GRPO group each get their own, equal :class:`Task` (its ``state`` dict is theirs to
mutate). ``step`` sees the text of the model's latest turn (as the engine produced it, with the stop
string that ended it re-attached) and answers with a :class:`StepResult`: ``done=False`` and a
``reply`` (text the rollout tokenises and appends, masked out of the loss, before the model's next
turn) or ``done=True`` and a ``reward``. A single-turn environment is done after the first response.

Answers are read from the model's text by :func:`extract_answer`; :data:`ANSWER_FORMATS` are the
formats an environment can ask for in its prompt (:func:`format_instruction`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Protocol, runtime_checkable

#: how the final answer is marked in the model's text: the last ``<answer>...</answer>`` ("tags"),
#: or the last number in the text ("last_number")
ANSWER_FORMATS = ["tags", "last_number"]

_OPEN, _CLOSE = "<answer>", "</answer>"
#: a signed integer, decimal or fraction, with optional thousands separators: -1,234.5  3/4  .5
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:/\d+)?")


@dataclasses.dataclass
class Task:
    """One episode's problem: the prompt the model sees and what the environment needs to score it."""

    #: the opening conversation: ``[{"role": "system" | "user", "content": str}, ...]``
    messages: list[dict[str, str]]
    #: the reference answer as text, when there is one (for logging; scoring may use ``data``)
    answer: str | None = None
    #: whatever the environment needs to score this task (e.g. the reasoning-gym entry)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: strings that end a model turn so the environment can reply (e.g. ``["</calc>"]``); empty for
    #: single-turn tasks (the turn then ends at end-of-sequence or the token budget)
    stop: list[str] = dataclasses.field(default_factory=list)
    #: per-episode state the environment may mutate in ``step`` (tool calls so far, a game board, ...)
    state: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: a label for logs: environment name and seed
    task_id: str = ""
    #: images the prompt shows, in order (uint8 ``[H, W, 3]`` arrays or PIL images; a vision-language
    #: policy's rollout places each one's placeholders before the prompt text)
    images: list[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class StepResult:
    """The environment's answer to one model turn."""

    #: text to append before the model's next turn (None when ``done``)
    reply: str | None = None
    #: the episode's reward (required when ``done``)
    reward: float | None = None
    #: True: the episode is over and ``reward`` is final
    done: bool = False
    #: anything worth logging about this step (the extracted answer, a tool error, ...)
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def check(self, where: str = "StepResult") -> None:
        """Raise ValueError unless this is a reply (not done) or a reward (done), naming the field."""
        if self.done:
            if not isinstance(self.reward, (int, float)) or isinstance(self.reward, bool):
                raise ValueError(f"{where}.reward: a finished step (done=True) needs a float reward, "
                                 f"got {self.reward!r}")
        elif not isinstance(self.reply, str):
            raise ValueError(f"{where}.reply: an unfinished step (done=False) needs the reply text, "
                             f"got {self.reply!r}")


@runtime_checkable
class Environment(Protocol):
    """prompt -> episode -> reward. See the module docstring; ``name`` is optional (used in logs)."""

    def reset(self, seed: int) -> Task:
        """The task for ``seed`` (same seed, equal task); called once per episode."""
        ...

    def step(self, task: Task, response: str) -> StepResult:
        """React to the model's latest turn: reply and go on, or finish with a reward."""
        ...


def environment_name(env: Any) -> str:
    """``env.name`` when it has one, else its class name."""
    name = getattr(env, "name", None)
    return name if isinstance(name, str) and name else type(env).__name__


def extract_answer(text: str, answer_format: str = "tags") -> str | None:
    """The final answer in ``text`` (stripped), or None when there is none.

    ``"tags"``: the content of the last ``<answer>...</answer>``; ``"last_number"``: the last
    number (integer, decimal or fraction, thousands separators removed).
    """
    if answer_format == "tags":
        return _last_tagged(text)
    if answer_format == "last_number":
        numbers = [m.group(0) for m in _NUMBER.finditer(text) if any(c.isdigit() for c in m.group(0))]
        return numbers[-1].replace(",", "") if numbers else None
    raise ValueError(f"answer_format: must be one of {ANSWER_FORMATS}, got {answer_format!r}")


def _last_tagged(text: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` (as ``re.findall`` pairs them: each opener
    with the first closer after it, scanning on after that closer), in one left-to-right pass.

    A lazy regex is quadratic here: each of n unclosed openers scans to the end of the text."""
    found, pos = None, 0
    while (start := text.find(_OPEN, pos)) >= 0:
        end = text.find(_CLOSE, start + len(_OPEN))
        if end < 0:  # no closer after this opener: none after any later one either
            break
        found, pos = text[start + len(_OPEN):end], end + len(_CLOSE)
    return found.strip() if found is not None else None


def format_instruction(answer_format: str) -> str:
    """The sentence a prompt uses to ask for ``answer_format``."""
    if answer_format == "tags":
        return "Give your final answer inside <answer></answer> tags, for example <answer>42</answer>."
    if answer_format == "last_number":
        return "End your reply with the final answer as a number."
    raise ValueError(f"answer_format: must be one of {ANSWER_FORMATS}, got {answer_format!r}")
