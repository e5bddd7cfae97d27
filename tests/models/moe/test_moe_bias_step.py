"""Aux-loss-free balancing moves the routing bias once per optimizer step, outside the forward.

The forward only pools per-expert counts; ``Transformer.after_optimizer_step`` applies one sign
step from the counts of all the step's micro-batches. So an activation checkpoint's recompute
routes exactly as its forward did (bitwise-equal gradients with and without AC), and the expected
bias is checked against counts recomputed independently from the router inputs.
"""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lockstep.models.common.moe import MoE, MoEConfig, apply_routing_updates
from lockstep.models.common.moe_routing import route
from lockstep.models.common.transformer import build_model
from lockstep.models.registry import model_config
from lockstep.parallel.checkpointing import ActivationCheckpointConfig, apply_activation_checkpointing

# Large enough that one step visibly reroutes tokens: a recompute routed with a moved bias would
# change the gradients (measured: the former in-forward update changed them under "full").
SPEED = 0.05


def _model():
    cfg = model_config("qwen3_moe", "debug")
    cfg = dataclasses.replace(cfg, feed_forward=dataclasses.replace(
        cfg.feed_forward, bias_update_speed=SPEED, seq_aux_loss_coef=1e-2))
    return build_model(cfg, seed=0).train()


def _batches(vocab, n):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (2, 17), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _name(name):
    return name.replace("._checkpoint_wrapped_module", "")  # AC wraps each block


def _moes(model):
    return [(_name(n), m) for n, m in model.named_modules() if isinstance(m, MoE)]


class _Recount:
    """Counts each MoE layer's expert choices from its input, independently of the layer's own
    bookkeeping (the router math re-run by hand with the layer's current bias)."""

    def __init__(self, model):
        self.counts = {}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in _moes(model)]

    def _hook(self, name):
        def hook(module, args, _out):
            if not module.training:
                return
            flat = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            cfg = module.config
            _, idx, _ = route(flat @ module.gate.weight.detach().float().T, top_k=cfg.n_activated,
                              score_func=cfg.score_func, norm_topk_prob=cfg.norm_topk_prob,
                              n_group=cfg.n_group, topk_group=cfg.topk_group, bias=module.e_score_correction_bias)
            c = torch.bincount(idx.flatten(), minlength=module.n_experts)
            self.counts[name] = self.counts.get(name, 0) + c
        return hook


def _expected_bias(bias, counts):
    c = counts.float()
    return bias + SPEED * torch.sign(c.mean() - c)


def _train_step(model, opt, micro_batches):
    for inputs, targets in micro_batches:
        logits = model(inputs)
        aux, _ = model.pop_auxiliary()
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + sum(aux.values())
        (loss / len(micro_batches)).backward()
    grads = {_name(n): p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    model.after_optimizer_step()
    opt.zero_grad(set_to_none=True)
    return grads


def _biases(model):
    return {n: m.e_score_correction_bias.clone() for n, m in _moes(model)}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_routing_gradients_and_bias(mode):
    """Two steps: gradients and biases with AC equal those without, bitwise (the second step routes
    with a moved bias, so a recompute using another bias would show)."""
    plain = _model()
    ac = apply_activation_checkpointing(copy.deepcopy(plain), mode)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, ac)]
    for step, batch in enumerate(_batches(plain.config.vocab_size, 2)):
        before = _biases(plain)
        g_plain = _train_step(plain, opts[0], [batch])
        g_ac = _train_step(ac, opts[1], [batch])
        assert g_plain.keys() == g_ac.keys()
        for name in g_plain:
            assert torch.equal(g_plain[name], g_ac[name]), (step, name)
        b_plain, b_ac = _biases(plain), _biases(ac)
        for name in b_plain:
            assert torch.equal(b_plain[name], b_ac[name]), (step, name)
            assert not torch.equal(b_plain[name], before[name])  # it moved: the check is not vacuous


def test_bias_moves_once_per_step_from_the_pooled_counts_of_all_micro_batches():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recount = _Recount(model)
    for step in range(2):
        micro = _batches(model.config.vocab_size, 3 + step)[step:]  # 3 micro-batches per step
        before = _biases(model)
        recount.counts = {}
        for inputs, targets in micro:
            logits = model(inputs)
            aux, _ = model.pop_auxiliary()
            (F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + sum(aux.values())).backward()
            for name, bias in _biases(model).items():  # constant within the step
                assert torch.equal(bias, before[name]), name
        opt.step()
        model.after_optimizer_step()
        opt.zero_grad(set_to_none=True)
        after = _biases(model)
        for name in after:
            assert torch.equal(after[name], _expected_bias(before[name], recount.counts[name])), (step, name)
            assert not torch.equal(after[name], before[name])
        model.after_optimizer_step()  # nothing pending: a second call changes nothing
        for name, bias in _biases(model).items():
            assert torch.equal(bias, after[name])


def test_eval_forwards_count_nothing_and_dense_models_have_a_no_op_step():
    model = _model().eval()
    model(torch.randint(0, model.config.vocab_size, (2, 8)))
    model.after_optimizer_step()
    assert all(b.abs().max() == 0 for b in _biases(model).values())
    dense = build_model(model_config("llama3", "debug")).train()
    state = {k: v.clone() for k, v in dense.state_dict().items()}
    dense(torch.randint(0, dense.config.vocab_size, (1, 8)))
    dense.after_optimizer_step()
    assert all(torch.equal(v, state[k]) for k, v in dense.state_dict().items())


def test_apply_routing_updates_reaches_every_part_of_a_module_list():
    """Pipeline ranks hold their stages in an nn.ModuleList: the free function walks any tree."""
    parts = torch.nn.ModuleList([_model(), _model()])
    x = torch.randint(0, parts[0].config.vocab_size, (2, 8))
    for part in parts:
        part(x)
    apply_routing_updates(parts)
    for part in parts:
        for name, bias in _biases(part).items():
            assert bias.abs().max() > 0, name
            assert _moes(part)[0][1].pending_counts is None


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_recompute_adds_no_counts_under_either_checkpoint_implementation(use_reentrant):
    """Pins the recompute detection (a forward inside backward) to both torch checkpoint kinds."""
    torch.manual_seed(0)
    moe = MoEConfig(n_routed_experts=4, n_activated=2, moe_ffn_dim=8, bias_update_speed=0.1).build(dim=8, hidden_dim=8)
    moe.train()
    x = torch.randn(3, 5, 8, requires_grad=True)
    moe(x)
    once = moe.pending_counts.clone()
    moe.pending_counts = None
    checkpoint(moe, x, use_reentrant=use_reentrant).square().sum().backward()
    assert x.grad is not None and torch.equal(moe.pending_counts, once)
    assert int(once.sum()) == 3 * 5 * 2


@pytest.mark.xdist_group("trainer")
def test_trainer_steps_the_bias_once_per_step_with_and_without_activation_checkpointing(tmp_path):
    """The trainer's optimizer step reaches the routers: 2 steps of 2 micro-batches move the bias
    (pooled, once per step) and "full" AC trains bitwise like "none" (losses and biases)."""
    from lockstep.recipes import get_recipe
    from lockstep.train.trainer import Trainer

    speed = 1e-3  # small: the router's scores, not the bias, decide most choices (no full flip-back)
    runs = {}
    for mode in ("none", "full"):
        cfg = get_recipe("debug-moe").config()
        cfg = dataclasses.replace(cfg, run_dir=str(tmp_path / mode), steps=2, model=dataclasses.replace(
            cfg.model, feed_forward=dataclasses.replace(cfg.model.feed_forward, bias_update_speed=speed)))
        cfg.training = dataclasses.replace(cfg.training, grad_accum=2,
                                           activation_checkpoint=ActivationCheckpointConfig(mode=mode))
        cfg.output = dataclasses.replace(cfg.output, progress=False, sample_tokens=0, save_weights=False)
        cfg.validation = dataclasses.replace(cfg.validation, every=0)
        trainer = Trainer(cfg)
        result = trainer.fit()
        runs[mode] = (result.losses, _biases(trainer.model))
    (losses, biases), (ac_losses, ac_biases) = runs["none"], runs["full"]
    assert losses == ac_losses
    for name, bias in biases.items():
        assert torch.equal(bias, ac_biases[name]), name
        # two sign steps (four, one per micro-batch, could reach 4 * speed), and it moved
        assert 0 < bias.abs().max() <= 2 * speed + 1e-7, name
