"""Tensor-parallel plans of the non-dense blocks: MLA attention, MoE feed-forwards, DeepSeek's MTP.

Applied from outside the model, after the dense pieces of ``parallelize.apply_dense_tp`` (sequence
parallel norms between blocks, the embedding sharded on the sequence, the head on the vocabulary).

MLA. ``wq`` / ``wq_b`` and ``wkv_b`` are column-wise (each rank holds ``n_heads / tp`` heads), ``wo``
row-wise; the latent projections ``wq_a`` / ``wkv_a`` and their norms stay replicated (plain
parameters, every rank computing them on the gathered sequence). The column-wise layers' input
conversion sums the gradients of the latents over the ranks; the one latent used outside them is the
rotary key ``k_pe``, shared by every head, whose gradient each rank has only for its own heads: a
forward hook on ``wkv_a`` sums that slice's gradient over the ranks.

MoE (expert tensor parallelism, ETP). The router and the selection bias are replicated and route the
gathered tokens identically on every rank, so expert counts and balance losses are those of one
process and are not reduced over tp. Each routed expert's hidden dim is split (``w1`` / ``w3`` on
it, ``w2`` on its input side, :func:`lockstep.parallel.expert.apply_expert_tensor_parallel`), the
shared experts like a dense MLP whose ``w2`` output is left partial: each rank computes a partial sum
of the layer's output, reduce-scattered onto the sequence once per layer. ``MoE.tp_region`` sums the
gradients of the tokens and routing weights entering that partial computation. With ``ep > 1`` the
ep exchange runs between the ranks of one tp index (each holding the same hidden slice of its
experts).

Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention). Each rank takes whole key-head groups: key
heads ``[r * Hk/tp, ...)`` and the value heads they serve. Projections laid out per head
(``in_proj_z``, ``in_proj_b``, ``in_proj_a``, Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``, grouped
per key head) are column-wise, ``wo`` row-wise, ``A_log`` / ``dt_bias`` sharded with the heads
(DTensors); the gated RMSNorm's weight, shared by every head, is replicated with its gradient
summed. Qwen3.5's ``in_proj_qkv`` and the conv channels are ``[q | k | v]``: no contiguous shard
holds whole heads, so those two weights are held whole on every rank (plain parameters), each
rank computing only its heads' rows and the gradient summed over tp (:class:`HeadRowsLinear`).

Output-gated attention (Qwen3.5 / Qwen3-Next): ``wq``'s rows are ``[query | gate]`` per head, so
GQA's column-wise split keeps each head's gate with it. GPT-OSS attention: q/k/v biases column-wise,
``wo``'s bias added once (row-wise), the sinks sharded with the heads. GPT-OSS experts: ``b1`` /
``b3`` split on the hidden dim like ``w1`` / ``w3``, ``b2`` added on tp rank 0 only (each rank's
output is a partial sum) with its gradient summed. Qwen's shared-expert gate is replicated: it
scales the partial shared output, so its logit's gradient is summed over tp.

MTP (DeepSeek-V3). The MTP layer's inputs (slices of the embeddings and of the final hidden states)
are gathered; its norms and ``proj`` are replicated; ``proj``'s output is put back on the sequence
(the MTP block then runs the block plan above, its final norm is sequence parallel and the shared
head is the model's). The residual stream of such a model is kept as DTensors, so the model's
slices of it are slices of the whole sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lockstep.config.base import ConfigError
from lockstep.models.common.compressed_attention import CompressedAttention
from lockstep.models.common.gated_deltanet import GatedDeltaNet
from lockstep.models.common.mla import MultiHeadLatentAttention
from lockstep.models.common.moe import MoE
from lockstep.ops.tp_invariant import OrderedSum


def grad_sum_region(tp_mesh):
    """Megatron's ``f``: identity forward; the gradient is summed over the tp ranks in backward."""

    def f(t):
        return DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])

    return f


class PartialRowwise(RowwiseParallel):
    """Row-wise Linear whose output stays this rank's partial sum (a local tensor, reduced by the
    caller); its gradient is the full one on every rank."""

    def __init__(self) -> None:
        super().__init__(output_layouts=Partial())

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local(grad_placements=[Replicate()])


def check_tp_divides(model: nn.Module, tp: int) -> None:
    """ConfigError naming the field when tp does not split an MLA or MoE layer evenly."""
    for name, module in model.named_modules():
        if isinstance(module, CompressedAttention):
            raise ConfigError(f"parallel.tp: DeepSeek-V4's compressed attention ({name}: one shared key=value head, "
                              "compressed entries, hyper-connection streams) has no tensor-parallel plan; use "
                              "parallel.tp=1")
        if isinstance(module, GatedDeltaNet) and module.n_k % tp:  # whole key-head groups per rank
            raise ConfigError(f"parallel.tp: {tp} does not divide model.linear_attention.n_k_heads={module.n_k} "
                              f"({name})")
        if isinstance(module, MultiHeadLatentAttention) and getattr(module, "indexer", None) is not None:
            raise ConfigError(f"parallel.tp: DeepSeek-V3.2's sparse indexer ({name}.indexer) is not supported under "
                              "tensor parallelism; use parallel.tp=1 (FSDP2 / dp_shard works)")
        if isinstance(module, MultiHeadLatentAttention) and module.n_heads % tp:
            raise ConfigError(f"parallel.tp: {tp} does not divide model.n_heads={module.n_heads} ({name})")
        if isinstance(module, MoE):
            cfg = module.config
            if module.experts.hidden_dim % tp:
                raise ConfigError(f"parallel.tp: {tp} does not divide the expert hidden size "
                                  f"model.feed_forward.moe_ffn_dim={module.experts.hidden_dim} ({name})")
            if module.shared_experts is not None and module.shared_experts.w1.out_features % tp:
                raise ConfigError(f"parallel.tp: {tp} does not divide the shared experts' hidden size "
                                  f"{module.shared_experts.w1.out_features} ({name}; model.feed_forward."
                                  f"n_shared_experts x moe_ffn_dim)")


def mla_plan(block: nn.Module, prefix: str = "attention", sequence_parallel: bool = True) -> dict:
    attn = block.get_submodule(prefix)
    residual = Shard(1) if sequence_parallel else Replicate()
    plan = {
        # the gathered sequence as a plain tensor: the latent projections are plain (replicated) Linears
        prefix: PrepareModuleInput(input_layouts=(residual, None), desired_input_layouts=(Replicate(), None),
                                   use_local_output=True),
        f"{prefix}.{'wq_b' if attn.q_lora_rank else 'wq'}": ColwiseParallel(),
        f"{prefix}.wkv_b": ColwiseParallel(),
    }  # wo: row-wise, as GQA's (the caller's, with its choice of output)
    return plan


def install_mla_hooks(attn: MultiHeadLatentAttention, tp_mesh) -> None:
    """Sum the gradient of the shared rotary key ``k_pe`` (the last ``qk_rope_head_dim`` columns of
    ``wkv_a``'s output) over the tp ranks; ``c_kv``'s gradient is summed by ``wkv_b``'s input."""
    f = grad_sum_region(tp_mesh)
    rank = attn.kv_lora_rank

    def hook(module, args, out):
        import torch

        return torch.cat([out[..., :rank], f(out[..., rank:])], dim=-1)

    attn.wkv_a.register_forward_hook(hook)
    # the absorbed (latent-cache) path multiplies by wkv_b's rows of this rank's heads
    attn.absorbed_kv_weight = lambda: _local(attn.wkv_b.weight)


def moe_plan(prefix: str = "feed_forward", shared: bool = False, residual_dtensor: bool = False,
             sequence_parallel: bool = True) -> dict:
    residual = Shard(1) if sequence_parallel else Replicate()  # without SP the partial sums are all-reduced
    plan = {
        prefix: PrepareModuleInputOutput(
            input_layouts=(residual,), desired_input_layouts=(Replicate(),), use_local_input=True,
            # the ranks' partial outputs summed in a fixed order in batch-invariant mode (plain Partial otherwise)
            output_layouts=(OrderedSum(),), desired_output_layouts=(residual,), use_local_output=not residual_dtensor),
    }
    if shared:
        plan[f"{prefix}.shared_experts.w1"] = ColwiseParallel()
        plan[f"{prefix}.shared_experts.w3"] = ColwiseParallel()
        plan[f"{prefix}.shared_experts.w2"] = PartialRowwise()
    return plan


def install_moe_tp(moe: MoE, tp_mesh) -> None:
    from lockstep.parallel.expert import apply_expert_tensor_parallel

    apply_expert_tensor_parallel(moe, tp_mesh)
    f = moe.tp_region = grad_sum_region(tp_mesh)
    experts = moe.experts
    if experts.b1 is not None:
        for name in ("b1", "b3"):  # [E, F]: split on the hidden dim like w1 / w3
            _shard_parameter(experts, name, tp_mesh, dim=1)
        first = float(tp_mesh.get_local_rank() == 0)  # b2 [E, D] joins one rank's partial sum
        experts.local_biases = lambda: (_local(experts.b1), _local(experts.b3), f(experts.b2) * first)
    if moe.shared_expert_gate is not None:  # scales the partial shared output: sum its logit's gradient
        moe.shared_expert_gate.register_forward_hook(lambda module, args, out: f(out))


def sinks_tp(attn: nn.Module, tp_mesh) -> None:
    """Shard GPT-OSS's per-head sinks with the heads (the q/k/v/o plan is GQA's, biases included)."""
    if attn.sinks is not None:
        _shard_parameter(attn, "sinks", tp_mesh, dim=0)
        attn.local_sinks = lambda: _local(attn.sinks)


class HeadRowsLinear(nn.Linear):
    """A Linear held whole on every tp rank that computes only its rank's output rows (``row_ranges``,
    half-open): for a fused projection whose rows interleave the heads by type. Its input's and
    weight's gradients are summed over tp (each rank has those of its own rows)."""

    row_ranges: list[tuple[int, int]]
    region: object

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.region(x), _rows(self.region(self.weight), self.row_ranges))


def gated_deltanet_plan(block: nn.Module, tp_mesh, local_output: bool) -> dict:
    """The plan of a Gated DeltaNet in ``block.attention`` (see the module docstring); sets the
    layer's head counts and widths to its rank's and installs the per-head parameters' slices."""
    attn: GatedDeltaNet = block.attention
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    f = grad_sum_region(tp_mesh)
    n_k, n_v = attn.n_k // tp, attn.n_v // tp
    kw, vw = n_k * attn.dk, n_v * attn.dv  # this rank's key / value widths
    rows = [(rank * kw, (rank + 1) * kw), (attn.key_dim + rank * kw, attn.key_dim + (rank + 1) * kw),
            (2 * attn.key_dim + rank * vw, 2 * attn.key_dim + (rank + 1) * vw)]  # q | k | v channels
    plan = {
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                        use_local_output=True),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=local_output),
        # per value head over [B, T, heads, Dv]: the head dim is sharded, the weight shared
        "attention.norm": PrepareModuleInputOutput(
            input_layouts=(Shard(2), Shard(2)), desired_input_layouts=(Shard(2), Shard(2)),
            output_layouts=(Shard(2),), desired_output_layouts=(Shard(2),), use_local_output=True),
    }
    names = (["in_proj_qkvz", "in_proj_ba"] if attn.config.projection == "grouped"
             else ["in_proj_z", "in_proj_b", "in_proj_a"])
    plan.update({f"attention.{n}": ColwiseParallel() for n in names})
    if attn.config.projection == "split":
        attn.in_proj_qkv.__class__ = HeadRowsLinear
        attn.in_proj_qkv.row_ranges, attn.in_proj_qkv.region = rows, f
    distribute_module(attn.norm, tp_mesh)  # replicated weight (its gradient reduced over the heads' ranks)
    for name in ("A_log", "dt_bias"):
        _shard_parameter(attn, name, tp_mesh, dim=0)
    attn.local_parameters = lambda: (_rows(f(attn.conv1d.weight), rows), _local(attn.A_log), _local(attn.dt_bias))
    attn.n_k, attn.n_v, attn.key_dim, attn.value_dim = n_k, n_v, kw, vw
    attn.conv_dim = 2 * kw + vw
    return plan


def _rows(w: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([w[lo:hi] for lo, hi in ranges])


def _shard_parameter(module: nn.Module, name: str, tp_mesh, dim: int) -> None:
    """Replace a parameter every tp rank holds whole by its chunk ``rank`` on ``dim`` as a DTensor."""
    p = getattr(module, name)
    local = p.detach().chunk(tp_mesh.size(), dim=dim)[tp_mesh.get_local_rank()].clone()
    setattr(module, name, nn.Parameter(DTensor.from_local(local, tp_mesh, [Shard(dim)], run_check=False),
                                       requires_grad=p.requires_grad))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def install_mtp_tp(layer: nn.Module, tp_mesh) -> None:
    """An MTP layer (``enorm``, ``hnorm``, ``proj``, ``block``, ``norm``): gathered replicated inputs,
    ``proj``'s output back on the sequence, a sequence-parallel final norm (the block has its plan)."""

    def gather_inputs(module, args):
        emb, h, *rest = args
        return (_replicated_local(emb), _replicated_local(h), *rest)

    def to_sequence(module, args, out):
        return DTensor.from_local(out, tp_mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(1)])

    layer.register_forward_pre_hook(gather_inputs)
    layer.proj.register_forward_hook(to_sequence)
    parallelize_module(layer.norm, tp_mesh, SequenceParallel())


def _replicated_local(t):
    if isinstance(t, DTensor):
        return t.redistribute(placements=[Replicate()]).to_local()
    raise ConfigError("parallel.tp: an MTP layer expects the model's residual stream as DTensors under TP")


def replicate_auxiliary_losses(model: nn.Module, tp_mesh) -> None:
    """The model's auxiliary losses (``pop_auxiliary``) as replicated DTensors: under loss parallel
    the LM loss is one, and a plain tensor added to it fails in backward. Each tp rank computes the
    same auxiliary loss from the gathered tokens, so it is replicated (its gradient is not summed)."""
    pop = getattr(model, "pop_auxiliary", None)
    if pop is None:
        return

    def pop_replicated():
        losses, metrics = pop()
        losses = {k: v if isinstance(v, DTensor) else DTensor.from_local(v, tp_mesh, [Replicate()], run_check=False)
                  for k, v in losses.items()}
        return losses, metrics

    model.pop_auxiliary = pop_replicated

