"""Generation on a group of processes: the engine run tensor-parallel (TP), expert-parallel (EP) or both.

``shard_for_generation(model, tp=2)`` (or ``ep=2``, or ``tp=2, ep=2``) shards a loaded lockstep Transformer in place
over a process group (every rank holding the same full weights before, e.g. loaded from the same
checkpoint or built with the same seed; each keeps its slice, no communication), and
:class:`GroupEngine` (an :class:`~lockstep.generate.engine.Engine`, same public API) runs it. Every
rank of the group runs the same engine on the same requests in the same order
(:func:`share_requests` hands group rank 0's list to the others); results are on every rank.

**TP** is the trainer's rule, :func:`lockstep.parallel.parallelize.apply_dense_tp`, with
``sequence_parallel=False``: the residual stream is replicated. GQA: ``wq``/``wk``/``wv`` column-wise
(each rank holds ``n_heads/tp`` query and ``n_kv_heads/tp`` KV heads), ``wo`` row-wise (output
all-reduced); q/k norms, GPT-OSS sinks per head. The KV cache pools of a rank hold its KV heads only.
MLA: ``wq``/``wq_b`` and ``wkv_b`` (per-head) column-wise, ``wo`` row-wise; the latent projections
``wq_a``/``wkv_a``, their norms and the latent cache are replicated (every rank caches the whole
latent; the absorbed path multiplies by its heads' rows of ``wkv_b``). Dense SwiGLU: ``w1``/``w3``
column-wise, ``w2`` row-wise. MoE: expert TP (router replicated; each expert's hidden dim split,
shared experts column/row-wise, the layer's partial output all-reduced). Embedding and head are
vocabulary-parallel; the head's logits are all-gathered, whole on every rank.

**EP**: each rank holds ``n_experts/ep`` routed experts of every MoE layer (rank r: experts
``[r E/ep, (r+1) E/ep)``); everything else is replicated. The tokens are the same on every rank and
the replicated router routes them identically, so a rank computes the rows routed to its experts
(weighted, scattered into ``[tokens, dim]``) and one all-reduce per layer sums the ranks' shares;
the shared experts (replicated) are added after the sum. With top-2 routing and ep=2 the per-token
sums are those of one process (``a + b`` in either order).

**TP x EP** (both > 1): the group is ``ep`` rows of ``tp`` consecutive ranks (a 2-D ``("ep", "tp")``
mesh, :func:`generation_grid`: its row and column groups are made by every process of the job, so a
group inside a larger job, e.g. an RL generator, is handed its grid). TP is applied over each row as above (the ep rows are replicas of the
attention, dense and shared-expert shards); then each rank keeps its row's ``E / ep`` experts of its
hidden-dim shard (``[Shard(0), Shard(d)]`` on the 2-D mesh; b2, which expert TP leaves whole, is added
by tp rank 0 only). A MoE layer sums its routed partials over the ep column (one all-reduce), adds the
shared experts' partial, and TP's output hook sums over the row: every expert's whole output once.

**Parameters** after sharding: every sharded parameter is a DTensor on the group's 1-D mesh (dim
name ``"tp"`` or ``"ep"``), ``Shard(0)`` for column-wise weights, vocab rows and EP experts,
``Shard(1)`` for row-wise weights, ``Shard(1)``/``Shard(2)`` for expert TP's hidden dims; every other
parameter is a plain tensor holding the whole parameter on every rank. :func:`generator_layout`
lists both (``name -> (global shape, mesh or None, placements)``). A weight sync writes each rank's
piece in place (``p.to_local().copy_(...)``, plain ones ``p.copy_(...)``); the engine reads the
weights each step (the packed-weight cache is off under a group, below).

**Sampling.** Every rank computes the logits (whole after the head's gather) and samples; group rank
0's token ids and log-probabilities are then broadcast (one small collective per sampling call),
so every rank's scheduler sees the same tokens whatever the ranks' float roundings.

**Engine options under a group**: ``compile_decode`` (the compiled graph would have to trace the
DTensor redistributions and collectives of every layer: not done), ``weights_dtype`` other than
"model" (the cast shadow copy is a deep copy of plain modules, not of DTensor parameters with their
parallel hooks) and ``speculative`` (the MTP draft path is not sharded) are ConfigErrors naming the
field. Batch-invariant mode runs under both: under TP each rank runs the invariant kernels on its
local shards and row-parallel partials are summed in rank order
(:class:`lockstep.ops.tp_invariant.OrderedSum`), so a TP generator's log-probabilities equal a
trainer's of the same TP degree bit for bit (docs/numerics.md says which layout pairs agree); under
EP it is bitwise equal to one process in the tested cases. ``pack_weights`` is silently
off, as under FSDP (:func:`lockstep.generate.packed.packable` refuses DTensor parameters). Refused
layouts: linear-attention (hybrid) models, DeepSeek-V3.2's indexer and V4's
compressed attention under TP (errors name the field). Under tp x ep the greedy tokens are one
process's (fp32; qwen3_moe in the suite, DeepSeek-V3 with shared experts and GPT-OSS with expert biases by hand),
log-probabilities within rounding (expert TP splits each expert's sum; not bitwise to one process).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lockstep.config.base import ConfigError
from lockstep.generate.config import EngineConfig, Request
from lockstep.generate.engine import Engine
from lockstep.generate.recurrent import recurrent_layers
from lockstep.models.common.moe import GroupedExperts, MoE

#: the attribute of a sharded model holding its :class:`GenerationGroup`
GROUP_ATTR = "generation_group"


@dataclasses.dataclass(frozen=True)
class GenerationGroup:
    """How a model is sharded for generation: the group's mesh (1-D ``"tp"`` or ``"ep"``; 2-D
    ``("ep", "tp")`` when both are > 1), the degrees and the whole group's process group."""

    mesh: DeviceMesh
    tp: int = 1
    ep: int = 1
    process_group: dist.ProcessGroup | None = None

    @property
    def group(self) -> dist.ProcessGroup:
        """Every rank of the generator (sampling agreement, the head's commands)."""
        return self.process_group if self.process_group is not None else self.mesh.get_group()

    @property
    def rank(self) -> int:
        """This process's rank in the group (0 samples for everyone)."""
        return dist.get_rank(self.group)


def group_of(model: nn.Module) -> GenerationGroup | None:
    """The :class:`GenerationGroup` of a model sharded by :func:`shard_for_generation`, else None."""
    return getattr(model, GROUP_ATTR, None)


def _device_type(model: nn.Module) -> str:
    return next(model.parameters()).device.type


def _renamed(err: ConfigError, field: str) -> ConfigError:
    """A trainer-rule error (``parallel.tp: ...``) with the generation field's name."""
    return ConfigError(str(err).replace("parallel.tp", f"{field}.tp", 1).replace("parallel.ep", f"{field}.ep", 1))


def check_generation_layout(model: nn.Module, tp: int, ep: int, world: int,
                            field: str = "generator_parallel") -> None:
    """ConfigError naming ``{field}.tp`` / ``{field}.ep`` for a layout that cannot shard ``model``."""
    for name, value in (("tp", tp), ("ep", ep)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{field}.{name}: must be an integer >= 1, got {value!r}")
    if tp * ep != world:
        raise ConfigError(f"{field}: tp x ep = {tp * ep} must equal the group's size {world}")
    cfg = model.config
    if recurrent_layers(model) and tp > 1:
        raise ConfigError(f"{field}.tp: {cfg.family} has linear-attention (recurrent) layers, which the "
                          f"generation engine does not run tensor-parallel; use tp=1")
    if tp > 1:
        from lockstep.parallel.tp_blocks import check_tp_divides

        for name in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
            value = getattr(cfg, name, 0) or 0
            if value % tp:
                raise ConfigError(f"{field}.tp: {tp} does not divide model.{name}={value}")
        try:
            check_tp_divides(model, tp)
        except ConfigError as err:
            raise _renamed(err, field) from None
    if ep > 1:
        layers = [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]
        if not layers:
            raise ConfigError(f"{field}.ep: {ep} needs MoE layers, but {cfg.family} has none")
        for name, moe in layers:
            if moe.experts.n_experts % ep:
                raise ConfigError(f"{field}.ep: {ep} does not divide n_routed_experts={moe.experts.n_experts} "
                                  f"({name})")
            if type(moe.experts) is not GroupedExperts:
                raise ConfigError(f"{field}.ep: {name}.experts is a {type(moe.experts).__name__}; expert-parallel "
                                  f"generation takes the plain grouped experts")


def shard_for_generation(model: nn.Module, *, tp: int = 1, ep: int = 1, group: dist.ProcessGroup | None = None,
                         field: str = "generator_parallel", grid: DeviceMesh | None = None) -> nn.Module:
    """Shard ``model`` in place over ``group`` (default: the world) for :class:`GroupEngine`; returns
    it. Every rank must hold the same full weights; see the module docstring for the layouts. ``grid``
    (tp and ep > 1, a group smaller than the job): the group's :func:`generation_grid`."""
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    if group_of(model) is not None:
        raise RuntimeError("shard_for_generation: the model is already sharded for generation")
    check_generation_layout(model, tp, ep, world, field)
    if tp > 1 and ep > 1:
        mesh = _grid_of(group, ep, tp, _device_type(model), grid, field)
        tp_mesh, ep_mesh = mesh["tp"], mesh["ep"]
    else:
        mesh = tp_mesh = ep_mesh = DeviceMesh.from_group(group, _device_type(model),
                                                         mesh_dim_names=("ep" if ep > 1 else "tp",))
    if tp > 1:
        from lockstep.parallel.parallelize import apply_dense_tp

        try:
            apply_dense_tp(model, tp_mesh, sequence_parallel=False)
        except ConfigError as err:
            raise _renamed(err, field) from None
    if ep > 1:  # after TP: each rank keeps its experts' slice of its hidden-dim shard
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            _shard_experts(moe, mesh, ep_mesh)
    setattr(model, GROUP_ATTR, GenerationGroup(mesh, tp, ep, group))
    return model


def generation_grid(ranks: list[int], ep: int, tp: int, device_type: str = "cpu") -> DeviceMesh:
    """The ``("ep", "tp")`` mesh of a tp x ep generation group over global ``ranks``: ``ep`` rows of
    ``tp`` consecutive ranks (tp neighbours, as the trainer's mesh puts tp innermost). Collective over
    the whole job: every process calls it, in the same order (torch names its row and column groups by
    a counter every process must keep in step); the ranks outside get a mesh they are not in."""
    return DeviceMesh(device_type, torch.tensor(list(ranks)).view(ep, tp), mesh_dim_names=("ep", "tp"))


def _grid_of(group: dist.ProcessGroup, ep: int, tp: int, device_type: str, grid: DeviceMesh | None,
             field: str) -> DeviceMesh:
    ranks = dist.get_process_group_ranks(group)
    if grid is None:
        if len(ranks) != dist.get_world_size():
            raise ValueError(f"shard_for_generation: a tp x ep group inside a larger job needs its grid made by every "
                             f"process of the job (grid=generation_grid({ranks}, ...))")
        return generation_grid(ranks, ep, tp, device_type)
    if grid.mesh.flatten().tolist() != ranks or tuple(grid.mesh.shape) != (ep, tp):
        raise ConfigError(f"{field}: the grid {grid} is not the group's ranks {ranks} as {ep} x {tp}")
    return grid


class _ExpertShare(GroupedExperts):
    """This rank's ``E / ep`` experts of a MoE layer (``expert_offset``.. of ``n_global_experts``),
    their stacked weights DTensors ``Shard(0)`` on the ep mesh; ``forward(x, counts)`` computes rows
    of its own experts only (``counts``: its experts' counts), no exchange."""

    takes_routing = False  # the routing weights are applied by the layer (``_routed_share``)
    #: whether this rank adds the output bias b2 (under expert TP only tp rank 0's partial sum carries it)
    adds_b2: bool = True

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(_local(w) for w in (self.w1, self.w2, self.w3))  # type: ignore[return-value]

    def local_biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        b1, b3, b2 = (None if b is None else _local(b) for b in (self.b1, self.b3, self.b2))
        return b1, b3, (b2 if b2 is None or self.adds_b2 else torch.zeros_like(b2))

    def extra_repr(self) -> str:
        return f"experts {self.expert_offset}..{self.expert_offset + self.n_experts - 1} of {self.n_global_experts}"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _shard_experts(moe: MoE, mesh: DeviceMesh, ep_mesh: DeviceMesh) -> None:
    """Keep this rank's ``E / ep`` experts; ``mesh``: the group's (``ep_mesh`` itself, or 2-D
    ``("ep", "tp")`` after expert TP split the hidden dim: the slices become ``[Shard(0), <tp's>]``
    DTensors there, a tensor TP left whole ``Replicate`` on tp)."""
    experts = moe.experts
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    n_local = experts.n_experts // ep
    experts.__dict__.pop("local_biases", None)  # expert TP's per-instance biases: the class's below
    experts.__class__ = _ExpertShare  # the same module (impl, activation, init stds), holding its slice
    experts.n_global_experts, experts.expert_offset = experts.n_experts, rank * n_local
    experts.n_experts = n_local
    both = mesh.ndim == 2
    if both:
        experts.adds_b2 = mesh["tp"].get_local_rank() == 0
    for name in ("w1", "w2", "w3", "b1", "b2", "b3"):
        p = getattr(experts, name)
        if p is None:
            continue
        local = _local(p.detach())[rank * n_local:(rank + 1) * n_local].clone()
        placements = [Shard(0)]
        if both:
            placements.append(p.placements[0] if isinstance(p, DTensor) else Replicate())
        setattr(experts, name, nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False),
                                            requires_grad=p.requires_grad))
    moe.routed_and_shared = _routed_share(moe, ep_mesh.get_group())


def _routed_share(moe: MoE, group: dist.ProcessGroup):
    """``MoE.routed_and_shared`` of an expert-parallel generation rank (module docstring)."""

    def routed_and_shared(flat: torch.Tensor, expert_in: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                          counts: torch.Tensor) -> torch.Tensor:
        experts = moe.experts
        lo, n = experts.expert_offset, experts.n_experts
        order = indices.reshape(-1).argsort(stable=True)  # rows sorted by global expert: this rank's are contiguous
        start = int(counts[:lo].sum())
        mine = order[start:start + int(counts[lo:lo + n].sum())]
        out = torch.zeros_like(flat)
        if mine.numel():
            token = mine // moe.top_k
            routed = experts(expert_in[token], counts[lo:lo + n])
            routed = routed * weights.reshape(-1)[mine].unsqueeze(1).to(routed.dtype)
            out.index_add_(0, token, routed.to(flat.dtype))
        dist.all_reduce(out, group=group)
        shared = moe.shared_output(flat)
        return out if shared is None else out + shared

    return routed_and_shared


def generator_layout(model: nn.Module) -> dict[str, tuple[torch.Size, DeviceMesh | None, tuple]]:
    """Every parameter of ``model`` (tied ones once, under their first name): ``(global shape, mesh,
    placements)``; a plain parameter (whole on every rank) has mesh None and placements ()."""
    layout = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            layout[name] = (p.shape, p.device_mesh, tuple(p.placements))
        else:
            layout[name] = (p.shape, None, ())
    return layout


def share_requests(requests: list[Request] | None, group: dist.ProcessGroup | None = None) -> list[Request]:
    """Group rank 0's ``requests`` on every rank of ``group`` (default: the world; the other ranks pass
    None): every rank of a generation group must queue the same requests in the same order."""
    group = group if group is not None else dist.group.WORLD
    src = dist.get_global_rank(group, 0)
    box: list[Any] = [requests if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def check_group_engine_config(config: EngineConfig, field: str = "engine") -> None:
    """Refuse the engine options that do not run on a sharded model (module docstring)."""
    if config.compile_decode != "none":
        raise ConfigError(f"{field}.compile_decode: a tensor/expert-parallel generator runs eager (the compiled "
                          f"step does not trace the layers' DTensor collectives); use compile_decode='none'")
    if config.weights_dtype != "model":
        raise ConfigError(f"{field}.weights_dtype: a tensor/expert-parallel generator runs the model's own weights "
                          f"(the cast copy cannot copy sharded DTensor parameters); use weights_dtype='model'")
    if config.speculative != "none":
        raise ConfigError(f"{field}.speculative: MTP speculative decoding is not sharded for tensor/expert-parallel "
                          f"generators; use speculative='none'")


class GroupEngine(Engine):
    """The engine on one rank of a generation group (a model from :func:`shard_for_generation`):
    every rank runs it on the same requests; group rank 0's sampled tokens are everyone's."""

    def __init__(self, model: nn.Module, tokenizer: Any = None, config: EngineConfig | None = None) -> None:
        self.group = group_of(model)
        if self.group is None:
            raise TypeError("GroupEngine needs a model sharded by lockstep.generate.parallel.shard_for_generation")
        config = config or EngineConfig()
        config.validate()
        check_group_engine_config(config)
        super().__init__(model, tokenizer, config)

    def _draw(self, seqs, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample as one process would, then take group rank 0's tokens and log-probabilities."""
        tokens, logprobs = super()._draw(seqs, logits)
        return agree_on_rank0(tokens, logprobs, self.group)


def agree_on_rank0(tokens: torch.Tensor, logprobs: torch.Tensor,
                   group: GenerationGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Group rank 0's ``tokens [B]`` (int64) and ``logprobs [B]`` (fp32) on every rank: one broadcast
    of both packed as float64 (token ids are exact below 2**53). NCCL groups broadcast on the GPU."""
    backend = dist.get_backend(group.group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    packed = torch.stack([tokens.to(torch.float64).cpu(), logprobs.to(torch.float64).cpu()]).to(device)
    dist.broadcast(packed, src=dist.get_global_rank(group.group, 0), group=group.group)
    packed = packed.cpu()
    return packed[0].to(tokens.dtype).to(tokens.device), packed[1].to(logprobs.dtype).to(logprobs.device)
