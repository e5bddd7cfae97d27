"""Pipeline stage modules cut from a model, their layer split (even, by cost, or explicit), and how
auxiliary losses of any stage reach the backward.

A :class:`PipelineStageModule` holds deep copies of the model's own submodules under the model's
own names (``tok_embeddings`` on the first stage, its ``layers`` keys, ``norm`` + ``output`` on the
last; absent pieces are ``None``), so parameter FQNs -- and state dicts merged over stages -- are
the unsplit model's. Any block kind splits (GQA or MLA attention, SwiGLU or MoE feed-forward,
DeepSeek-V3's dense-first layers): a stage runs ``layer(h, rope)`` as ``Transformer.trunk`` does.

Pieces one process shares between the first and the last stage:

- **MTP heads** (DeepSeek-V3 ``mtp``) live on the last stage, which also keeps a copy of
  ``tok_embeddings`` (MTP embeds the input tokens, handed to every stage as the ``tokens`` keyword);
- **tied embeddings**: the last stage's ``output.weight`` is its own copy of the embedding.

Each copy gets only the gradient of its own stage's uses; ``PipelineRunner.reduce_shared_grads``
sums the copies' gradients (one all_reduce over the 2-rank group of the first and last stage's
ranks, or a local sum when one rank holds both, as under the V schedules), so both copies take the
single-process gradient and, through the same optimizer, stay equal.

Auxiliary losses (MoE balance losses, the MTP loss) are computed inside a stage's forward. The stage
pops them after each micro-batch (``Transformer.pop_auxiliary`` semantics) and ties
``factor * sum(losses)`` to its output with :class:`_AttachAuxiliary` (identity forward; backward
seeds the auxiliary term with gradient 1), so the schedule's ordinary backward through the stage
output -- from the next stage's input gradient or the loss -- backpropagates them too, on every
stage, under every schedule. ``factor = loss_scale / n_microbatches``: each micro-batch's auxiliary
losses are means over its sequences, so their micro-batch average is the full batch's value, and
the gradients add up to one process's ``loss + sum(aux)``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

SPLITS = ("even", "cost")


class _AttachAuxiliary(torch.autograd.Function):
    """``out`` unchanged; backward also sends gradient 1 into ``aux`` (a 0-d loss term)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        # the same storage, but not a view: the split-backward schedules (ZBV, DualPipeV) detach
        # stage outputs in place, which a view refuses; a clone would copy the logits
        return out.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)


@dataclasses.dataclass
class StageReport:
    """Per-rank sums over a step's micro-batches of what the stages popped (each value / n_mb)."""

    aux_losses: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    metrics: dict[str, torch.Tensor | float] = dataclasses.field(default_factory=dict)

    def add(self, losses: dict, metrics: dict, n_microbatches: int) -> None:
        for target, values in ((self.aux_losses, losses), (self.metrics, metrics)):
            for k, v in values.items():
                v = _local(v.detach()) if isinstance(v, torch.Tensor) else v
                v = v / n_microbatches
                target[k] = target[k] + v if k in target else v


@dataclasses.dataclass
class AuxiliaryState:
    """Shared by a runner's stages: the scale of auxiliary losses this step, and their report."""

    #: ``loss_scale / n_microbatches`` as a float32 0-d tensor (None: forward-only, nothing attached)
    factor: torch.Tensor | None = None
    n_microbatches: int = 1
    report: StageReport = dataclasses.field(default_factory=StageReport)


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class PipelineStageModule(nn.Module):
    """One pipeline stage of a ``Transformer`` (or a subclass with MTP heads).

    ``forward(x, tokens=None)``: token ids [B, T] on the first stage (embedded here), hidden states
    [B, T, dim] elsewhere (``tokens``: this micro-batch's token ids, needed by MTP on the last
    stage); runs this stage's blocks with rope for positions ``0..T-1`` (as the full model does by
    default; under cp, ``context`` set: the global positions of this rank's shard), then the final
    norm and head on the last stage (logits [B, T, vocab]). Under tensor
    parallelism outputs leave as local tensors (``residual_mesh``: the TP mesh when this stage's
    plan keeps the residual stream as DTensors, i.e. it has MTP heads; inputs are wrapped back).
    """

    def __init__(self, config, *, tok_embeddings: nn.Module | None, rope: nn.Module, layers: nn.ModuleDict,
                 norm: nn.Module | None, output: nn.Module | None, stage_index: int, n_stages: int,
                 mtp: nn.ModuleDict | None = None, model_cls: type | None = None) -> None:
        super().__init__()
        self.config = config
        self.stage_index = stage_index
        self.n_stages = n_stages
        self.tok_embeddings = tok_embeddings
        self.rope = rope
        self.layers = layers
        self.norm = norm
        self.output = output
        self.mtp = mtp
        self._model_cls = model_cls
        self._mtp_losses: list[torch.Tensor] = []
        self.mtp_context = None  # read by the model class's MTP code (``ContextParallel.install`` sets it)
        self._mtp_values: list[torch.Tensor] = []  # under cp: the whole-sequence per-depth losses
        #: the ContextParallel when cp > 1 (set by the runtime): inputs are this rank's load-balanced
        #: sequence shards, rope takes their global positions
        self.context = None
        #: set by the runner: where auxiliary losses go (None: popped and dropped)
        self.aux_state: AuxiliaryState | None = None
        #: the TP mesh when this stage's blocks keep the residual stream as DTensors (MTP under TP)
        self.residual_mesh = None
        #: set while torch's pipeline runs this stage on placeholders to learn its shapes
        self.inferring_shapes = False

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.n_stages - 1

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:
            tokens = x
            h = self.tok_embeddings(x)
        else:
            h = x
            if self.residual_mesh is not None:
                from torch.distributed.tensor import DTensor, Shard

                h = DTensor.from_local(h, self.residual_mesh, [Shard(1)], run_check=False)
        # the whole sequence: under TP a stage receives its sequence shard, attention gathers it
        seq = tokens.shape[1] if tokens is not None else h.shape[1]
        if self.context is not None and self.context.size > 1:  # cp: this rank's chunks r and 2cp-1-r
            rope = self.rope(self.context.positions(seq * self.context.size, h.device))
        else:
            rope = self.rope.prefix(seq)  # positions 0..T-1, as the full model's default
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.is_last:
            h = self.norm(h)
            self._mtp_forward(tokens, h)
            h = self.output(h)
        h = _local(h)
        return self._attach_auxiliary(h)

    def _mtp_forward(self, tokens: torch.Tensor | None, h: torch.Tensor) -> None:
        self._mtp_losses = []
        if self.mtp is None or not self.training or self.config.mtp_loss_weight <= 0:
            return
        if tokens is None:
            raise ValueError("pp: the last stage's MTP heads need the micro-batch's token ids (tokens=)")
        # the model class's own MTP code, run on this stage (it holds mtp, output and rope by the same names)
        predict = self._model_cls._mtp_predict
        cp = self.mtp_context
        if cp is not None:  # tokens are this rank's shards: shifted by global position, the loss cp's parts
            positions = cp.positions(tokens.shape[1] * cp.size, tokens.device)
            parts = [cp.cross_entropy(logits, targets) for logits, targets in predict(self, tokens, positions, None, h)]
            self._mtp_losses = [part for part, _ in parts]
            self._mtp_values = [value for _, value in parts]
            return
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
        emb = self.tok_embeddings(tokens)
        self._mtp_losses = [F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                            for logits, targets in predict(self, tokens, positions, emb, h)]

    def pop_auxiliary(self):
        """``Transformer.pop_auxiliary`` over this stage's modules (MoE terms), plus the MTP loss as
        ``DeepSeekV3Transformer.pop_auxiliary`` weighs it (lambda / D * sum_k L_k)."""
        from lockstep.models.common.transformer import Transformer

        losses, metrics = Transformer.pop_auxiliary(self)
        if self._mtp_losses:
            depth = self.config.n_mtp
            losses["mtp/loss"] = self.config.mtp_loss_weight * torch.stack(self._mtp_losses).sum() / depth
            values = self._mtp_values or self._mtp_losses
            metrics.update({f"mtp/loss_{k}": v.detach() for k, v in enumerate(values, start=1)})
        self._mtp_losses, self._mtp_values = [], []
        return losses, metrics

    def _attach_auxiliary(self, out: torch.Tensor) -> torch.Tensor:
        losses, metrics = self.pop_auxiliary()
        state = self.aux_state
        if state is None or self.inferring_shapes:
            return out
        state.report.add(losses, metrics, state.n_microbatches)
        if not losses or state.factor is None or not torch.is_grad_enabled():
            return out
        term = sum(_local(v).float() for v in losses.values()) * state.factor
        return _AttachAuxiliary.apply(out, term)

    def extra_repr(self) -> str:
        return f"stage={self.stage_index}/{self.n_stages}, layers={list(self.layers.keys())}"


# ---------------------------------------------------------------------------------- the split


def _too_few_layers(n_layers: int, n_stages: int, what: str) -> str:
    return (f"pp: {n_layers} layers cannot be split into {n_stages} pipeline stages ({what}); every stage "
            "needs at least one layer: lower pp, use a single-stage schedule (1F1B, GPipe), or add layers")


def layer_ranges(n_layers: int, n_stages: int, sizes: Sequence[int] | None = None) -> list[range]:
    """Contiguous layer indices per stage: ``sizes`` layers each when given, else split evenly by
    count (earlier stages take the remainder: the last stage also carries the head and the loss)."""
    if n_stages < 1:
        raise ValueError(f"pp: need at least one stage, got {n_stages}")
    if n_layers < n_stages:
        raise ValueError(_too_few_layers(n_layers, n_stages, f"{n_stages} stages requested"))
    if sizes is None:
        base, extra = divmod(n_layers, n_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(n_stages)]
    if len(sizes) != n_stages or sum(sizes) != n_layers or min(sizes) < 1:
        raise ValueError(f"parallel.pp_split: {list(sizes)} must give each of the {n_stages} stages at least "
                         f"one layer and add up to n_layers={n_layers}")
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def _matmul_flops(module: nn.Module) -> float:
    """6 x the matmul parameters a token uses in ``module`` (MoE: its activated experts only)."""
    total = 0.0
    for sub in module.modules():
        if hasattr(sub, "active_matmul_params"):
            return 6.0 * (sub.active_matmul_params() + sum(
                p.numel() for n, p in module.named_parameters() if p.dim() > 1 and not _under(n, module, sub)))
    for p in module.parameters():
        if p.dim() > 1:
            total += p.numel()
    return 6.0 * total


def _under(name: str, root: nn.Module, sub: nn.Module) -> bool:
    prefix = next((n for n, m in root.named_modules() if m is sub), "")
    return bool(prefix) and name.startswith(prefix + ".")


def stage_costs(model: nn.Module, seq_len: int) -> tuple[list[float], float, float]:
    """The cost model of a split, in training FLOPs per token: (each layer, embedding, head).

    A layer: 6 x its matmul parameters (activated experts only) + causal attention (3 x heads x
    (q.k + p.v head dims) x seq_len, forward and backward). The head: 6 x dim x vocab, plus each
    MTP depth (its projection, block and another pass through the head) when MTP is trained. The
    embedding: a gather forward and a scatter-add backward, 2 x dim (no matmul).
    """
    cfg = model.config
    layer_costs = []
    for block in model.layers.values():
        a = block.attention
        qk = getattr(a, "qk_head_dim", getattr(a, "head_dim", cfg.resolved_head_dim))
        heads = getattr(a, "n_heads", cfg.n_heads)
        attn = 3.0 * heads * (qk + getattr(a, "v_head_dim", qk)) * seq_len
        layer_costs.append(_matmul_flops(block) + attn)
    head = 6.0 * cfg.dim * cfg.vocab_size
    mtp = getattr(model, "mtp", None)
    if mtp is not None and getattr(cfg, "mtp_loss_weight", 0) > 0:
        for layer in mtp.values():
            head += _matmul_flops(layer.proj) + _matmul_flops(layer.block) + 6.0 * cfg.dim * cfg.vocab_size
    return layer_costs, 2.0 * cfg.dim, head


def cost_split(layer_costs: Sequence[float], n_stages: int, first_extra: float = 0.0,
               last_extra: float = 0.0) -> list[int]:
    """Layers per stage of the contiguous split minimising the most expensive stage (the pipeline's
    step time), each stage at least one layer; ``first_extra``/``last_extra``: embedding and head."""
    n = len(layer_costs)
    if n < n_stages:
        raise ValueError(_too_few_layers(n, n_stages, f"{n_stages} stages requested"))
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, i: int, j: int) -> float:  # stage s holds layers [i, j)
        return prefix[j] - prefix[i] + (first_extra if s == 0 else 0.0) + (last_extra if s == n_stages - 1 else 0.0)

    inf = float("inf")
    # best[s][j]: the smallest max-cost of stages 0..s holding layers [0, j)
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, n_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                value = max(best[s - 1][i], cost(s, i, j))
                if value < best[s][j]:  # strict: ties keep the earliest cut (more layers later)
                    best[s][j], cut[s][j] = value, i
    sizes, j = [], n
    for s in range(n_stages - 1, 0, -1):
        i = cut[s][j]
        sizes.append(j - i)
        j = i
    sizes.append(j)
    return sizes[::-1]


def parse_split(split: str | Sequence[int]) -> str | list[int]:
    """``"even"``, ``"cost"``, or layers per stage (a list, or a comma-separated string "3,1")."""
    if isinstance(split, str):
        if split.lower() in SPLITS:
            return split.lower()
        try:
            return [int(s) for s in split.split(",")]
        except ValueError:
            raise ValueError(f"parallel.pp_split: {split!r} is not 'even', 'cost' or layers per stage "
                             "(e.g. '3,1')") from None
    return [int(s) for s in split]


def split_sizes(model: nn.Module, n_stages: int, split: str | Sequence[int] = "even",
                seq_len: int | None = None) -> list[int] | None:
    """Layers per stage for ``split`` (None: even by count)."""
    split = parse_split(split)
    if split == "even":
        return None
    if split == "cost":
        layers, emb, head = stage_costs(model, seq_len or model.config.max_seq_len)
        return cost_split(layers, n_stages, emb, head)
    return split


def check_splittable(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    from lockstep.models.common.transformer import Transformer

    if not isinstance(model, Transformer):
        raise ValueError(f"pp: pipeline stages are cut from a Transformer; got {type(model).__name__}")
    own = type(model).forward
    if own is not Transformer.forward and not hasattr(model, "_mtp_predict"):
        raise ValueError(f"pp: {type(model).__name__} has its own forward, which pipeline stages do not "
                         "reproduce (only Transformer's, and DeepSeek-V3's MTP heads, are split)")
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("pp: split the plain model, then shard each stage (parallelize_fn)")


def split_into_stages(model: nn.Module, n_stages: int, stage_ids: Sequence[int] | None = None,
                      sizes: Sequence[int] | None = None) -> list[PipelineStageModule]:
    """Stage modules for ``stage_ids`` (default: all ``n_stages``), each a deep copy of the pieces it keeps.

    TorchTitan's cut: stage ``s`` keeps the ``layers`` keys of its contiguous share (``sizes`` layers
    per stage, default even; the keys stay the model's, "0".."n-1"), the first stage keeps
    ``tok_embeddings``, the last keeps ``norm``, ``output``, any ``mtp`` heads, and a copy of
    ``tok_embeddings`` when MTP needs it or ``output`` is tied to it (shared in that stage as in
    the model). ``model`` itself is left untouched.
    """
    check_splittable(model)
    ranges = layer_ranges(model.config.n_layers, n_stages, sizes)
    ids = list(range(n_stages)) if stage_ids is None else list(stage_ids)
    mtp = getattr(model, "mtp", None)
    stages = []
    for s in ids:
        if not 0 <= s < n_stages:
            raise ValueError(f"pp: stage index {s} is outside 0..{n_stages - 1}")
        memo: dict = {}  # one memo per stage: anything shared inside a stage stays shared (tied weights)

        def keep(module):
            return copy.deepcopy(module, memo) if module is not None else None

        first, last = s == 0, s == n_stages - 1
        embed = first or (last and mtp is not None)
        stages.append(PipelineStageModule(
            model.config,
            tok_embeddings=keep(model.tok_embeddings) if embed else None,
            rope=keep(model.rope),
            layers=nn.ModuleDict({str(i): keep(model.layers[str(i)]) for i in ranges[s]}),
            norm=keep(model.norm) if last else None,
            output=keep(model.output) if last else None,
            mtp=keep(mtp) if last else None,
            stage_index=s, n_stages=n_stages, model_cls=type(model),
        ))
    return stages


def shared_parameter_names(model_config, stage: PipelineStageModule) -> list[str]:
    """Names (in ``stage``) of the parameters one process shares between the first and last stage:
    the embedding on the first stage; on the last, its embedding copy (MTP; the tied head is the
    same parameter there) or the tied head."""
    mtp = bool(getattr(model_config, "n_mtp", 0))
    if not (mtp or model_config.tie_embeddings) or not (stage.is_first or stage.is_last):
        return []
    if stage.is_first or stage.tok_embeddings is not None:
        return ["tok_embeddings.weight"]
    return ["output.weight"]
