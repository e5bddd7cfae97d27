"""Batch-invariant mode over drawn model shapes, not only drawn batches.

Hypothesis draws a Hugging Face ``config.json`` for each family (llama3, qwen3, qwen3_moe,
deepseek_v3) - hidden size, head counts and head dims (GQA ratios, ``head_dim`` != hidden/heads),
FFN and expert widths (any integer, not only multiples of 32), expert counts, top-k and groups,
dense/MoE layer mixes, MLA's q LoRA rank (``None`` included), kv LoRA rank and its nope/rope/v head
dims (``v_head_dim`` != ``qk_nope_head_dim`` included), RoPE scaling, tied embeddings - loads it
through the family's HF adapter, and checks with ``torch.equal``, in fp32 and bf16:

(a) ``score_logprobs`` of a sequence alone equals its scores inside a drawn batch (drawn order,
    next to sequences of other lengths: right padding);
(b) the engine's per-token log-probabilities (2 batch slots for 3 requests, so sequences join and
    leave; greedy or sampled) equal ``score_logprobs`` of the finished sequences.

The same draws run at lower kernel paths in subprocesses: a CPU without AMX as closely as one
machine can play it (lockstep's kernels capped at ``LOCKSTEP_CPU_ISA=avx512``, oneDNN at
``AVX512_CORE_BF16``, MKL at its AVX2 path, the one non-Intel CPUs get), the portable C kernels,
and no C kernels at all (``LOCKSTEP_NO_C_KERNELS``: the tiled fallbacks).
Draws are derandomized (the same examples on every run). ``docs/numerics.md`` states the scope.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from lockstep import numerics
from lockstep.generate import Engine, EngineConfig, Request, SamplingParams
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import get_model_spec
from lockstep.ops import isa
from lockstep.rl import score_logprobs

FAMILIES = ["llama3", "qwen3", "qwen3_moe", "deepseek_v3"]
DTYPES = [torch.float32, torch.bfloat16]
#: examples per (family, dtype); the subprocess runs at lower kernel paths ask for fewer
EXAMPLES = int(os.environ.get("LOCKSTEP_TEST_SHAPE_EXAMPLES", "8"))


@pytest.fixture(autouse=True)
def _mode_off_after():
    yield
    numerics.set_batch_invariant(False)


@st.composite
def _common(draw, family: str) -> dict:
    heads = draw(st.integers(1, 4))
    cfg = {
        "vocab_size": draw(st.integers(24, 96)),
        "hidden_size": draw(st.sampled_from([16, 24, 32, 40, 48, 64])),
        "num_hidden_layers": draw(st.integers(1, 2)),
        "num_attention_heads": heads,
        "intermediate_size": draw(st.integers(8, 72)),
        "max_position_embeddings": 128,
        "tie_word_embeddings": draw(st.booleans()),
        "rms_norm_eps": 1e-6,
        "rope_theta": draw(st.sampled_from([10000.0, 500000.0])),
    }
    if family != "deepseek_v3":
        cfg["num_key_value_heads"] = draw(st.sampled_from([k for k in range(1, heads + 1) if heads % k == 0]))
        cfg["head_dim"] = draw(st.sampled_from([4, 8, 12, 16, 24, 32]))
        cfg["model_type"] = {"llama3": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}[family]
    return cfg


@st.composite
def hf_configs(draw, family: str) -> dict:
    """A ``config.json`` dict for ``family`` that its HF adapter accepts."""
    cfg = draw(_common(family))
    layers = cfg["num_hidden_layers"]
    if family == "llama3" and draw(st.booleans()):
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    if family == "qwen3_moe":
        experts = draw(st.integers(2, 8))
        cfg.update(num_experts=experts, num_experts_per_tok=draw(st.integers(1, experts)),
                   moe_intermediate_size=draw(st.integers(8, 48)), norm_topk_prob=draw(st.booleans()),
                   decoder_sparse_step=draw(st.integers(1, 2)),
                   mlp_only_layers=draw(st.lists(st.integers(0, layers - 1), unique=True, max_size=1)))
    if family == "deepseek_v3":
        experts = draw(st.sampled_from([2, 3, 4, 6, 8]))
        top_k = draw(st.integers(1, experts))
        groups = draw(st.sampled_from([g for g in (1, 2, 3, 4) if experts % g == 0]))
        per_group = experts // groups
        cfg.update(
            model_type="deepseek_v3", num_key_value_heads=cfg["num_attention_heads"],
            q_lora_rank=draw(st.sampled_from([None, 8, 12, 16, 32])),
            kv_lora_rank=draw(st.sampled_from([8, 16, 20, 32, 48])),
            qk_nope_head_dim=draw(st.sampled_from([4, 8, 12, 16, 24])),
            qk_rope_head_dim=draw(st.sampled_from([2, 4, 8, 16])),
            v_head_dim=draw(st.sampled_from([4, 8, 12, 16, 20])),
            n_routed_experts=experts, num_experts_per_tok=top_k,
            moe_intermediate_size=draw(st.integers(8, 40)), n_shared_experts=draw(st.integers(0, 2)),
            n_group=groups, topk_group=draw(st.integers(-(-top_k // per_group), groups)),
            first_k_dense_replace=draw(st.integers(0, layers)),
            routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])), norm_topk_prob=draw(st.booleans()),
            rope_interleave=draw(st.booleans()),
        )
        if draw(st.booleans()):
            cfg["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                   "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    return cfg


@st.composite
def workloads(draw, vocab: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Sequences (prompt + continuation) of mixed lengths, their prompt lengths, and the order of
    the batch in (a) (a drawn permutation)."""
    lengths = draw(st.lists(st.integers(2, 30), min_size=3, max_size=4))
    seqs = [draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)) for n in lengths]
    prompts = [draw(st.integers(1, n - 1)) for n in lengths]
    order = draw(st.permutations(range(len(seqs))))
    return seqs, prompts, order


def randomize_(model: torch.nn.Module) -> None:
    """Weights large enough that every component's last bits reach the log-probabilities (the
    default init keeps activations near 0, where e.g. the vector and scalar ``exp`` agree)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen) if p.ndim == 1
                    else 0.15 * torch.randn(p.shape, generator=gen))


def check_model(family: str, dtype: torch.dtype, hf: dict, seqs: list[list[int]], prompts: list[int],
                order: list[int], temperature: float) -> None:
    """(a) and (b) of the module docstring on one drawn model; fails with the config that broke."""
    config = get_model_spec(family).hf_adapter.config_from_hf(hf)
    model = build_model(config, seed=0)
    randomize_(model)
    model = model.to(dtype).eval()
    numerics.set_batch_invariant(True)
    with torch.no_grad():
        batched = score_logprobs(model, [seqs[i] for i in order], [prompts[i] for i in order])
        for i, scores in zip(order, batched):
            [alone] = score_logprobs(model, [seqs[i]], [prompts[i]])
            assert torch.equal(scores, alone), ("alone vs batch", family, dtype, hf, i)

    engine = Engine(model, None, EngineConfig(cache_memory_mb=8, max_batch_size=2))
    requests = [Request(prompt_ids=s[:p], sampling=SamplingParams(max_new_tokens=2 + i, temperature=temperature,
                                                                    seed=i))
                for i, (s, p) in enumerate(zip(seqs[:3], prompts))]
    results = engine.generate(requests)
    finished = [list(r.prompt_ids) + list(out.token_ids) for r, out in zip(requests, results)]
    with torch.no_grad():
        scored = score_logprobs(model, finished, [len(r.prompt_ids) for r in requests],
                                temperature=temperature or 1.0)
    for i, (out, want) in enumerate(zip(results, scored)):
        got = torch.tensor(out.logprobs)
        assert torch.equal(got, want), ("engine vs trainer", family, dtype, hf, i, (got - want).abs().max())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=(Phase.explicit, Phase.generate),  # no shrinking: the message names the whole config
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_drawn_shapes_are_batch_invariant(family, dtype, data):
    hf = data.draw(hf_configs(family), label="config.json")
    seqs, prompts, order = data.draw(workloads(hf["vocab_size"]), label="workload")
    temperature = data.draw(st.sampled_from([0.0, 0.8]), label="temperature")
    check_model(family, dtype, hf, seqs, prompts, order, temperature)


def test_the_issue_14_mla_shape_is_batch_invariant():
    """The report of issue #14 (MLA alone: every layer dense, q_lora_rank None, v_head_dim 12 !=
    qk_nope_head_dim 16, rope 8, kv_lora_rank 32, 4 heads), fp32 and bf16."""
    hf = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None,
          "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
          "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "first_k_dense_replace": 2, "max_position_embeddings": 128}
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (5, 29, 17, 40)]
    for dtype in DTYPES:
        check_model("deepseek_v3", dtype, hf, seqs, [2, 9, 16, 1], [3, 1, 0, 2], temperature=0.8)


@pytest.mark.parametrize("family,layers,widths", [
    ("llama3", 1, {"intermediate_size": 72}), ("llama3", 2, {"intermediate_size": 40}),
    ("qwen3_moe", 2, {"intermediate_size": 72, "moe_intermediate_size": 40})])
def test_ffn_widths_off_the_vector_width_are_batch_invariant(family, layers, widths):
    """FFN / expert widths that are not a multiple of 32: each of these failed (fp32, engine vs
    trainer) before SiLU went through ``numerics.rowwise`` (a decode row's last elements took the
    scalar exp)."""
    hf = {"model_type": {"llama3": "llama"}.get(family, family), "vocab_size": 64, "hidden_size": 32,
          "num_hidden_layers": layers, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
          "max_position_embeddings": 128, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 2,
          **widths}
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (5, 29, 17, 40)]
    for dtype in DTYPES:
        check_model(family, dtype, hf, seqs, [2, 9, 16, 1], [3, 1, 0, 2], temperature=0.8)


def test_elementwise_gives_every_element_the_vector_code():
    """``numerics.rowwise`` (on) = ``elementwise``: a row alone and inside a call of any size, narrow
    widths and calls large enough to be split across threads."""
    g = torch.Generator().manual_seed(0)
    with numerics.batch_invariant():
        for rows, width in ((600, 40), (1001, 96), (300, 8)):
            x = 3 * torch.randn(rows, width, generator=g)
            full = numerics.rowwise(torch.nn.functional.silu, x)
            assert all(torch.equal(numerics.rowwise(torch.nn.functional.silu, x[i:i + 1]), full[i:i + 1])
                       for i in range(rows)), (rows, width)
            torch.testing.assert_close(full, torch.nn.functional.silu(x), rtol=0, atol=1e-6)


def test_head_matmul_values_gradients_and_autocast():
    """The per-head projection is the einsum it replaces (fp32, another summation order), trains
    (gradients to both inputs) and follows autocast as a linear does."""
    from lockstep.ops.batch_invariant import head_matmul

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 16, generator=g, requires_grad=True)
    w = torch.randn(3, 16, 12, generator=g, requires_grad=True)
    out, ref = head_matmul(x, w), torch.einsum("bhtk,hkn->bhtn", x, w)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(torch.autograd.grad(out.square().sum(), (x, w)),
                         torch.autograd.grad(ref.square().sum(), (x, w))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)  # sums of ~100 products of O(10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert head_matmul(x, w).dtype == torch.bfloat16


def test_mla_head_projections_do_not_depend_on_the_token_count():
    """MLA's absorbed per-head projections at DeepSeek-V3's kv_lora_rank (512), one head: one row
    alone, and inside 1 and 300 rows. Before they ran one batched MKL SGEMM over (head, 16-row tile)
    entries, whose kernel moved with the entry count (MKL's AVX2 path: 1 entry vs 2), so a decode
    row and the same row in a trainer's batch differed; here as in test (b) of a CPU without AMX."""
    code = (
        "import torch\n"
        "from lockstep import numerics\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x, w = torch.randn(1, 1, 300, 512, generator=g), torch.randn(1, 512, 32, generator=g)\n"
        "with numerics.batch_invariant():\n"
        "    full = numerics.head_matmul(x, w)\n"
        "    for n in (1, 9, 16, 17):\n"
        "        assert torch.equal(numerics.head_matmul(x[:, :, :n], w), full[:, :, :n]), n\n"
        "    torch.testing.assert_close(full, x @ w, rtol=1e-5, atol=1e-4)\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, **_NON_AMX_ENV},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr[-3000:]


#: a CPU without AMX as one machine can play it (module docstring)
_NON_AMX_ENV = {isa.ENV: "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
LOWER_PATHS = {
    "non_amx": _NON_AMX_ENV,
    "portable": {isa.ENV: "portable", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    # not on MKL's AVX2 path: its 6-row SGEMM micro-kernel gives a row other bits by its place in a
    # tile, so the tiled fallbacks are not batch-invariant there (docs/numerics.md)
    "no_c_kernels": {"LOCKSTEP_NO_C_KERNELS": "1", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
}


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(LOWER_PATHS))
def test_drawn_shapes_at_lower_kernel_paths(path):
    """The drawn-shape test (fewer examples each) in a subprocess whose environment picks the path
    before torch loads (oneDNN and MKL read their caps once)."""
    env = {**os.environ, **LOWER_PATHS[path], "LOCKSTEP_TEST_SHAPE_EXAMPLES": "3"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", __file__,
                             "-k", "test_drawn_shapes_are_batch_invariant"],
                            env=env, capture_output=True, text=True, timeout=900)
    passed = result.returncode == 0 and re.search(r"\b8 passed", result.stdout)  # 4 families x 2 dtypes
    assert passed, result.stdout[-3000:] + result.stderr[-2000:]
