"""Rollouts: environments driven by the generation engine, exact token-in/token-out.

``rollout_batch(engine, envs, task_seeds, RolloutConfig(group_size=G))`` runs ``G`` episodes per
task seed (a GRPO group) and returns them group-major (episode ``b`` is sample ``b % G`` of task
``b // G``). Per episode:

1. ``env.reset(task_seed)`` gives the task; its messages are rendered (the tokenizer's chat
   template when one is given, else :func:`plain_prompt`) and tokenised: the prompt ids;
2. each turn sends the whole episode so far as ``Request.prompt_ids`` and appends the engine's own
   output ids (``loss_mask`` 1, the engine's ``logprobs``); turn ``t`` of every unfinished episode is
   one ``engine.generate`` call. The model's text is never re-tokenised;
3. ``env.step(task, text)`` sees the turn's text (the engine's ``text``, plus the stop string that
   ended it, if one did) and either finishes the episode with a reward or replies: the reply text
   alone is tokenised (no special tokens) and appended with ``loss_mask`` 0 and logprob 0.0.

So ``token_ids == prompt ids + out_0 + reply_0 + out_1 + ... + out_last`` exactly. A task with
``images`` (an image question for a vision-language policy) has them preprocessed once as the engine
would (its processor: the tower's patch and merge sizes, ``engine.image_min_pixels`` /
``image_max_pixels``); each image's placeholder run (``vision_start, image_token * n, vision_end``) goes
before the prompt text (after the bos token), every request of the episode carries the preprocessed
images, and the episode keeps them (``Episode.images``) for the trainer's scoring. Stop strings are
the sampling's ``stop`` plus the task's (e.g. ``</calc>``). Sampling is deterministic: the request
of (task seed, sample, turn) is seeded from ``RolloutConfig.seed`` and those three numbers only, so
a rollout does not depend on the batch it is in. An episode that reaches ``max_turns`` without
finishing, or whose next prompt would not fit the model's context / the KV cache, ends with
``truncated`` set and ``truncated_reward``. The engine re-prefills the whole episode each turn (no
prefix caching).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lockstep.config.base import Config, ConfigError, require
from lockstep.generate import Engine, Request, SamplingParams
from lockstep.generate.chat import ChatTemplate
from lockstep.generate.output import GenerationResult
from lockstep.rl.envs.base import Environment, Task, environment_name


@dataclasses.dataclass
class Turn:
    """One model turn of an episode and the environment's answer to it."""

    #: index in ``Episode.token_ids`` of the turn's first generated token
    start: int
    #: the engine's output ids this turn (``token_ids[start:start + num_tokens]``)
    num_tokens: int
    #: the text the environment saw
    text: str
    #: the engine's finish reason: "stop" or "length"
    finish_reason: str
    #: the environment's reply (None when it finished the episode), and where its tokens went
    reply: str | None = None
    reply_start: int | None = None
    reply_tokens: int = 0
    #: the environment's StepResult.info
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Episode:
    """One sampled episode: tokens, which of them the model generated, and its reward."""

    task: Task
    env_name: str
    #: index of the task in the batch (the GRPO group) and of this sample in its group
    group: int
    sample: int
    #: the task seed given to ``env.reset``
    task_seed: int
    #: number of prompt tokens (``token_ids[:prompt_len]``)
    prompt_len: int
    #: prompt + every turn's output ids + every reply's ids
    token_ids: list[int]
    #: 1 on tokens the model generated, 0 on prompt and environment-reply tokens
    loss_mask: list[int]
    #: the generator's log-probability of each token (0.0 where ``loss_mask`` is 0)
    logprobs: list[float]
    turns: list[Turn] = dataclasses.field(default_factory=list)
    reward: float | None = None
    done: bool = False
    #: why the episode was cut: None, "max_turns" or "context"
    truncated: str | None = None
    #: the weights version that generated it
    policy_version: int = 0
    #: sampling temperature (the T of the logprobs; 1 for greedy)
    temperature: float = 1.0
    #: the prompt's images, preprocessed: ``(pixel_values [P, D], grid_thw [N, 3])`` (None: text only)
    images: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def response_ids(self) -> list[int]:
        """Everything after the prompt (model and reply tokens)."""
        return self.token_ids[self.prompt_len:]

    @property
    def metadata(self) -> dict[str, Any]:
        """For logs: environment, task id, reference answer, truncation, and the last step's info."""
        last = self.turns[-1].info if self.turns else {}
        return {"env": self.env_name, "task_id": self.task.task_id, "reference": self.task.answer,
                "truncated": self.truncated, "num_turns": self.num_turns, **last}


@dataclasses.dataclass(kw_only=True)
class RolloutConfig(Config):
    """How episodes are sampled."""

    #: episodes per task (GRPO group size)
    group_size: int = 1
    #: most model turns per episode
    max_turns: int = 4
    #: sampling of each turn (its seed is replaced per request; its stop strings are extended by the task's)
    sampling: SamplingParams = dataclasses.field(default_factory=lambda: SamplingParams(max_new_tokens=256))
    #: base seed of every request's sampling seed
    seed: int = 0
    #: put the tokenizer's bos token before the prompt
    add_bos: bool = False
    #: reward of an episode cut by max_turns or the context
    truncated_reward: float = 0.0

    def validate(self, path: str = "rollout") -> None:
        require(isinstance(self.group_size, int) and self.group_size >= 1, f"{path}.group_size",
                f"must be an integer >= 1, got {self.group_size!r}")
        require(isinstance(self.max_turns, int) and self.max_turns >= 1, f"{path}.max_turns",
                f"must be an integer >= 1, got {self.max_turns!r}")
        require(isinstance(self.seed, int), f"{path}.seed", f"must be an integer, got {self.seed!r}")
        self.sampling.validate(f"{path}.sampling")

    def build(self, *, engine: Engine, tokenizer: Any = None, chat_template: ChatTemplate | None = None
              ) -> "Rollout":
        return Rollout(engine, self, tokenizer=tokenizer, chat_template=chat_template)


def request_seed(base: int, task_seed: int, sample: int, turn: int) -> int:
    """The sampling seed of one request: a hash of the four numbers (in [0, 2**63))."""
    digest = hashlib.blake2b(f"{base}:{task_seed}:{sample}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens: a lockstep Tokenizer, a transformers tokenizer
    (``add_special_tokens=False``) or a raw ``tokenizers.Tokenizer`` (its ``Encoding.ids``)."""
    from lockstep.data.tokenizer import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode(text)
    try:
        out = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # an encode without that option
        out = tokenizer.encode(text)
    return [int(i) for i in getattr(out, "ids", out)]


def pixel_images(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list:
    """Preprocessed images as the engine's ``Request.images`` (one ``PixelImage`` per image)."""
    from lockstep.generate.vision import PixelImage

    sizes = grid_thw.prod(dim=1).tolist()
    return [PixelImage(p, tuple(int(x) for x in g)) for p, g in zip(pixel_values.split(sizes), grid_thw.tolist())]


def plain_prompt(messages: Sequence[Mapping[str, str]]) -> str:
    """The prompt of a model without a chat template: ``Role: content`` blocks, then ``Assistant:``."""
    blocks = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(blocks + ["Assistant:"])


def prompt_ids(task: Task, tokenizer: Any, chat_template: ChatTemplate | None = None,
               add_bos: bool = False) -> list[int]:
    """The task's opening token ids (chat template or :func:`plain_prompt`; no special tokens added
    except the bos token when ``add_bos``)."""
    text = chat_template.render(task.messages) if chat_template is not None else plain_prompt(task.messages)
    ids = encode_text(tokenizer, text)
    if add_bos:
        bos = getattr(tokenizer, "bos_id", None)
        bos = getattr(tokenizer, "bos_token_id", None) if bos is None else bos
        if bos is None:
            raise ConfigError("rollout.add_bos: the tokenizer has no bos token")
        ids = [int(bos)] + ids
    return ids


class Rollout:
    """Samples episodes with an engine; see the module docstring."""

    def __init__(self, engine: Engine, config: RolloutConfig | None = None, *, tokenizer: Any = None,
                 chat_template: ChatTemplate | None = None) -> None:
        self.config = config = config or RolloutConfig()
        config.validate()
        self.engine, self.chat_template = engine, chat_template
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        if self.tokenizer is None:
            raise ConfigError("rollout: environments read text; give a tokenizer (or an Engine with one)")
        self.limit = min(engine.max_seq_len, engine.cache.capacity_tokens)
        sp = config.sampling
        self.stop_ids = set(sp.stop_token_ids)
        if engine.eos_id is not None and not sp.ignore_eos:
            self.stop_ids.add(engine.eos_id)

    def run(self, envs: Environment | Sequence[Environment], task_seeds: Sequence[int], *,
            policy_version: int = 0) -> list[Episode]:
        """``group_size`` episodes per task seed, group-major. ``envs``: one for every task, or one each."""
        seeds = [int(s) for s in task_seeds]
        env_list = list(envs) if isinstance(envs, Sequence) else [envs] * len(seeds)
        if len(env_list) != len(seeds):
            raise ConfigError(f"rollout: {len(env_list)} environments for {len(seeds)} task seeds "
                              f"(give one environment, or one per task seed)")
        episodes, owners = [], []
        for group, (env, seed) in enumerate(zip(env_list, seeds)):
            for sample in range(self.config.group_size):
                episodes.append(self._start(env, seed, group, sample, policy_version))
                owners.append(env)
        turn = 0
        while True:
            active = [i for i, ep in enumerate(episodes) if not ep.done]
            if not active:
                return episodes
            requests = [self._request(episodes[i], turn) for i in active]
            for i, result in zip(active, self.engine.generate(requests)):
                self._advance(episodes[i], owners[i], result)
            turn += 1

    # ------------------------------------------------------------------ one episode

    def _start(self, env: Environment, seed: int, group: int, sample: int, version: int) -> Episode:
        task = env.reset(seed)
        if not isinstance(task, Task):
            raise TypeError(f"{environment_name(env)}.reset({seed}) returned {type(task).__name__}, not a Task")
        ids = prompt_ids(task, self.tokenizer, self.chat_template, self.config.add_bos)
        images = None
        if task.images:
            images, block = self._images(task)
            at = 1 if self.config.add_bos else 0
            ids = ids[:at] + block + ids[at:]
        if not ids or len(ids) > self.limit:
            raise ConfigError(f"rollout: the prompt of task {task.task_id or seed!r} has {len(ids)} tokens; it must "
                              f"have 1 to {self.limit} (the model's context / the KV cache)")
        sp = self.config.sampling
        return Episode(task=task, env_name=environment_name(env), group=group, sample=sample, task_seed=seed,
                       prompt_len=len(ids), token_ids=list(ids), loss_mask=[0] * len(ids),
                       logprobs=[0.0] * len(ids), policy_version=version,
                       temperature=sp.temperature if sp.temperature > 0 else 1.0, images=images)

    def _images(self, task: Task) -> tuple[tuple[torch.Tensor, torch.Tensor], list[int]]:
        """The task's images preprocessed for the engine's model, and their placeholder runs."""
        from lockstep.data.image_mix import processor_for, require_vision_tower
        from lockstep.data.image_samples import VisionTokens, expand_markers

        config = self.engine.model.config
        require_vision_tower(config, f"rollout: task {task.task_id!r} has images")
        if self.chat_template is not None:
            raise ConfigError(f"rollout: task {task.task_id!r} has images: image placeholders are placed before a "
                              "plain prompt only, not inside a chat template's messages")
        engine_images = getattr(self.engine, "vision", None)  # lockstep's engine: its own preprocessing settings
        processor = engine_images.processor if engine_images is not None else processor_for(config)
        processed = processor.preprocess(task.images)
        ids = VisionTokens.of(config)
        block = expand_markers([ids.marker] * len(task.images), processed.tokens_per_image(processor.merge_size), ids)
        return (torch.from_numpy(processed.pixel_values), torch.from_numpy(processed.grid_thw)), block

    def _request(self, ep: Episode, turn: int) -> Request:
        sp = self.config.sampling
        stop = list(dict.fromkeys([*sp.stop, *ep.task.stop]))
        sampling = dataclasses.replace(sp, stop=stop, stop_token_ids=list(sp.stop_token_ids),
                                       seed=request_seed(self.config.seed, ep.task_seed, ep.sample, turn))
        images = {} if ep.images is None else {"images": pixel_images(*ep.images)}
        return Request(prompt_ids=list(ep.token_ids), sampling=sampling, request_id=ep.task.task_id or None, **images)

    def _turn_text(self, result: GenerationResult, stop: Sequence[str]) -> str:
        """The engine's text, plus the stop string that ended the turn (the engine cuts it off)."""
        text = result.text
        if result.finish_reason != "stop" or not stop or result.token_ids[-1] in self.stop_ids:
            return text
        rest = self.tokenizer.decode(result.token_ids)[len(text):]
        return text + next((s for s in sorted(stop, key=len, reverse=True) if rest.startswith(s)), "")

    def _advance(self, ep: Episode, env: Environment, result: GenerationResult) -> None:
        out = list(result.token_ids)
        turn = Turn(start=len(ep.token_ids), num_tokens=len(out), text="", finish_reason=result.finish_reason)
        ep.token_ids += out
        ep.loss_mask += [1] * len(out)
        ep.logprobs += [float(x) for x in result.logprobs]
        turn.text = self._turn_text(result, [*self.config.sampling.stop, *ep.task.stop])
        step = env.step(ep.task, turn.text)
        step.check(f"{ep.env_name}.step")
        turn.info = dict(step.info)
        ep.turns.append(turn)
        if step.done:
            ep.reward, ep.done = float(step.reward), True  # type: ignore[arg-type]
            return
        turn.reply = step.reply
        reply = encode_text(self.tokenizer, step.reply)  # type: ignore[arg-type]
        if ep.num_turns >= self.config.max_turns:
            self._truncate(ep, "max_turns")
        elif len(ep.token_ids) + len(reply) > self.limit:
            self._truncate(ep, "context")
        else:
            turn.reply_start, turn.reply_tokens = len(ep.token_ids), len(reply)
            ep.token_ids += reply
            ep.loss_mask += [0] * len(reply)
            ep.logprobs += [0.0] * len(reply)

    def _truncate(self, ep: Episode, why: str) -> None:
        ep.truncated, ep.reward, ep.done = why, float(self.config.truncated_reward), True


def rollout_batch(engine: Engine, envs: Environment | Sequence[Environment], task_seeds: Sequence[int],
                  config: RolloutConfig | None = None, *, tokenizer: Any = None,
                  chat_template: ChatTemplate | None = None, policy_version: int = 0) -> list[Episode]:
    """``Rollout(engine, config, ...).run(envs, task_seeds)``: see the module docstring."""
    return Rollout(engine, config, tokenizer=tokenizer, chat_template=chat_template).run(
        envs, task_seeds, policy_version=policy_version)


def collate_episodes(episodes: Sequence[Episode], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded ``[B, T]`` tensors of episodes (in order): ``tokens`` (long), ``loss_mask``
    (float, 0 on padding), ``logprobs`` (float32, 0 on padding), and ``[B]`` ``rewards``,
    ``lengths``, ``prompt_lengths``, ``group``. Position ``t`` holds token ``t`` and its logprob (the
    trainer's logits at ``t - 1`` predict it)."""
    if not episodes:
        raise ValueError("collate_episodes: no episodes")
    missing = [i for i, ep in enumerate(episodes) if ep.reward is None]
    if missing:
        raise ValueError(f"collate_episodes: episodes {missing[:5]} have no reward (unfinished)")
    width = max(len(ep.token_ids) for ep in episodes)
    b = len(episodes)
    tokens = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros(b, width)
    logprobs = torch.zeros(b, width)
    for i, ep in enumerate(episodes):
        n = len(ep.token_ids)
        tokens[i, :n] = torch.tensor(ep.token_ids)
        mask[i, :n] = torch.tensor(ep.loss_mask, dtype=torch.float32)
        logprobs[i, :n] = torch.tensor(ep.logprobs, dtype=torch.float32)
    return {"tokens": tokens, "loss_mask": mask, "logprobs": logprobs,
            "rewards": torch.tensor([float(ep.reward) for ep in episodes]),  # type: ignore[arg-type]
            "lengths": torch.tensor([len(ep.token_ids) for ep in episodes]),
            "prompt_lengths": torch.tensor([ep.prompt_len for ep in episodes]),
            "group": torch.tensor([ep.group for ep in episodes])}
