"""The policy every RL process builds: the model (random init or ``init_from``), its tokenizer and
chat template, the stop ids that end a model turn, and the environment."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lockstep.config.base import ConfigError
from lockstep.generate.engine import tokenizer_eos_id
from lockstep.models.common.transformer import Transformer, build_model
from lockstep.rl.config import RLConfig


@dataclasses.dataclass
class Policy:
    model: Transformer
    tokenizer: Any
    chat_template: Any
    #: end-of-turn ids beyond the tokenizer's eos (from generation_config.json)
    stop_token_ids: list[int]
    eos_id: int | None
    #: where the weights came from (for the manifest)
    source: str


def load_policy(config: RLConfig) -> Policy:
    """Build the policy as the recipe says; every process calls it (generators then receive the
    trainer's weights, so their init only has to have the same architecture)."""
    if config.init_from:
        from lockstep.load import load_model

        src = load_model(config.init_from, config=config.model, dtype=torch.float32, field="init_from",
                         allow_unverified=config.allow_unverified_weights)
        model, tokenizer, chat, stops, source = src.model, src.tokenizer, src.chat_template, src.stop_token_ids, \
            src.description
    else:
        from lockstep.data.config import prepare
        from lockstep.data.tokenizer import Tokenizer

        path = config.data.resolved_tokenizer_path()
        if not path.is_file():
            prepare(config.data, verbose=False)
        tokenizer = Tokenizer.from_file(path)
        if tokenizer.vocab_size > config.model.vocab_size:
            raise ConfigError(f"model.vocab_size: {config.model.vocab_size} is smaller than the tokenizer's "
                              f"{tokenizer.vocab_size} tokens ({path})")
        model = build_model(config.model, seed=config.seed)
        chat, stops, source = None, [], f"random init ({config.model.family} {config.model.flavor}, seed {config.seed})"
    model.train()
    return Policy(model=model, tokenizer=tokenizer, chat_template=chat, stop_token_ids=list(stops),
                  eos_id=tokenizer_eos_id(tokenizer), source=source)


def with_stop_ids(config: RLConfig, policy: Policy) -> RLConfig:
    """The config with the model's end-of-turn ids added to the rollout's stop ids."""
    sampling = config.rollout.sampling
    extra = [i for i in policy.stop_token_ids if i not in sampling.stop_token_ids]
    if not extra:
        return config
    sampling = dataclasses.replace(sampling, stop_token_ids=[*sampling.stop_token_ids, *extra])
    return dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, sampling=sampling))
