"""lockstep.load.load_model: one entry point for a pretrained name, a .gguf file, HF / lockstep / run
directories, used by generation, a trainer's init_from and the RL policy."""

from __future__ import annotations

import dataclasses

import gguf  # a test dependency (pyproject [test]): fail loudly if missing
import numpy as np
import pytest
import torch

from lockstep import load
from lockstep.config.base import ConfigError
from lockstep.load import load_model, resolve_source
from lockstep.models.common.rope import RopeConfig
from lockstep.models.common.transformer import build_model
from lockstep.models.hf import save_hf, save_lockstep_dir
from lockstep.models.llama3.hf import ADAPTER
from lockstep.models.registry import model_config

#: GPT-2's byte -> printable character table (what byte-level BPE vocabularies are written in)
_BYTES = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
_CHARS = _BYTES + [256 + n for n in range(256 - len(_BYTES))]
_BYTE_CHARS = [chr(c) for _, c in sorted(zip(_BYTES + [b for b in range(256) if b not in _BYTES], _CHARS))]
_HF_TO_GGUF = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight"}
TEMPLATE = "{% for m in messages %}<|endoftext|>{{ m['content'] }}{% endfor %}"


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k permutation (HF half-rotation -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def source_model():
    tokens = [*_BYTE_CHARS, "he", "<|endoftext|>"]
    cfg = dataclasses.replace(model_config("llama3", "debug"), vocab_size=len(tokens), rope=RopeConfig(theta=10000.0),
                              tie_embeddings=False)
    return build_model(cfg, seed=3).eval(), tokens


@pytest.fixture(scope="module")
def gguf_file(source_model, tmp_path_factory):
    """A llama GGUF file as llama.cpp writes one (F32 tensors, permuted q/k, GPT-2 BPE vocabulary)."""
    model, tokens = source_model
    cfg = model.config
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_block_count(cfg.n_layers)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_token_merges(["h e"])
    w.add_bos_token_id(len(tokens) - 1)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_chat_template(TEMPLATE)
    hf_state = ADAPTER.state_to_hf({k: v.detach() for k, v in model.state_dict().items()}, cfg)
    for name, tensor in hf_state.items():
        array = tensor.float().numpy().copy()
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers."):].split(".", 1)
            gguf_name = f"blk.{layer}.{_HF_TO_GGUF[rest]}"
            if rest.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                heads = cfg.n_heads if "q_proj" in rest else cfg.n_kv_heads
                array = _llama_cpp_permute(array, heads)
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        w.add_tensor(gguf_name, np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_file_loads_as_the_model_it_was_written_from(source_model, gguf_file, tmp_path):
    model, _ = source_model
    loaded = load_model(gguf_file, cache_dir=tmp_path)
    assert loaded.kind == "hf" and loaded.path.parent == tmp_path / "gguf"
    state = loaded.model.state_dict()
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # F32 in the file: exact
    ids = loaded.tokenizer.encode("hello")
    assert loaded.tokenizer.decode(ids) == "hello" and len(ids) == 4  # "he" merged, then l, l, o
    assert loaded.chat_template is not None and loaded.stop_token_ids == [len(_BYTE_CHARS) + 1]
    marker = loaded.path / ".lockstep-complete-v3"
    before = marker.stat().st_mtime_ns
    assert load_model(gguf_file, cache_dir=tmp_path, tokenizer=False).path == loaded.path  # converted once
    assert marker.stat().st_mtime_ns == before


def test_a_pretrained_name_resolves_through_the_registry(source_model, tmp_path, monkeypatch):
    model, _ = source_model
    save_hf(model, tmp_path / "hf")
    calls = []
    monkeypatch.setitem(load.PRETRAINED, "tiny", lambda cache_dir: calls.append(cache_dir) or tmp_path / "hf")
    loaded = load_model("tiny", tokenizer=False, cache_dir=tmp_path / "cache")
    assert calls == [tmp_path / "cache"] and loaded.path == tmp_path / "hf"
    assert all(torch.equal(loaded.model.state_dict()[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ConfigError, match=r"^init_from nope-model: no such directory \(nor a pretrained name: "
                                          r"\[.*'smollm2'.*'tiny'\]\)"):
        resolve_source("nope-model", "init_from")


def test_a_run_config_rebuilds_a_lockstep_dir_and_must_keep_its_function(source_model, tmp_path):
    model, _ = source_model
    save_lockstep_dir(model, tmp_path / "ls")
    cfg = model.config
    run = dataclasses.replace(cfg, max_seq_len=32, flavor="mine",
                              attention=dataclasses.replace(cfg.attention, backend="reference"))
    loaded = load_model(tmp_path / "ls", config=run, tokenizer=False, field="init_from").model
    assert loaded.config == run and loaded.rope.cos.shape[0] == 32
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # sdpa vs the reference backend: fp32 softmax/matmul in another order, ~1e-6 on these logits
        torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=1e-5)
    with pytest.raises(ConfigError, match=r"^init_from .*/ls: the run's model config does not match the "
                                          r"checkpoint: model\.norm_eps"):
        load_model(tmp_path / "ls", config=dataclasses.replace(cfg, norm_eps=1e-3), tokenizer=False,
                   field="init_from")


def test_rl_policy_loads_init_from_with_the_run_config(source_model, gguf_file, tmp_path, monkeypatch):
    from lockstep.rl.config import RLConfig
    from lockstep.rl.policy import load_policy

    monkeypatch.setenv("LOCKSTEP_CACHE", str(tmp_path))
    model, _ = source_model
    run = dataclasses.replace(model.config, max_seq_len=48)
    policy = load_policy(RLConfig(init_from=str(gguf_file), model=run))
    assert policy.model.config == run and policy.model.training
    assert all(torch.equal(policy.model.state_dict()[k], v) for k, v in model.state_dict().items())
    assert policy.eos_id == len(_BYTE_CHARS) + 1 and policy.chat_template is not None
    with pytest.raises(ConfigError, match=r"^init_from .*: the run's model config does not match the checkpoint: "
                                          r"model\.n_layers"):
        load_policy(RLConfig(init_from=str(gguf_file), model=dataclasses.replace(run, n_layers=run.n_layers + 1)))
