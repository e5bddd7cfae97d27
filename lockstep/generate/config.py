"""What a generation run is configured by: ``EngineConfig`` (the engine), ``SamplingParams`` and
``Request`` (one prompt). Every check raises :class:`~lockstep.config.base.ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from lockstep.config.base import Config, ConfigError, check_finite, require, require_choice, require_positive

if TYPE_CHECKING:
    from lockstep.generate.engine import Engine

#: ``EngineConfig.compile_decode`` choices. "inductor-frozen" treats the weights as constants
#: (Inductor freezing: prepacked for the CPU GEMM); the compiled step then ignores later weight updates.
COMPILE_MODES = ["none", "inductor", "inductor-frozen", "aot_eager"]
#: ``EngineConfig.weights_dtype`` choices: "model" runs the model's own weights
WEIGHTS_DTYPES = ["model", "bfloat16", "float32"]
#: ``EngineConfig.linear_kernel`` choices
LINEAR_KERNELS = ["auto", "amx", "onednn"]
#: ``EngineConfig.speculative`` choices
SPECULATIVE_MODES = ["none", "mtp"]


@dataclasses.dataclass(kw_only=True)
class EngineConfig(Config):
    """The generation engine: KV-cache size, batch limits, optional compiled decode step."""

    #: memory for the paged KV cache (every layer together), in MiB; sets the number of blocks
    cache_memory_mb: float = 512.0
    #: tokens per cache block (each sequence holds whole blocks, freed when it finishes)
    block_size: int = 16
    #: number of cache blocks; 0 derives it from cache_memory_mb
    num_blocks: int = 0
    #: most sequences decoded together (the running batch)
    max_batch_size: int = 32
    #: most prompt tokens (padded: sequences x longest prompt) prefilled in one forward; a longer
    #: single prompt is still prefilled alone
    max_prefill_tokens: int = 4096
    #: torch.compile the decode step: "none", "inductor", "inductor-frozen" (weights become
    #: constants: fastest on CPU, ignores later weight updates) or "aot_eager" (traced, bitwise eager);
    #: MoE models must be bf16 (torch._grouped_mm traces only in bf16)
    compile_decode: str = "none"
    #: with compile_decode: check the compiled step's guards in full the first time each (batch,
    #: context) bucket runs in a numerics mode, and only the guards that tell buckets apart after
    #: that (torch.compiler's skip_guard_eval_unsafe; ~0.9 ms a SmolLM2 step). Safe while nothing
    #: but the engine changes what the step reads; call ``engine.sync_weights()`` after replacing
    #: parameters, or set False
    skip_guard_checks: bool = True
    #: with compile_decode: compile the prefill too (one-shot prefills of text-only batches on models
    #: without recurrent state, sliding windows or MTP drafts, padded to power-of-two rows and columns
    #: so that each bucket compiles once: lockstep.generate.prefill). None: on with the Inductor modes,
    #: off with "aot_eager" (which stays bitwise eager); True / False: on / off with any mode
    compile_prefill: bool | None = None
    #: batch-invariant kernels for this engine's steps (bitwise-equal to the trainer's
    #: ``score_logprobs``, docs/numerics.md): True / False, or None to follow the process-wide
    #: ``lockstep.numerics`` switch. CPU-only: on another device either is a ConfigError
    batch_invariant: bool | None = None
    #: dtype the engine runs the weights in: "model" (the model's own) or "bfloat16" / "float32": a
    #: cast copy of the weights (synced from the model's in-place updates before every step); the KV
    #: cache and logits follow it. bf16 on an fp32 model halves the weight bytes per decode step
    weights_dtype: str = "model"
    #: run linears on CPU on prepacked copies of their weights (lockstep.generate.packed; repacked
    #: when a weight is written): bf16 with linear_kernel's kernel, fp32 on AVX-512 CPUs; costs one
    #: packed copy of those weights. No effect on other devices
    pack_weights: bool = True
    #: the kernel packed bf16 linears run: "amx" (lockstep.ops.decode_linear: Intel AMX tiles, ~1.4x oneDNN
    #: at decode sizes; fp32 sums in a fixed order, not F.linear's bits), "onednn" (oneDNN's
    #: prepacked linear: bitwise equal to F.linear on contiguous inputs) or "auto" (the C kernel of the
    #: CPU's ISA level, lockstep.ops.isa, where it beats oneDNN: AMX, or vdpbf16ps; oneDNN below)
    linear_kernel: str = "auto"
    #: decode steps read keys/values in place from the paged cache (lockstep.ops.paged_attention, a C
    #: kernel; CPU, sdpa backend) instead of gathering each context and running SDPA on the copy
    paged_attention: bool = True
    #: prefill prompts in chunks of this many tokens (lockstep.generate.prefill): activation memory
    #: bounded by the chunk, not the prompt; same tokens as one-shot prefill up to float summation
    #: order. 0 = one forward per prefill batch. Not for sliding-window models
    prefill_chunk: int = 0
    #: speculative decoding: "none", or "mtp" (draft with the model's multi-token-prediction heads,
    #: verify in one forward; greedy requests only; lockstep.generate.speculative)
    speculative: str = "none"
    #: with speculative="mtp": tokens drafted per verify forward (chained through the MTP depths)
    draft_tokens: int = 2
    #: requests with images (vision-language models, lockstep.generate.vision): fewest / most pixels of an
    #: image after the processor's resize (preprocessor_config.json min_pixels / max_pixels; Qwen3-VL's)
    image_min_pixels: int = 65536
    image_max_pixels: int = 16777216

    def validate(self, path: str = "engine") -> None:
        require_positive(self.cache_memory_mb, f"{path}.cache_memory_mb")
        require_positive(self.block_size, f"{path}.block_size")
        require(self.num_blocks >= 0, f"{path}.num_blocks", f"must be >= 0 (0 = from cache_memory_mb), got "
                f"{self.num_blocks}")
        require_positive(self.max_batch_size, f"{path}.max_batch_size")
        require_positive(self.max_prefill_tokens, f"{path}.max_prefill_tokens")
        require_choice(self.compile_decode, COMPILE_MODES, f"{path}.compile_decode")
        require(self.compile_prefill in (None, True, False), f"{path}.compile_prefill",
                f"must be true, false or null, got {self.compile_prefill!r}")
        require_choice(self.weights_dtype, WEIGHTS_DTYPES, f"{path}.weights_dtype")
        require_choice(self.linear_kernel, LINEAR_KERNELS, f"{path}.linear_kernel")
        require(isinstance(self.prefill_chunk, int) and self.prefill_chunk >= 0, f"{path}.prefill_chunk",
                f"must be an integer >= 0 (0 = no chunking), got {self.prefill_chunk!r}")
        require_choice(self.speculative, SPECULATIVE_MODES, f"{path}.speculative")
        require(isinstance(self.draft_tokens, int) and self.draft_tokens >= 1, f"{path}.draft_tokens",
                f"must be an integer >= 1, got {self.draft_tokens!r}")
        require_positive(self.image_min_pixels, f"{path}.image_min_pixels")
        require(self.image_max_pixels >= self.image_min_pixels, f"{path}.image_max_pixels",
                f"must be >= image_min_pixels ({self.image_min_pixels}), got {self.image_max_pixels}")

    def build(self, *, model: Any, tokenizer: Any = None) -> "Engine":
        from lockstep.generate.engine import Engine

        return Engine(model, tokenizer, self)


@dataclasses.dataclass(kw_only=True)
class SamplingParams(Config):
    """How one request samples. ``temperature=0`` is greedy (argmax).

    Log-probabilities are always those of the unmodified model distribution at temperature
    ``T = temperature`` (``T = 1`` when greedy): ``log_softmax(logits_fp32 / T)`` at the chosen token;
    top-k/top-p only restrict which tokens may be drawn (see ``lockstep.generate.sampling``).
    """

    #: most tokens generated (the stop token, when one ends the sequence, counts and is returned)
    max_new_tokens: int = 16
    #: softmax temperature; 0 = greedy
    temperature: float = 1.0
    #: sample among the k most likely tokens; 0 = all
    top_k: int = 0
    #: nucleus sampling: the smallest set of most likely tokens with probability >= top_p; 1 = all
    top_p: float = 1.0
    #: seed of this request's own torch.Generator (same seed + same request = same tokens); None = random
    seed: int | None = None
    #: token ids that end the sequence (included in token_ids, excluded from text)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    #: strings that end the sequence (text is cut before the stop string; needs a tokenizer)
    stop: list[str] = dataclasses.field(default_factory=list)
    #: do not stop at the tokenizer's end-of-sequence token
    ignore_eos: bool = False

    def validate(self, path: str = "sampling") -> None:
        check_finite(self, path)
        require(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, f"{path}.max_new_tokens",
                f"must be an integer >= 1, got {self.max_new_tokens!r}")
        require(self.temperature >= 0, f"{path}.temperature", f"must be >= 0 (0 = greedy), got {self.temperature!r}")
        require(isinstance(self.top_k, int) and self.top_k >= 0, f"{path}.top_k",
                f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        require(0 < self.top_p <= 1, f"{path}.top_p", f"must be in (0, 1], got {self.top_p!r}")
        require(self.seed is None or isinstance(self.seed, int), f"{path}.seed",
                f"must be an integer or None, got {self.seed!r}")
        require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), f"{path}.stop_token_ids",
                f"must be non-negative integers, got {self.stop_token_ids!r}")
        require(all(isinstance(s, str) and s for s in self.stop), f"{path}.stop",
                f"must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass(kw_only=True)
class Request:
    """One prompt to complete: token ids, or text when the engine has a tokenizer; with images for a
    vision-language model (one placeholder run per image in the prompt; :mod:`lockstep.generate.vision`)."""

    #: the prompt's token ids (the model sees exactly these; no BOS is added)
    prompt_ids: list[int] | None = None
    #: the prompt as text, encoded with the engine's tokenizer (when prompt_ids is not given)
    prompt: str | None = None
    #: how to sample
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    #: caller's label, returned with the result
    request_id: str | None = None
    #: the prompt's images, in order: PIL images, uint8 arrays [H, W(, 3)] or lockstep.generate.vision.PixelImage
    images: list[Any] | None = None

    def token_ids(self, tokenizer, vocab_size: int) -> list[int]:
        """The prompt's token ids (``prompt_ids``, or ``prompt`` encoded with ``tokenizer``), checked: one of
        the two given, not empty, every id inside ``[0, vocab_size)``. Every engine admits requests by it."""
        if self.prompt_ids is not None and self.prompt is not None:
            raise ConfigError("Request: give prompt_ids or prompt, not both")
        if self.prompt_ids is None:
            if self.prompt is None:
                raise ConfigError("Request.prompt_ids: no prompt given (prompt_ids or prompt)")
            if tokenizer is None:
                raise ConfigError("Request.prompt: a text prompt needs an Engine with a tokenizer; give prompt_ids")
            ids = list(tokenizer.encode(self.prompt))
        else:
            ids = [int(t) for t in self.prompt_ids]
        if not ids:
            raise ConfigError("Request.prompt_ids: the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ConfigError(f"Request.prompt_ids: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        return ids
