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
    #: FSDP mixed precision: parameter dtype in compute ("float32" or "bfloat16")
    fsdp_param_dtype: str = "float32"
    #: FSDP: free gathered parameters after forward ("always", "never", "except_last")
    reshard_after_forward: str = "always"

    def validate(self, path: str = "parallel") -> None:
        require(self.dp_replicate >= 1, f"{path}.dp_replicate", f"must be >= 1, got {self.dp_replicate}")
        require(self.dp_shard == -1 or self.dp_shard >= 1, f"{path}.dp_shard",
                f"must be >= 1 or -1 (auto), got {self.dp_shard}")
        require(self.tp >= 1, f"{path}.tp", f"must be >= 1, got {self.tp}")
        require_choice(self.fsdp_param_dtype, ["float32", "bfloat16"], f"{path}.fsdp_param_dtype")
        require_choice(self.reshard_after_forward, ["always", "never", "except_last"],
                       f"{path}.reshard_after_forward")

    def resolve(self, world_size: int) -> "ParallelDims":
        others = self.dp_replicate * self.tp
        if world_size % others:
            raise ConfigError(
                f"parallel: dp_replicate={self.dp_replicate} x tp={self.tp} = {others} does not divide "
                f"the world size {world_size}"
            )
        dp_shard = world_size // others if self.dp_shard == -1 else self.dp_shard
        dims = ParallelDims(dp_replicate=self.dp_replicate, dp_shard=dp_shard, tp=self.tp, world_size=world_size)
        dims.validate()
        return dims


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int

    def validate(self) -> None:
        product = self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"parallel: dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x tp={self.tp} "
                f"= {product}, but the world size is {self.world_size}"
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
        return [(n, d) for n, d in (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard),
                                    ("tp", self.tp)) if d > 1]

    def build_mesh(self, device_type: str):
        """A DeviceMesh with a named dim per degree > 1, plus a flattened ``dp`` dim; None for world 1."""
        from torch.distributed.device_mesh import init_device_mesh

        dims = self.mesh_dims
        if not dims:
            return None
        names = tuple(n for n, _ in dims)
        mesh = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
        dp_names = tuple(n for n in names if n.startswith("dp_"))
        if len(dp_names) > 1:
            mesh[dp_names]._flatten("dp")
        return mesh

    def dp_rank(self, mesh) -> int:
        """This process's index among data-parallel ranks (who reads which slice of a batch)."""
        if mesh is None:
            return 0
        names = mesh.mesh_dim_names
        dp_names = [n for n in names if n.startswith("dp_")]
        if not dp_names:
            return 0
        if len(dp_names) == 1:
            return mesh[dp_names[0]].get_local_rank()
        return mesh["dp"].get_local_rank()
