"""Pipeline stages of every model kind, in one process: MoE + MLA + dense-first layers + MTP heads,
tied embeddings, auxiliary losses joined to the backward, and the layer split (even, cost, explicit).

The stages run back to back here (no schedule): their output and auxiliary losses must be the
model's bitwise (the same modules, copied), and their gradients those of one process's
``loss + sum(aux)`` -- the shared embedding's as the sum of its first- and last-stage copies.
Multi-process schedules with these models: tests/parallel/test_loss_parity.py (pp layouts).
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lockstep.config.base import ConfigError
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.parallel.dims import ParallelConfig
from lockstep.parallel.pipeline_stage import (
    AuxiliaryState,
    cost_split,
    layer_ranges,
    parse_split,
    shared_parameter_names,
    split_into_stages,
    split_sizes,
    stage_costs,
)


def _deepseek():
    cfg = model_config("deepseek_v3", "debug")  # 3 layers: 1 dense + 2 MoE, MLA, 1 MTP depth
    moe = dataclasses.replace(cfg.feed_forward, seq_aux_loss_coef=0.01)
    return build_model(dataclasses.replace(cfg, feed_forward=moe), seed=0)


def _run_stages(stages, tokens, factor):
    state = AuxiliaryState(factor=torch.tensor(factor), n_microbatches=1)
    h = tokens
    for s in stages:
        s.aux_state = state
        h = s(h, tokens=tokens)
    return h, state.report


def test_deepseek_stages_match_the_model_forward_and_backward():
    model = _deepseek().train()
    stages = [s.train() for s in split_into_stages(model, 2)]
    assert list(stages[0].layers) == ["0", "1"] and list(stages[1].layers) == ["2"]
    assert stages[0].mtp is None and stages[1].mtp is not None and stages[1].tok_embeddings is not None
    tokens = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(tokens, -1, 1)

    logits = model(tokens)
    aux, metrics = model.pop_auxiliary()
    assert set(aux) == {"layers.1.feed_forward/seq_aux_loss", "layers.2.feed_forward/seq_aux_loss",
                        "mtp.0.block.feed_forward/seq_aux_loss", "mtp/loss"}
    (F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + sum(aux.values())).backward()

    out, report = _run_stages(stages, tokens, 1.0)
    assert torch.equal(out, logits)
    assert set(report.aux_losses) == set(aux)
    for k in aux:
        assert torch.equal(report.aux_losses[k], aux[k].detach()), k
    assert set(report.metrics) == set(metrics)
    F.cross_entropy(out.flatten(0, 1), targets.flatten()).backward()  # aux terms ride on the output

    full = dict(model.named_parameters())
    grads: dict[str, torch.Tensor] = {}
    for s in stages:
        for name, p in s.named_parameters():
            grads[name] = grads[name] + p.grad if name in grads else p.grad  # shared copies add up
    assert grads.keys() == full.keys()
    for name, p in full.items():
        # fp32, reordered sums only (the shared embedding: two partial sums added)
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    # the MTP copy of the embedding gets a gradient of its own: without the reduction it would be lost
    assert stages[1].tok_embeddings.weight.grad.abs().sum() > 0
    assert shared_parameter_names(model.config, stages[0]) == ["tok_embeddings.weight"]
    assert shared_parameter_names(model.config, stages[1]) == ["tok_embeddings.weight"]


def test_aux_losses_scale_with_the_factor():
    model = _deepseek().train()
    tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    grads = []
    for factor in (1.0, 0.5):
        stages = [s.train() for s in split_into_stages(model, 2)]
        out, _ = _run_stages(stages, tokens, factor)
        (out.sum() * 0).backward()  # the head contributes nothing: only the auxiliary terms
        grads.append(stages[1].mtp["0"].proj.weight.grad.clone())
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0] * 0.5, rtol=1e-6, atol=0)


def test_tied_embeddings_split_into_a_copy_on_the_last_stage():
    cfg = dataclasses.replace(model_config("llama3", "debug"), tie_embeddings=True)
    model = build_model(cfg, seed=0)
    first, last = split_into_stages(model, 2)
    assert first.output is None and last.tok_embeddings is None
    assert torch.equal(last.output.weight, model.tok_embeddings.weight)
    assert last.output.weight.data_ptr() != first.tok_embeddings.weight.data_ptr()
    assert shared_parameter_names(cfg, first) == ["tok_embeddings.weight"]
    assert shared_parameter_names(cfg, last) == ["output.weight"]
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(last(first(tokens)), model(tokens))
    untied = build_model(model_config("llama3", "debug"), seed=0)
    assert [shared_parameter_names(untied.config, s) for s in split_into_stages(untied, 2)] == [[], []]


def test_cost_split_minimises_the_slowest_stage():
    assert cost_split([1, 1, 1, 1], 2) == [2, 2]
    assert cost_split([1, 1, 1, 1], 2, last_extra=2) == [3, 1]  # the head weighs like two layers
    assert cost_split([1, 1, 1, 1], 2, first_extra=2) == [1, 3]
    assert cost_split([2, 2, 1, 1, 1, 1], 3) == [1, 2, 3]  # the only split with no stage above 3
    assert min(cost_split([1.0] * 7, 4)) >= 1


def test_cost_split_of_deepseek_counts_dense_layers_mtp_and_head():
    model = _deepseek()
    layers, emb, head = stage_costs(model, 64)
    assert layers[0] != layers[1] == layers[2]  # the dense first layer costs differently from the MoE ones
    assert head > 6 * model.config.dim * model.config.vocab_size  # the MTP depth is on the last stage
    sizes = split_sizes(model, 2, "cost", 64)
    assert sizes == cost_split(layers, 2, emb, head) and sum(sizes) == 3
    assert split_sizes(model, 2, "even") is None
    assert split_sizes(model, 2, "1,2") == [1, 2]
    assert [list(r) for r in layer_ranges(3, 2, [1, 2])] == [[0], [1, 2]]
    assert list(split_into_stages(model, 2, sizes=[1, 2])[1].layers) == ["1", "2"]


def test_bad_splits_name_the_field():
    with pytest.raises(ValueError, match=r"^parallel.pp_split: 'fast'"):
        parse_split("fast")
    with pytest.raises(ValueError, match=r"^parallel.pp_split: \[3, 1\] must give each of the 2 stages"):
        layer_ranges(3, 2, [3, 1])
    with pytest.raises(ConfigError, match="pp_split"):
        ParallelConfig(pp_split="2,x").validate()
    ParallelConfig(pp_split="cost").validate()
    ParallelConfig(pp_split="2,1").validate()


def test_pp_combines_with_tp_and_ep_in_the_config():
    dims = ParallelConfig(pp=2, tp=2).resolve(4)
    assert (dims.pp, dims.tp, dims.dp_shard) == (2, 2, 1)
    dims = ParallelConfig(pp=2, dp_shard=2, ep=2).resolve(4)
    assert (dims.pp, dims.ep, dims.dp_shard) == (2, 2, 2)


@pytest.mark.parametrize("family, flavor", [("qwen3_5", "debug-moe"), ("qwen3_next", "debug"), ("gpt_oss", "debug")])
def test_hybrid_and_sink_families_split_bitwise(family, flavor):
    """Gated DeltaNet hybrids, grouped projections and sliding-window sinks: blocks run as the trunk runs them."""
    model = build_model(model_config(family, flavor), seed=0).train()
    tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    logits = model(tokens)
    aux, _ = model.pop_auxiliary()
    out, report = _run_stages([s.train() for s in split_into_stages(model, 2)], tokens, 1.0)
    assert torch.equal(out, logits)
    assert report.aux_losses.keys() == aux.keys()
