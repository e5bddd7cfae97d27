"""The plan of a ``lockstep plan`` dry run: :class:`Plan`, :class:`StagePlan` and :func:`build_plan`.

Memory per rank (the rank with dp/ep/tp index 0 of a stage, which holds the largest shard):
parameters (``--param-dtype``), gradients (``--grad-dtype``), AdamW states (2 fp32 moments, plus an
fp32 master copy when parameters are bf16 unless ``--no-master-weights``), buffers (rope tables,
MoE selection biases: never sharded), the FSDP transient and activations
(:mod:`lockstep.parallel.plan.memory`):

    per block ~ tokens_mb x (sum of saved widths) x bytes / tp     (k = saved bytes / dim is printed)

The last stage adds the logits (``tokens_mb x vocab / tp x (compute + 4 fp32) bytes``). A stage
holds the activations of the micro-batches in flight: 1 without PP, ``min(M, pp - stage)`` for
1F1B, ``M`` for GPipe. The report shows every stage and details the worst one (largest memory),
with its collectives (:mod:`lockstep.parallel.plan.collectives`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from torch import nn

from lockstep.models.common.attention import GroupedQueryAttention as GQA
from lockstep.models.common.moe import MoE
from lockstep.models.common.transformer import build_meta_model
from lockstep.parallel.plan.collectives import Collective, step_collectives
from lockstep.parallel.plan.report import format_plan
from lockstep.parallel.plan.layout import (AC_MODES, DTYPE_BYTES, SCHEDULES, Layout, ParamPlacement, flag_error,
                                           ffn_is_moe, parse_dtype, place_parameters)
from lockstep.parallel.plan.memory import fsdp_transient_bytes, fsdp_units, block_activation_bytes

if TYPE_CHECKING:
    from lockstep.models.common.transformer import TransformerConfig


@dataclasses.dataclass
class StagePlan:
    """Per-rank memory of one pipeline stage (the rank with dp/ep/tp index 0: the largest shard)."""

    stage: int
    layers: range
    params: list[ParamPlacement]
    param_numel: int  # padded local elements
    param_numel_exact: int  # exact local elements of the index-0 rank
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    buffer_bytes: float
    activation_bytes: float
    fsdp_transient_bytes: float
    in_flight_microbatches: int
    units: dict[str, dict[str, Any]]
    collectives: list[Collective] = dataclasses.field(default_factory=list)

    @property
    def total_bytes(self) -> float:
        return (self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.buffer_bytes
                + self.activation_bytes + self.fsdp_transient_bytes)

    @property
    def traffic_per_step(self) -> float:
        return sum(c.traffic_per_step for c in self.collectives)

    def to_dict(self, with_collectives: bool = True) -> dict[str, Any]:
        out = {"stage": self.stage, "layers": [self.layers.start, self.layers.stop],
               "n_params": len(self.params), "param_numel_padded": self.param_numel,
               "param_numel_exact": self.param_numel_exact, "param_bytes": self.param_bytes,
               "grad_bytes": self.grad_bytes, "optimizer_bytes": self.optimizer_bytes,
               "buffer_bytes": self.buffer_bytes, "activation_bytes": self.activation_bytes,
               "fsdp_transient_bytes": self.fsdp_transient_bytes,
               "in_flight_microbatches": self.in_flight_microbatches, "total_bytes": self.total_bytes,
               "traffic_bytes_per_step": self.traffic_per_step}
        if with_collectives:
            out["fsdp_units"] = self.units
            out["collectives"] = [c.to_dict() for c in self.collectives]
        return out


@dataclasses.dataclass
class Plan:
    family: str
    flavor: str
    layout: Layout
    seq_len: int
    batch_size: int
    microbatches: int
    microbatch_size: int
    param_dtype: str
    grad_dtype: str
    compute_dtype: str
    master_weights: bool
    activation_checkpoint: str
    pp_schedule: str
    reshard_after_forward: str
    total_params: int
    active_params: int | None
    params: list[ParamPlacement]
    stages: list[StagePlan]
    activation_k: dict[str, float]
    notes: list[str]
    verify: dict[str, Any] | None = None

    @property
    def worst(self) -> StagePlan:
        return max(self.stages, key=lambda s: s.total_bytes)

    @property
    def optimizer_bytes_per_param(self) -> int:
        return 8 + (4 if self.master_weights and self.param_dtype == "bf16" else 0)

    def rank_param_numel(self, rank: int, unique: bool = False) -> int:
        """Exact parameter elements global rank ``rank`` holds (unpadded FSDP pieces).

        ``unique``: count each element once over the world -- copies of TP-replicated parameters
        only on tp index 0, and nothing on HSDP replicas other than the first -- so the sum over all
        ranks is the model's parameter count.
        """
        c = self.layout.coords(rank)
        if unique and c["dp_replicate"]:
            return 0
        total = 0
        for p in self.stages[c["pp"]].params:
            if unique and p.tp_dim is None and c["tp"]:
                continue
            total += p.local_numel(c["dp_shard_mod_ep"] if p.ep > 1 else c["dp_shard"])
        return total

    def rank_param_bytes(self, rank: int) -> int:
        return self.rank_param_numel(rank) * DTYPE_BYTES[self.param_dtype]

    def to_dict(self) -> dict[str, Any]:
        L = self.layout
        return {
            "model": {"family": self.family, "flavor": self.flavor, "params": self.total_params,
                      "active_params_per_token": self.active_params,
                      "param_bytes": self.total_params * DTYPE_BYTES[self.param_dtype]},
            "layout": dataclasses.asdict(L) | {"dp": L.dp, "expert_fsdp": L.expert_fsdp},
            "batch": {"seq_len": self.seq_len, "global_batch": self.batch_size,
                      "tokens_per_step": self.batch_size * self.seq_len,
                      "per_dp_rank": self.batch_size // L.dp, "microbatches": self.microbatches,
                      "microbatch_size": self.microbatch_size, "pp_schedule": self.pp_schedule},
            "dtypes": {"param": self.param_dtype, "grad": self.grad_dtype, "compute": self.compute_dtype,
                       "optimizer_bytes_per_param": self.optimizer_bytes_per_param,
                       "master_weights": self.master_weights and self.param_dtype == "bf16"},
            "activation_checkpoint": self.activation_checkpoint,
            "reshard_after_forward": self.reshard_after_forward,
            "activation_k_bytes_per_token_per_dim": self.activation_k,
            "stages": [s.to_dict(with_collectives=False) for s in self.stages],
            "worst_stage": self.worst.to_dict(),
            "notes": self.notes,
            "verify_fsdp": self.verify,
        }

    def format(self) -> str:
        return format_plan(self)


def _microbatches(layout: Layout, batch: int, microbatches: int | None, schedule: str) -> int:
    local = batch // layout.dp
    if microbatches is None:
        if layout.pp == 1:
            return 1
        if local % layout.pp == 0:
            return layout.pp
        if local >= layout.pp or schedule == "GPipe":
            return local
        flag_error("--batch-size", f"{batch} gives {local} sequence(s) per data-parallel rank, fewer than the "
                   f"pp={layout.pp} micro-batches 1F1B needs: use at least {layout.pp * layout.dp}")
    if microbatches < 1:
        flag_error("--microbatches", f"must be >= 1, got {microbatches}")
    if local % microbatches:
        flag_error("--microbatches", f"{microbatches} does not divide the {local} sequences per data-parallel rank")
    if schedule == "1F1B" and layout.pp > 1 and microbatches < layout.pp:
        flag_error("--microbatches", f"1F1B needs at least pp={layout.pp} micro-batches, got {microbatches}")
    return microbatches


def _validate_model(model: nn.Module, layout: Layout, seq_len: int) -> None:
    cfg = model.config
    n_layers = len(model.layers)
    if layout.pp > n_layers:
        flag_error("--pp", f"{layout.pp} stages need at least one layer each; the model has {n_layers} layers")
    if layout.pp > 1 and cfg.tie_embeddings:
        flag_error("--pp", "tied embeddings (model.tie_embeddings) put one weight on the first and the last stage; "
                   "lockstep's pipeline refuses them: untie them or use pp=1")
    if layout.tp > 1:
        att = model.layers[next(iter(model.layers))].attention
        heads = [("model.n_heads", cfg.n_heads)]
        if isinstance(att, GQA):
            heads.append(("model.n_kv_heads", cfg.n_kv_heads))
        heads.append(("model.vocab_size", cfg.vocab_size))
        for name, value in heads:
            if value % layout.tp:
                flag_error("--tp", f"{layout.tp} does not divide {name}={value}")
        if seq_len % layout.tp:
            flag_error("--tp", f"{layout.tp} does not divide --seq-len={seq_len} "
                       "(sequence parallel splits the sequence)")
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if layout.ep > 1:
        if not moes:
            flag_error("--ep", f"{layout.ep} > 1 but {cfg.family} {cfg.flavor} has no routed experts")
        for m in moes:
            if m.n_experts % layout.ep:
                flag_error("--ep", f"{layout.ep} does not divide n_routed_experts={m.n_experts}")


def build_plan(config: TransformerConfig, layout: Layout, *, seq_len: int, batch_size: int | None = None,
               microbatches: int | None = None, param_dtype: str = "fp32", grad_dtype: str = "fp32",
               compute_dtype: str | None = None, master_weights: bool = True, activation_checkpoint: str = "none",
               pp_schedule: str = "1F1B", reshard_after_forward: str = "always",
               model: nn.Module | None = None) -> Plan:
    """Size ``config`` (a TransformerConfig) under ``layout``; ``batch_size`` is global sequences per
    optimizer step (default: one sequence per micro-batch per data-parallel rank). Pass ``model`` (a
    meta build of ``config``) to reuse one. Raises ConfigError naming the flag that is wrong."""
    layout = layout.resolve()
    param_dtype, grad_dtype = parse_dtype(param_dtype, "--param-dtype"), parse_dtype(grad_dtype, "--grad-dtype")
    compute_dtype = parse_dtype(compute_dtype or param_dtype, "--compute-dtype")
    if activation_checkpoint not in AC_MODES:
        flag_error("--activation-checkpoint", f"must be one of {list(AC_MODES)}, got {activation_checkpoint!r}")
    if pp_schedule not in SCHEDULES:
        flag_error("--pp-schedule", f"must be one of {list(SCHEDULES)} (single-stage-per-rank schedules), "
                   f"got {pp_schedule!r}")
    if reshard_after_forward not in ("always", "never"):
        flag_error("--reshard-after-forward", f"must be always or never, got {reshard_after_forward!r}")
    if seq_len < 1:
        flag_error("--seq-len", f"must be >= 1, got {seq_len}")
    if seq_len > config.max_seq_len:
        flag_error("--seq-len", f"{seq_len} exceeds model.max_seq_len={config.max_seq_len}")
    if batch_size is None:
        batch_size = layout.dp * (microbatches or (layout.pp if layout.pp > 1 else 1))
    if batch_size < 1 or batch_size % layout.dp:
        flag_error("--batch-size", f"{batch_size} is not a positive multiple of the {layout.dp} data-parallel ranks "
                   f"(dp_replicate={layout.dp_replicate} x dp_shard={layout.dp_shard})")
    m_count = _microbatches(layout, batch_size, microbatches, pp_schedule)
    mb = batch_size // layout.dp // m_count

    model = build_meta_model(config) if model is None else model
    _validate_model(model, layout, seq_len)
    params, ranges, notes = place_parameters(model, layout)
    total = sum(p.numel for p in params)
    active = None
    if any(hasattr(m, "active_matmul_params") for m in model.modules()):
        active = total - sum(sum(p.numel() for p in m.parameters()) - m.active_matmul_params()
                             for m in model.modules() if hasattr(m, "active_matmul_params"))

    pb, gb, cb = DTYPE_BYTES[param_dtype], DTYPE_BYTES[grad_dtype], DTYPE_BYTES[compute_dtype]
    opt_per = 8 + (4 if master_weights and param_dtype == "bf16" else 0)
    dim, tp = config.dim, layout.tp
    tokens = mb * seq_len
    settings = dict(layout=layout, tokens=tokens, cb=cb, gb=gb, M=m_count, schedule=pp_schedule,
                    reshard=reshard_after_forward == "always")

    # activations per block kind (bytes per token, before / tp)
    block_kinds: dict[str, tuple[float, float]] = {}
    k_report: dict[str, float] = {}
    blocks = {f"layers.{k}": b for k, b in model.layers.items()}
    if getattr(model, "mtp", None) is not None:
        blocks.update({f"mtp.{k}.block": m.block for k, m in model.mtp.items()})
    for name, block in blocks.items():
        saved, transient = block_activation_bytes(block, dim, cb, activation_checkpoint)
        block_kinds[name] = (saved, transient)
        kind = "moe" if ffn_is_moe(block) else "dense"
        k_report.setdefault(f"{kind}_block", round(saved / dim, 2))
        if activation_checkpoint == "full":
            k_report.setdefault(f"{kind}_block_recompute", round(transient / dim, 2))
    vocab = config.vocab_size
    head_bytes = 2 * dim * cb + vocab * (cb + 4)  # final norm in/out, logits + fp32 log-softmax
    k_report["head"] = round(head_bytes / dim, 2)

    buffers: dict[int, float] = {s: 0.0 for s in range(layout.pp)}
    for name, buf in model.named_buffers():
        nb = buf.numel() * buf.element_size()
        parts = name.split(".")
        if parts[0] == "layers":
            stages = [next(s for s, r in enumerate(ranges) if list(model.layers).index(parts[1]) in r)]
        elif parts[0] == "mtp":
            stages = [layout.pp - 1]
        else:  # rope tables and anything model-wide: every stage
            stages = list(range(layout.pp))
        for s in stages:
            buffers[s] += nb

    layer_keys = list(model.layers.keys())
    stages: list[StagePlan] = []
    for s, r in enumerate(ranges):
        sp = [p for p in params if p.stage == s]
        padded = sum(p.padded_numel for p in sp)
        exact = sum(p.local_numel(0) for p in sp)
        if layout.pp == 1:
            in_flight = 1
        elif pp_schedule == "GPipe":
            in_flight = m_count
        else:
            in_flight = min(m_count, layout.pp - s)
        names = [f"layers.{layer_keys[i]}" for i in r]
        if s == layout.pp - 1 and getattr(model, "mtp", None) is not None:
            names += [f"mtp.{k}.block" for k in model.mtp]
        saved = sum(block_kinds[n][0] for n in names)
        transient = max((block_kinds[n][1] for n in names), default=0.0)
        if s == layout.pp - 1:
            n_heads_out = 1 + (len(model.mtp) if getattr(model, "mtp", None) is not None else 0)
            saved += n_heads_out * head_bytes + (n_heads_out - 1) * 5 * dim * cb  # MTP: norms, concat, proj
        act = tokens * (in_flight * saved + transient) / tp
        units = fsdp_units(sp, pb, gb, cb)
        transient_fsdp = fsdp_transient_bytes(units, reshard_after_forward == "always")
        stage = StagePlan(stage=s, layers=r, params=sp, param_numel=padded, param_numel_exact=exact,
                          param_bytes=padded * pb, grad_bytes=padded * gb, optimizer_bytes=padded * opt_per,
                          buffer_bytes=buffers[s], activation_bytes=act, fsdp_transient_bytes=transient_fsdp,
                          in_flight_microbatches=in_flight, units=units)
        stage.collectives = step_collectives(stage, model, names, settings)
        stages.append(stage)

    if layout.pp > 1 and getattr(model, "mtp", None) is not None:
        notes.append("MTP modules sit on the last stage; lockstep's pipeline does not run MTP yet, and a "
                     "pipelined MTP needs the token embeddings sent from stage 0 (counted as a send/recv)")
    if layout.pp > 1 and layout.dp_shard > 1:
        notes.append("FSDP all-gathers are counted per micro-batch, forward and backward (an upper bound under "
                     "PP, where torch.distributed.pipelining keeps parameters gathered between backward "
                     "micro-batches); reduce-scatters once per step")
    if len({len(r) for r in ranges}) > 1:
        notes.append(f"{len(layer_keys)} layers do not split evenly over pp={layout.pp}: stages hold "
                     f"{[len(r) for r in ranges]} layers")
    waste = sum(p.padded_numel * p.fsdp - math.prod(p.pre_fsdp_shape()) for p in params if p.fsdp > 1)
    if waste > 0.01 * total / max(1, layout.tp):
        notes.append(f"FSDP padding: {waste / 1e6:.1f}M padded elements per shard group (dims not divisible "
                     "by the FSDP degree)")
    if layout.tp > 1 and any(p.kind in ("experts", "router") for p in params):
        notes.append("lockstep's parallelize_dense has no TP plan for MoE/MLA blocks yet (it refuses them); "
                     "this sizes the torchtitan-style plan (expert TP = tp)")
    if layout.ep > 1:
        notes.append("EP is sized as torchtitan's (ep borrowed from dp_shard, experts FSDP over dp_shard/ep, "
                     "expert TP = tp); lockstep's own EP covers part of that: --verify-fsdp says which path ran")
    return Plan(family=config.family, flavor=config.flavor, layout=layout, seq_len=seq_len, batch_size=batch_size,
                microbatches=m_count, microbatch_size=mb, param_dtype=param_dtype, grad_dtype=grad_dtype,
                compute_dtype=compute_dtype, master_weights=master_weights, activation_checkpoint=activation_checkpoint,
                pp_schedule=pp_schedule, reshard_after_forward=reshard_after_forward, total_params=total,
                active_params=active, params=params, stages=stages, activation_k=k_report, notes=notes)
