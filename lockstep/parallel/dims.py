"""Parallel degrees from the recipe, validated against the world size, and the device mesh.

Degrees: ``dp_replicate`` (HSDP replicas), ``dp_shard`` (FSDP shards; -1 = whatever is left),
``tp`` (tensor + sequence parallel). Their product is the world size. A world of 1 goes through the
same code with no mesh dims and no wrapping.
"""

from __future__ import annotations

import dataclasses

from lockstep.config.base import Config, ConfigError, require, require_choice


@dataclasses.dataclass(kw_only=True)
class ParallelConfig(Config):
    """How the job is split across processes."""

    #: data-parallel replicas (HSDP outer dim; gradients all-reduced across it)
    dp_replicate: int = 1
    #: data-parallel shards (FSDP2); -1 uses every rank not taken by the other degrees
    dp_shard: int = -1
    #: tensor-parallel degree (with sequence parallel and loss-parallel cross-entropy)
    tp: int = 1
    #: expert-parallel degree for MoE layers, taken from the dp_shard ranks (any divisor of dp_shard;
    #: routed experts split over ep, FSDP-sharded over the other dp_shard / ep, replicated over dp_replicate)
    ep: int = 1
    #: expert-parallel routed experts: 0 = synchronous uneven all-to-alls (ExpertParallelExperts);
    #: N >= 1 = the Dist-MoE operation (lockstep.parallel.dist_moe): exact-split dispatch, grouped experts,
    #: combine in N chunks whose exchanges overlap the experts (1 = the same operation, no overlap)
    ep_chunks: int = 0
    #: Dist-MoE capacity per (source rank, expert, chunk): 0 = no-drop (every assignment kept);
    #: f > 0 = ceil(f * chunk_tokens * top_k / n_experts), later tokens dropped and counted
    ep_capacity_factor: float = 0.0
    #: context-parallel degree: each sequence is sharded over cp ranks (causal load balancing)
    cp: int = 1
    #: context-parallel attention exchange: "allgather" (K/V gathered per layer) or "ring"
    cp_method: str = "allgather"
    #: pipeline-parallel degree (layers split into stages by count)
    pp: int = 1
    #: pipeline schedule: "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV" or "GPipe"
    pp_schedule: str = "1F1B"
    #: micro-batches per pipeline step; 0 uses the number of stages
    pp_microbatches: int = 0
    #: layers per pipeline stage: "even" (by count), "cost" (balance a FLOP model of layers, embedding
    #: and head, MTP included), or layers per stage, e.g. "3,1"
    pp_split: str = "even"
    #: FSDP mixed precision: parameter dtype in compute ("float32" or "bfloat16")
    fsdp_param_dtype: str = "float32"
    #: FSDP: free gathered parameters after forward ("always", "never", "except_last")
    reshard_after_forward: str = "always"
    #: data-parallel sharding: "fsdp2" (FSDP2 row shards) or "flex" (FlexShard: per-bucket placements,
    #: lockstep.parallel.flex; dp_shard / dp_replicate only)
    sharding: str = "fsdp2"
    #: sharding "flex": buckets "GLOB[|GLOB...]=PLACEMENT[+fp8][@MESH_DIM]", placement shard(D), owned or
    #: block_shard(D,B), e.g. "layers.*.attention.w[qkv].weight=block_shard(0,16)"; every parameter in
    #: exactly one bucket; empty = one bucket of everything with shard(0)
    flex_buckets: list[str] = dataclasses.field(default_factory=list)
    #: sharding "flex": "" (flex_buckets) or "muon" (hidden matrices owned, attention q/k/v
    #: block_shard(0, head_dim), the rest shard(0): distributed Muon without gathers)
    flex_preset: str = ""

    def validate(self, path: str = "parallel") -> None:
        require(self.dp_replicate >= 1, f"{path}.dp_replicate", f"must be >= 1, got {self.dp_replicate}")
        require(self.dp_shard == -1 or self.dp_shard >= 1, f"{path}.dp_shard",
                f"must be >= 1 or -1 (auto), got {self.dp_shard}")
        require(self.tp >= 1, f"{path}.tp", f"must be >= 1, got {self.tp}")
        require(self.ep >= 1, f"{path}.ep", f"must be >= 1, got {self.ep}")
        require(self.ep_chunks >= 0, f"{path}.ep_chunks", f"must be >= 0, got {self.ep_chunks}")
        require(self.ep_capacity_factor >= 0, f"{path}.ep_capacity_factor",
                f"must be >= 0, got {self.ep_capacity_factor}")
        require(self.ep_chunks == 0 or self.tp == 1, f"{path}.ep_chunks",
                f"the Dist-MoE operation does not support expert tensor parallelism (tp={self.tp}); use 0")
        require(self.ep_chunks == 0 or (self.pp == 1 and self.cp == 1), f"{path}.ep_chunks",
                f"the Dist-MoE operation is not tested with pp={self.pp}, cp={self.cp} yet; use 0")
        require(self.pp >= 1, f"{path}.pp", f"must be >= 1, got {self.pp}")
        require(self.cp >= 1, f"{path}.cp", f"must be >= 1, got {self.cp}")
        require_choice(self.cp_method, ["allgather", "ring"], f"{path}.cp_method")
        from lockstep.parallel.pipeline_stage import parse_split

        try:
            parse_split(self.pp_split)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        require(self.pp_microbatches >= 0, f"{path}.pp_microbatches", f"must be >= 0, got {self.pp_microbatches}")
        require_choice(self.fsdp_param_dtype, ["float32", "bfloat16"], f"{path}.fsdp_param_dtype")
        require_choice(self.reshard_after_forward, ["always", "never", "except_last"],
                       f"{path}.reshard_after_forward")
        self._validate_flex(path)

    def _validate_flex(self, path: str) -> None:
        require_choice(self.sharding, ["fsdp2", "flex"], f"{path}.sharding")
        require_choice(self.flex_preset, ["", "muon"], f"{path}.flex_preset")
        if self.sharding != "flex":
            require(not self.flex_buckets and not self.flex_preset, f"{path}.sharding",
                    f"flex_buckets / flex_preset need sharding='flex', got {self.sharding!r}")
            return
        for name in ("tp", "ep", "cp", "pp"):
            require(getattr(self, name) == 1, f"{path}.sharding",
                    f"flex supports dp_shard / dp_replicate only, got {name}={getattr(self, name)}")
        require(not (self.flex_buckets and self.flex_preset), f"{path}.flex_buckets",
                f"give flex_buckets or flex_preset={self.flex_preset!r}, not both")
        from lockstep.parallel.flex.buckets import parse_buckets

        parse_buckets(self.flex_buckets, f"{path}.flex_buckets")

    def resolve(self, world_size: int) -> "ParallelDims":
        others = self.dp_replicate * self.tp * self.pp * self.cp
        if world_size % others:
            raise ConfigError(
                f"parallel: dp_replicate={self.dp_replicate} x tp={self.tp} x pp={self.pp} x cp={self.cp} = {others} "
                f"does not divide the world size {world_size}"
            )
        # cp composes with tp (heads split by tp, the sequence by cp), ep (borrowing the cp ranks) and pp
        # (each stage's attention over the cp group)
        dp_shard = world_size // others if self.dp_shard == -1 else self.dp_shard
        if self.ep > 1 and self.cp > 1:
            # experts split over (dp_shard x cp): every rank of the group owns its slice whole
            require(self.tp == 1, "parallel.ep", f"expert parallel spanning cp with tp={self.tp} is not supported yet")
            require(self.dp_replicate == 1 and self.ep == dp_shard * self.cp, "parallel.ep",
                    f"with context parallel, ep spans dp_shard x cp and needs ep == dp_shard x cp and "
                    f"dp_replicate == 1 (experts are left out of FSDP); got ep={self.ep}, dp_shard={dp_shard}, "
                    f"cp={self.cp}, dp_replicate={self.dp_replicate}")
        elif self.ep > 1:
            require(dp_shard % self.ep == 0, "parallel.ep", f"{self.ep} must divide dp_shard={dp_shard}")
            # ep borrows ep of the dp_shard ranks; the experts are FSDP-sharded over the other
            # dp_shard / ep (dp_shard_mod_ep) and replicated over dp_replicate (parallel/fsdp.py)
        dims = ParallelDims(dp_replicate=self.dp_replicate, dp_shard=dp_shard, tp=self.tp, world_size=world_size,
                            ep=self.ep, pp=self.pp, cp=self.cp)
        dims.validate()
        return dims


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    ep: int = 1
    pp: int = 1
    cp: int = 1

    def validate(self) -> None:
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"parallel: pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x cp={self.cp} "
                f"x tp={self.tp} = {product}, but the world size is {self.world_size}"
            )

    def check_model(self, n_heads: int, n_kv_heads: int, ffn_dim: int, vocab_size: int) -> None:
        """TP must split heads, KV heads, the MLP and the vocabulary evenly."""
        for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("ffn_dim", ffn_dim),
                            ("vocab_size", vocab_size)):
            if value % self.tp:
                raise ConfigError(f"parallel.tp: {self.tp} does not divide model.{name}={value}")

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def mesh_dims(self) -> list[tuple[str, int]]:
        """Named mesh dims. With ep > 1 the dp_shard ranks are split into (dp_shard_mod_ep, ep), ep
        innermost so an expert group is neighbouring ranks; both are kept even at size 1."""
        if self.ep_spans_cp:  # ep is the flattened (dp_shard, cp): see build_mesh
            shard = [("dp_shard", self.dp_shard)]
        elif self.ep > 1:
            shard = [("dp_shard_mod_ep", self.dp_shard // self.ep), ("ep", self.ep)]
        else:
            # with replicas, keep dp_shard even at size 1: FSDP then replicates over dp_replicate
            # (HSDP with one shard) instead of sharding over the replicas
            shard = [("dp_shard", self.dp_shard)] if self.dp_shard > 1 or self.dp_replicate > 1 else []
        rep = [("dp_replicate", self.dp_replicate)] if self.dp_replicate > 1 else []
        tp = [("tp", self.tp)] if self.tp > 1 else []
        cp = [("cp", self.cp)] if self.cp > 1 else []  # cp ranks share a batch: not a data dim
        pp = [("pp", self.pp)] if self.pp > 1 else []  # outermost: a pipeline's stages are far apart
        return pp + rep + shard + cp + tp

    @property
    def data_dims(self) -> list[str]:
        """Mesh dims whose ranks read different data."""
        return [n for n, _ in self.mesh_dims if n in ("dp_replicate", "dp_shard", "dp_shard_mod_ep", "ep")]

    @property
    def ep_spans_cp(self) -> bool:
        """Expert parallel borrowing the context-parallel ranks: ep = dp_shard x cp."""
        return self.ep > 1 and self.cp > 1

    @property
    def ep_data_ranks(self) -> int:
        """Data-parallel batches an expert's gradient sums over (each rank's loss a mean over its
        batch; under cp the cp ranks' parts of one batch's mean): ep, or ep / cp when ep spans cp."""
        return self.ep // self.cp if self.ep_spans_cp else self.ep

    def build_mesh(self, device_type: str):
        """A DeviceMesh with the dims above plus flattened ``dp_shard`` (under ep), ``ep`` (under ep
        spanning cp) and ``dp``; None for world 1."""
        from torch.distributed.device_mesh import init_device_mesh

        dims = self.mesh_dims
        if not dims:
            return None
        names = tuple(n for n, _ in dims)
        return self.flatten_mesh(init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names))

    @property
    def flattened_dims(self) -> list[tuple[tuple[str, ...], str]]:
        """(mesh dims, name) of each flattened dim ``build_mesh`` adds, in the order it adds them."""
        out = []
        if self.ep_spans_cp:
            out.append((("dp_shard", "cp"), "ep"))
        elif self.ep > 1:
            out.append((("dp_shard_mod_ep", "ep"), "dp_shard"))
        if len(self.data_dims) > 1:
            out.append((tuple(self.data_dims), "dp"))
        return out

    def flatten_mesh(self, mesh):
        """Add the flattened dims ``build_mesh`` describes to a mesh of ``mesh_dims`` (collective)."""
        for names, name in self.flattened_dims:
            mesh[names]._flatten(name)
        return mesh

    def dp_rank(self, mesh) -> int:
        """This process's index among data-parallel ranks (who reads which slice of a batch)."""
        if mesh is None or not self.data_dims:
            return 0
        if len(self.data_dims) == 1:
            return mesh[self.data_dims[0]].get_local_rank()
        return mesh["dp"].get_local_rank()
