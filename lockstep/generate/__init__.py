"""Generation with the training model's own modules: paged KV cache, batched prefill/decode,
continuous batching, per-request sampling with log-probabilities, chat templates.

    from lockstep.generate import Engine, EngineConfig, Request, SamplingParams
    engine = Engine(model, tokenizer, EngineConfig(cache_memory_mb=256))
    [result] = engine.generate([Request(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=8))])
    result.token_ids, result.logprobs, result.text, result.finish_reason

See docs/generation.md.
"""

from lockstep.generate.chat import ChatTemplate, load_chat_template
from lockstep.generate.config import EngineConfig, Request, SamplingParams
from lockstep.generate.engine import Engine
from lockstep.generate.output import GenerationResult, StreamEvent
from lockstep.generate.sampling import sample_next, token_logprobs

__all__ = [
    "ChatTemplate",
    "Engine",
    "EngineConfig",
    "GenerationResult",
    "Request",
    "SamplingParams",
    "StreamEvent",
    "load_chat_template",
    "sample_next",
    "token_logprobs",
]
