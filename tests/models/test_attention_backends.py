"""One attention-backend registry; layers resolve their kernel per call (lockstep.ops.attention)."""

import dataclasses

import pytest
import torch

from lockstep import numerics
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.ops import attention
from lockstep.ops.attention import (
    AttentionLayer,
    attention_backend,
    attention_layers,
    get_cached_attention,
    register_attention_backend,
    set_attention_wrapper,
)


def _model(family="llama3", backend=None):
    cfg = model_config(family, "debug")
    if backend is not None:
        cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, backend=backend))
    return build_model(cfg, seed=0)


def test_every_backend_registered_once_with_its_variants():
    for name in ("sdpa", "reference", "batch_invariant"):
        backend = attention_backend(name)
        assert backend.name == name and backend.forward is not None and backend.cached is not None
    assert attention_backend("sdpa").paged is not None  # the in-place decode kernel (ops.paged_attention)
    assert attention_backend("reference").paged is None and attention_backend("batch_invariant").paged is None
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'; choose from \['batch_invariant'"):
        attention_backend("flash")


def test_a_backend_without_a_cached_variant_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(attention._REGISTRY, "full_only", attention.AttentionBackend("full_only",
                                                                                      attention.sdpa_attention))
    with pytest.raises(ValueError, match="'full_only' has no KV-cache"):
        get_cached_attention("full_only")


def test_layers_follow_the_switch_per_call_without_being_rewritten():
    """While the switch is on, every layer runs the batch-invariant kernel (bitwise what a model
    configured with that backend computes), with no prepare step; its configured name never changes."""
    model, configured = _model(), _model(backend="batch_invariant")
    tokens = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    layers = list(attention_layers(model))
    assert len(layers) == model.config.n_layers
    plain = model(tokens)
    with numerics.batch_invariant():
        assert {layer.active_backend for layer in layers} == {"batch_invariant"}
        invariant = model(tokens)
    assert {layer.backend_name for layer in layers} == {"sdpa"}
    assert {layer.active_backend for layer in layers} == {"sdpa"}
    assert torch.equal(invariant, configured(tokens))
    assert not torch.equal(plain, invariant)  # the kernels differ in float order: the switch took effect
    assert torch.equal(plain, model(tokens))


def test_a_wrapper_runs_around_the_resolved_kernel_and_is_removed(monkeypatch):
    calls = []

    def counting(inner, q, k, v, *, causal, mask, scale):
        calls.append(inner)
        return inner(q, k, v, causal=causal, scale=scale)

    model = _model("deepseek_v3")  # MLA layers too
    tokens = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    before = model(tokens)
    n = set_attention_wrapper(model, counting)
    assert n == len(list(attention_layers(model))) > 0
    assert all(isinstance(m, AttentionLayer) for m in (b.attention for b in model.layers.values()))
    assert torch.equal(model(tokens), before)
    assert calls and all(fn is attention.sdpa_attention for fn in calls)
    assert set_attention_wrapper(model, None) == n
    calls.clear()
    model(tokens)
    assert not calls


def test_a_registered_backend_is_usable_by_name(monkeypatch):
    """A new backend registered once is what a layer configured with its name runs."""
    seen = []

    def forward(q, k, v, *, causal=True, mask=None, scale=None):
        seen.append(q.shape)
        return attention.reference_attention(q, k, v, causal=causal, mask=mask, scale=scale)

    monkeypatch.setitem(attention._REGISTRY, "spy", attention.AttentionBackend("spy", forward))
    register_attention_backend("spy", forward=forward, cached=attention.reference_cached_attention)
    model = _model(backend="spy")
    tokens = torch.randint(0, model.config.vocab_size, (1, 8))
    assert torch.equal(model(tokens), _model(backend="reference")(tokens))
    assert len(seen) == model.config.n_layers
