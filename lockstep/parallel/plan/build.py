"""The plan of a ``lockstep plan`` dry run: :class:`Plan`, :class:`StagePlan` and :func:`build_plan`.

Memory per rank (the rank with dp/ep/tp index 0 of a stage, which holds the largest shard):
parameters (``--param-dtype``), gradients (``--grad-dtype``), AdamW states (2 fp32 moments, plus an
fp32 master copy when parameters are bf16 unless ``--no-master-weights``), buffers (rope tables,
MoE selection biases: never sharded), the FSDP transient and activations
(:mod:`lockstep.parallel.plan.memory`):

    per block ~ tokens_mb x (sum of saved widths) x bytes / tp     (k = saved bytes / dim is printed)

The last stage adds the logits (``tokens_mb x vocab / tp x (compute + 4 fp32) bytes``); under cp
``tokens_mb`` is the rank's ``seq / cp`` share. A pipeline *rank* (``StagePlan``) holds one stage, or
two under Interleaved1F1B / ZBV / DualPipeV; stage ``s`` of ``n`` keeps the activations of
``min(M, n - s)`` micro-batches (1F1B over the stages), GPipe of all ``M``, no PP of 1. The pipeline
bubble is :func:`pipeline_bubble`. The report shows every pipeline rank and details the worst one
(largest memory), with its collectives (:mod:`lockstep.parallel.plan.collectives`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from torch import nn

from lockstep.config.base import ConfigError

from lockstep.models.common.attention import GroupedQueryAttention as GQA
from lockstep.models.common.moe import MoE
from lockstep.models.common.transformer import build_meta_model
from lockstep.parallel.checkpointing import ActivationCheckpointConfig, as_checkpoint_config, check_save_globs
from lockstep.parallel.plan.collectives import Collective, step_collectives
from lockstep.parallel.plan.report import format_plan
from lockstep.parallel.plan.layout import (AC_MODES, DTYPE_BYTES, SCHEDULES, Layout, ParamPlacement, flag_error,
                                           ffn_is_moe, parse_dtype, place_parameters, stage_layout)
from lockstep.parallel.plan.memory import fsdp_transient_bytes, fsdp_units, block_activation_bytes
from lockstep.parallel.plan.schedule import _microbatches, lockstep_refusal, pipeline_bubble

if TYPE_CHECKING:
    from lockstep.models.common.transformer import TransformerConfig


@dataclasses.dataclass
class StagePlan:
    """Per-rank memory of one pipeline stage (the rank with dp/ep/tp index 0: the largest shard)."""

    stage: int  # the pipeline rank
    layers: list[range]  # the layers of each stage this rank holds
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
        out = {"stage": self.stage, "layers": [[r.start, r.stop] for r in self.layers],
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
    activation_checkpoint: ActivationCheckpointConfig
    pp_schedule: str
    reshard_after_forward: str
    cp_method: str
    bubble: dict[str, Any]
    pp_split: str
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
            if unique and ((p.tp_dim is None and c["tp"]) or p.kind == "embedding_copy"
                           or (c["cp"] and not (p.ep > 1 and self.layout.ep_spans_cp))):
                continue
            total += p.local_numel(_fsdp_index(p, c, self.layout))
        return total

    def rank_param_bytes(self, rank: int) -> int:
        return self.rank_param_numel(rank) * DTYPE_BYTES[self.param_dtype]

    def to_dict(self) -> dict[str, Any]:
        L = self.layout
        return {
            "model": {"family": self.family, "flavor": self.flavor, "params": self.total_params,
                      "active_params_per_token": self.active_params,
                      "param_bytes": self.total_params * DTYPE_BYTES[self.param_dtype]},
            "layout": dataclasses.asdict(L) | {"dp": L.dp, "expert_fsdp": L.expert_fsdp, "ep_spans_cp": L.ep_spans_cp,
                                               "cp_method": self.cp_method},
            "batch": {"seq_len": self.seq_len, "global_batch": self.batch_size,
                      "tokens_per_step": self.batch_size * self.seq_len,
                      "per_dp_rank": self.batch_size // L.dp, "microbatches": self.microbatches,
                      "microbatch_size": self.microbatch_size, "pp_schedule": self.pp_schedule,
                      "pipeline_bubble": self.bubble},
            "dtypes": {"param": self.param_dtype, "grad": self.grad_dtype, "compute": self.compute_dtype,
                       "optimizer_bytes_per_param": self.optimizer_bytes_per_param,
                       "master_weights": self.master_weights and self.param_dtype == "bf16"},
            "activation_checkpoint": {"mode": self.activation_checkpoint.mode,
                                      "save": list(self.activation_checkpoint.save)},
            "reshard_after_forward": self.reshard_after_forward,
            "activation_k_bytes_per_token_per_dim": self.activation_k,
            "stages": [s.to_dict(with_collectives=False) for s in self.stages],
            "worst_stage": self.worst.to_dict(),
            "notes": self.notes,
            "verify_fsdp": self.verify,
        }

    def format(self) -> str:
        return format_plan(self)


def _fsdp_index(p: ParamPlacement, coords: dict[str, int], layout: Layout) -> int:
    """The FSDP index of the rank at ``coords`` for parameter ``p``."""
    if p.ep > 1:
        return 0 if layout.ep_spans_cp else coords["dp_shard_mod_ep"]
    return coords["dp_shard"]


def _validate_model(model: nn.Module, layout: Layout, seq_len: int) -> None:
    cfg = model.config
    n_layers = len(model.layers)
    if layout.pp > n_layers:
        flag_error("--pp", f"{layout.pp} stages need at least one layer each; the model has {n_layers} layers")
    if layout.tp > 1:
        att = model.layers[next(iter(model.layers))].attention
        heads = [("model.n_heads", cfg.n_heads)]
        if isinstance(att, GQA):
            heads.append(("model.n_kv_heads", cfg.n_kv_heads))
        heads.append(("model.vocab_size", cfg.vocab_size))
        for name, value in heads:
            if value % layout.tp:
                flag_error("--tp", f"{layout.tp} does not divide {name}={value}")
        if seq_len % (layout.tp * layout.cp):
            flag_error("--tp", f"{layout.tp} does not divide --seq-len={seq_len} / cp={layout.cp} "
                       "(sequence parallel splits the sequence)")
    if layout.cp > 1:
        from lockstep.parallel.context import refuse_unsupported_mixers  # the trainer's own refusal

        try:
            refuse_unsupported_mixers(model)
        except ConfigError as err:
            flag_error("--cp", str(err))
    if layout.cp > 1 and seq_len % (2 * layout.cp):
        flag_error("--cp", f"--seq-len={seq_len} must be divisible by 2 x cp = {2 * layout.cp} "
                   "(causal load balancing: chunks r and 2cp-1-r)")
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if layout.ep > 1:
        if not moes:
            flag_error("--ep", f"{layout.ep} > 1 but {cfg.family} {cfg.flavor} has no routed experts")
        for m in moes:
            if m.n_experts % layout.ep:
                flag_error("--ep", f"{layout.ep} does not divide n_routed_experts={m.n_experts}")


def build_plan(config: TransformerConfig, layout: Layout, *, seq_len: int, batch_size: int | None = None,
               microbatches: int | None = None, param_dtype: str = "fp32", grad_dtype: str = "fp32",
               compute_dtype: str | None = None, master_weights: bool = True,
               activation_checkpoint: ActivationCheckpointConfig | str = "none",
               pp_schedule: str = "1F1B", reshard_after_forward: str = "always", pp_split: str = "even",
               cp_method: str = "allgather", model: nn.Module | None = None) -> Plan:
    """Size ``config`` (a TransformerConfig) under ``layout``; ``batch_size`` is global sequences per
    optimizer step (default: one sequence per micro-batch per data-parallel rank). Pass ``model`` (a
    meta build of ``config``) to reuse one. Raises ConfigError naming the flag that is wrong."""
    layout = layout.resolve()
    param_dtype, grad_dtype = parse_dtype(param_dtype, "--param-dtype"), parse_dtype(grad_dtype, "--grad-dtype")
    compute_dtype = parse_dtype(compute_dtype or param_dtype, "--compute-dtype")
    if isinstance(activation_checkpoint, str) and activation_checkpoint not in AC_MODES:
        flag_error("--activation-checkpoint", f"must be one of {list(AC_MODES)}, got {activation_checkpoint!r}")
    activation_checkpoint = as_checkpoint_config(activation_checkpoint)
    # regions keep what their save globs name (measured by tests/parallel/test_remat_regions.py, not
    # modelled here): sized as "none", an upper bound
    ac_mode = "none" if activation_checkpoint.mode == "regions" else activation_checkpoint.mode
    if pp_schedule not in SCHEDULES:
        flag_error("--pp-schedule", f"must be one of {list(SCHEDULES)}, got {pp_schedule!r}")
    if cp_method not in ("allgather", "ring"):
        flag_error("--cp-method", f"must be allgather or ring, got {cp_method!r}")
    if reshard_after_forward not in ("always", "never"):
        flag_error("--reshard-after-forward", f"must be always or never, got {reshard_after_forward!r}")
    if seq_len < 1:
        flag_error("--seq-len", f"must be >= 1, got {seq_len}")
    if seq_len > config.max_seq_len:
        flag_error("--seq-len", f"{seq_len} exceeds model.max_seq_len={config.max_seq_len}")
    if batch_size is None:
        from lockstep.parallel.pipeline import stages_per_rank

        default_m = layout.pp * stages_per_rank(pp_schedule) if layout.pp > 1 else 1
        batch_size = layout.dp * (microbatches or default_m)
    if batch_size < 1 or batch_size % layout.dp:
        flag_error("--batch-size", f"{batch_size} is not a positive multiple of the {layout.dp} data-parallel ranks "
                   f"(dp_replicate={layout.dp_replicate} x dp_shard={layout.dp_shard})")
    model = build_meta_model(config) if model is None else model
    m_count = _microbatches(layout, batch_size, microbatches, pp_schedule, len(model.layers))
    mb = batch_size // layout.dp // m_count
    _validate_model(model, layout, seq_len)
    check_save_globs(model, activation_checkpoint)
    params, ranges, notes = place_parameters(model, layout, pp_schedule, pp_split, seq_len)
    _, rank_stages = stage_layout(model, layout, pp_schedule, pp_split, seq_len)
    n_stages = len(ranges)
    total = sum(p.numel for p in params if p.kind != "embedding_copy")
    active = None
    if any(hasattr(m, "active_matmul_params") for m in model.modules()):
        active = total - sum(sum(p.numel() for p in m.parameters()) - m.active_matmul_params()
                             for m in model.modules() if hasattr(m, "active_matmul_params"))

    pb, gb, cb = DTYPE_BYTES[param_dtype], DTYPE_BYTES[grad_dtype], DTYPE_BYTES[compute_dtype]
    opt_per = 8 + (4 if master_weights and param_dtype == "bf16" else 0)
    dim, tp = config.dim, layout.tp
    tokens = mb * seq_len // layout.cp  # the rank's share of a micro-batch
    settings = dict(layout=layout, tokens=tokens, cb=cb, gb=gb, M=m_count, schedule=pp_schedule,
                    reshard=reshard_after_forward == "always", cp_method=cp_method, rank_stages=rank_stages,
                    n_stages=n_stages, all_params=params)

    # activations per block kind (bytes per token, before / tp)
    block_kinds: dict[str, tuple[float, float]] = {}
    k_report: dict[str, float] = {}
    blocks = {f"layers.{k}": b for k, b in model.layers.items()}
    if getattr(model, "mtp", None) is not None:
        blocks.update({f"mtp.{k}.block": m.block for k, m in model.mtp.items()})
    for name, block in blocks.items():
        saved, transient = block_activation_bytes(block, dim, cb, ac_mode)
        block_kinds[name] = (saved, transient)
        kind = "moe" if ffn_is_moe(block) else "dense"
        k_report.setdefault(f"{kind}_block", round(saved / dim, 2))
        if ac_mode == "full":
            k_report.setdefault(f"{kind}_block_recompute", round(transient / dim, 2))
    vocab = config.vocab_size
    head_bytes = 2 * dim * cb + vocab * (cb + 4)  # final norm in/out, logits + fp32 log-softmax
    k_report["head"] = round(head_bytes / dim, 2)

    buffers: dict[int, float] = {s: 0.0 for s in range(layout.pp)}
    for name, buf in model.named_buffers():
        nb = buf.numel() * buf.element_size()
        parts = name.split(".")
        if parts[0] == "layers":
            vs = next(s for s, r in enumerate(ranges) if list(model.layers).index(parts[1]) in r)
            stages = [next(rank for rank, ids in enumerate(rank_stages) if vs in ids)]
        elif parts[0] == "mtp":
            stages = [next(rank for rank, ids in enumerate(rank_stages) if n_stages - 1 in ids)]
        else:  # rope tables and anything model-wide: every stage
            stages = list(range(layout.pp))
        for s in stages:
            buffers[s] += nb

    layer_keys = list(model.layers.keys())
    stages: list[StagePlan] = []
    has_mtp = getattr(model, "mtp", None) is not None
    for s, ids in enumerate(rank_stages):
        sp = [p for p in params if p.stage == s]
        padded = sum(p.padded_numel for p in sp)
        exact = sum(p.local_numel(0) for p in sp)
        saved_total, transient, in_flight, names = 0.0, 0.0, 0, []
        for vs in ids:
            stage_names = [f"layers.{layer_keys[i]}" for i in ranges[vs]]
            if vs == n_stages - 1 and has_mtp:
                stage_names += [f"mtp.{k}.block" for k in model.mtp]
            saved = sum(block_kinds[n][0] for n in stage_names)
            if vs == n_stages - 1:
                n_heads_out = 1 + (len(model.mtp) if has_mtp else 0)
                saved += n_heads_out * head_bytes + (n_heads_out - 1) * 5 * dim * cb  # MTP: norms, concat, proj
            if layout.pp == 1:
                flight = 1
            elif pp_schedule == "GPipe":
                flight = m_count
            else:
                flight = min(m_count, n_stages - vs)
            saved_total += flight * saved
            in_flight = max(in_flight, flight)
            transient = max([transient] + [block_kinds[n][1] for n in stage_names])
            names += stage_names
        act = tokens * (saved_total + transient) / tp
        units = fsdp_units(sp, pb, gb, cb)
        transient_fsdp = fsdp_transient_bytes(units, reshard_after_forward == "always")
        stage = StagePlan(stage=s, layers=[ranges[vs] for vs in ids], params=sp, param_numel=padded,
                          param_numel_exact=exact, param_bytes=padded * pb, grad_bytes=padded * gb,
                          optimizer_bytes=padded * opt_per, buffer_bytes=buffers[s], activation_bytes=act,
                          fsdp_transient_bytes=transient_fsdp, in_flight_microbatches=in_flight, units=units)
        stage.collectives = step_collectives(stage, model, names, settings)
        stages.append(stage)

    if layout.pp > 1 and (has_mtp or config.tie_embeddings) and rank_stages[-1] != rank_stages[0]:
        notes.append("the last stage keeps a copy of the token embedding (" + ("MTP heads" if has_mtp else "tied head")
                     + "); its gradient is all-reduced with the first stage's once per step, as the runner's "
                     "reduce_shared_grads")
    if layout.pp > 1 and layout.dp_shard > 1:
        notes.append("FSDP all-gathers are counted per micro-batch, forward and backward (an upper bound under "
                     "PP, where torch.distributed.pipelining keeps parameters gathered between backward "
                     "micro-batches); reduce-scatters once per step")
    if len({len(r) for r in ranges}) > 1:
        notes.append(f"{len(layer_keys)} layers over {n_stages} stages ({pp_split} split): stages hold "
                     f"{[len(r) for r in ranges]} layers")
    bubble = pipeline_bubble(pp_schedule, layout.pp, m_count)
    if layout.pp > 1:
        notes.append(f"pipeline bubble {100 * bubble['fraction']:.1f}% of the step ({pp_schedule}: {bubble['formula']}; "
                     f"{bubble['assumes']}); memory and traffic above do not include it")
    if layout.cp > 1:
        notes.append(f"cp={layout.cp} ({cp_method}): parameters replicated over cp, their gradients all-reduced "
                     "over cp once per step" + (" (experts excluded: ep spans cp)" if layout.ep_spans_cp else "")
                     + "; activations are each rank's seq/cp tokens")
    waste = sum(p.padded_numel * p.fsdp - math.prod(p.pre_fsdp_shape()) for p in params
                if p.fsdp > 1 and p.kind != "embedding_copy")
    if waste > 0.01 * total / max(1, layout.tp):
        notes.append(f"FSDP padding: {waste / 1e6:.1f}M padded elements per shard group (dims not divisible "
                     "by the FSDP degree)")
    if layout.tp > 1 and any(p.kind in ("experts", "router") for p in params):
        notes.append("MoE under tp: router replicated, routed and shared experts split on their hidden dim "
                     "(expert TP = tp, lockstep.parallel.tp_blocks)")
    if activation_checkpoint.mode == "regions":
        notes.append(f"activation checkpointing {activation_checkpoint.describe()}: activations sized as mode "
                     "'none' (an upper bound; what the save globs keep is measured, not modelled)")
    if layout.ep > 1:
        notes.append("EP all-to-all traffic assumes uniform routing (each rank's tokens x top_k spread evenly)")
    refusal = lockstep_refusal(layout, pp_schedule, cp_method)
    if refusal:
        notes.append(f"lockstep's trainer refuses this layout today: {refusal}")
    return Plan(family=config.family, flavor=config.flavor, layout=layout, seq_len=seq_len, batch_size=batch_size,
                microbatches=m_count, microbatch_size=mb, param_dtype=param_dtype, grad_dtype=grad_dtype,
                compute_dtype=compute_dtype, master_weights=master_weights, activation_checkpoint=activation_checkpoint,
                pp_schedule=pp_schedule, reshard_after_forward=reshard_after_forward, cp_method=cp_method,
                bubble=bubble, pp_split=pp_split, total_params=total,
                active_params=active, params=params, stages=stages, activation_k=k_report, notes=notes)

