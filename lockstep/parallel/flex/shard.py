"""``flex_shard``: FlexShard over a model's data-parallel ranks, an alternative to FSDP2 (issue #20).

Units as FSDP's: each transformer block (``model.layers[i]``) and the root (the rest: embeddings,
final norm, head, MTP layers). Each unit's parameters are grouped by bucket; a (bucket, unit) group
is one collective each way (:mod:`lockstep.parallel.flex.group`). Parameters become plain
``nn.Parameter``\\ s holding the local piece, with ``param._flex`` (:class:`FlexParam`).

Reading a parameter attribute inside its unit's forward returns the whole gathered tensor: modules
get a subclass whose parameter names are properties (:mod:`lockstep.parallel.param_properties`,
shared with the traceable FSDP). Outside a unit's forward the attribute is the local storage.

- Prefetch: unit i's forward pre-hook issues unit i+1's gathers (asynchronous) before waiting on its
  own; the root's issues block 0's.
- ``reshard_after_forward`` ("always", "never", "except_last" -- the root reshards only under
  "always", as :func:`lockstep.parallel.fsdp.apply_fsdp`): a resharding unit's whole tensors are
  dropped after its forward; a saved-tensors hook around the root forward packs a tensor that is
  (a view of) such a whole tensor as a handle, and unpacking gathers the group again (once per
  backward; freed when its gradients are reduced).
- Activation checkpointing: a wrapped block's hooks sit on the wrapped module, so the recompute in
  backward gathers again (synchronously: no prefetch inside a backward); checkpointing's own
  saved-tensors hooks are innermost there, so nothing of the block is packed by ours.
- Deviation from the design: the whole tensors come out of one autograd Function per group whose
  forward waits for the gather, so the gradient reduce is that Function's backward (one per group
  per forward; a recompute's copy is never backpropagated).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from lockstep.config.base import ConfigError
from lockstep.parallel.flex.buckets import match_buckets
from lockstep.parallel.flex.group import FlexGroup, GatherGroup
from lockstep.parallel.flex.layout import BlockShard, Bucket, FlexParam, Owned, assign_owners, group_rank_world
from lockstep.parallel.param_properties import swap_in_properties

RESHARD = ("always", "never", "except_last")


@dataclasses.dataclass
class _Unit:
    name: str
    module: nn.Module  # where the forward hooks sit
    groups: list[FlexGroup]
    next: "_Unit | None" = None


# storage pointer of a resharding group's live whole tensor -> (group, index); filled while the
# group's unit runs forward, read by the saved-tensors pack hook
_LIVE: dict[int, tuple[FlexGroup, int]] = {}


def _pack(t: torch.Tensor):
    if not _LIVE or not isinstance(t, torch.Tensor) or t.numel() == 0:
        return t
    hit = _LIVE.get(t.untyped_storage().data_ptr())
    if hit is None:
        return t
    return ("flex-regather", hit[0], hit[1], tuple(t.shape), tuple(t.stride()), t.storage_offset())


def _unpack(x):
    if isinstance(x, tuple) and len(x) == 6 and x[0] == "flex-regather":
        _, group, index, size, stride, offset = x
        return group.regather()[index].as_strided(size, stride, offset)
    return x


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class FlexShard:
    """What :func:`flex_shard` set up on a model (kept as ``model._flex_shard``)."""

    def __init__(self, buckets: list[Bucket], units: list[_Unit], params: dict[str, nn.Parameter],
                 bucket_of: dict[str, int], param_dtype: torch.dtype) -> None:
        self.buckets, self.units, self.params, self.bucket_of = buckets, units, params, bucket_of
        self.layouts = {f: p._flex for f, p in params.items()}
        self.param_dtype = param_dtype
        self._saved_hooks = None

    def groups(self) -> list[FlexGroup]:
        return [g for u in self.units for g in u.groups]

    # ------------------------------------------------------------------ hooks

    def _activate(self, unit: _Unit) -> None:
        if not _in_backward():
            for g in unit.groups:
                g.start_gather()
            if unit.next is not None:
                for g in unit.next.groups:
                    g.start_gather()
        for g in unit.groups:
            wholes = GatherGroup.apply(g, *g.params)
            g.wholes = list(wholes)
            if g.reshard and torch.is_grad_enabled() and not _in_backward():
                for i, w in enumerate(g.wholes):
                    _LIVE[w.untyped_storage().data_ptr()] = (g, i)

    def _deactivate(self, unit: _Unit) -> None:
        for g in unit.groups:
            if g.wholes is not None:
                for w in g.wholes:
                    hit = _LIVE.get(w.untyped_storage().data_ptr())
                    if hit is not None and hit[0] is g:
                        del _LIVE[w.untyped_storage().data_ptr()]
            g.wholes = None

    def _root_pre(self, module, args) -> None:
        for g in self.groups():  # a forward that failed half-way may have left gathers issued
            g.drop_pending()
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        self._saved_hooks.__enter__()
        self._activate(self.units[0])

    def _root_post(self, module, args, output) -> None:
        self._deactivate(self.units[0])
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None

    def install(self, model: nn.Module) -> None:
        model.register_forward_pre_hook(self._root_pre)
        model.register_forward_hook(self._root_post, always_call=True)
        for unit in self.units[1:]:
            unit.module.register_forward_pre_hook(lambda m, a, u=unit: self._activate(u))
            unit.module.register_forward_hook(lambda m, a, o, u=unit: self._deactivate(u), always_call=True)

    # ------------------------------------------------------------------ records

    def describe(self) -> dict:
        """Per bucket: placement, parameter count, bytes this rank stores (the manifest's record)."""
        out = []
        for i, bucket in enumerate(self.buckets):
            fqns = [f for f, b in self.bucket_of.items() if b == i]
            local = sum(self.params[f].numel() * self.params[f].element_size() for f in fqns)
            out.append({"name": bucket.name or f"bucket{i}", "patterns": list(bucket.patterns),
                        "placement": bucket.describe(), "params": len(fqns), "bytes_per_rank": local})
        return {"sharding": "flex", "buckets": out}


def _block_and_dim(placement, shape: tuple[int, ...], fqn: str, field: str) -> tuple[int, int | None]:
    if isinstance(placement, Owned):
        return 0, None
    dim = placement.dim
    if dim >= len(shape):
        raise ConfigError(f"{field}: {fqn!r} has {len(shape)} dims; cannot split dim {dim}")
    return dim, (placement.block if isinstance(placement, BlockShard) else None)


def _groups_of(mesh_or_group, mesh_dim: str):
    """(shard group, replicate group or None) of a bucket's mesh dim."""
    if mesh_or_group is None or isinstance(mesh_or_group, dist.ProcessGroup):
        return mesh_or_group, None
    names = mesh_or_group.mesh_dim_names or ()
    if mesh_dim == "dp":
        data = [n for n in ("dp_replicate", "dp_shard") if n in names]
        if len(data) == 1:
            return mesh_or_group[data[0]].get_group(), None
        try:  # the flattened (dp_replicate, dp_shard) of ParallelDims.flatten_mesh (not in mesh_dim_names)
            return mesh_or_group["dp"].get_group(), None
        except (KeyError, RuntimeError):
            raise ConfigError("parallel.flex_buckets: mesh dim 'dp' needs a flattened dp mesh dim") from None
    if mesh_dim not in names:
        raise ConfigError(f"parallel.flex_buckets: mesh dim {mesh_dim!r} is not one of the mesh's {list(names)}")
    rep = mesh_or_group["dp_replicate"].get_group() if "dp_replicate" in names else None
    return mesh_or_group[mesh_dim].get_group(), rep


def _units(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(name, block as registered, the module whose forward runs: inside a checkpoint wrapper) per block."""
    out = []
    for name, block in model.layers.named_children():
        out.append((f"layers.{name}", block, getattr(block, "_checkpoint_wrapped_module", block)))
    return out


def flex_shard(model: nn.Module, buckets: list[Bucket], mesh_or_group=None, *,
               param_dtype: torch.dtype = torch.float32, reduce_dtype: torch.dtype = torch.float32,
               reshard_after_forward: str = "always", field: str = "parallel.flex_buckets") -> FlexShard:
    """Shard ``model``'s parameters by ``buckets`` over ``mesh_or_group`` (a DeviceMesh with
    ``dp_shard`` [+ ``dp_replicate``, ``dp``] dims, or a ProcessGroup: every bucket over it; None: the
    default group, or one process), in place. Returns the :class:`FlexShard` (also ``model._flex_shard``)."""
    from lockstep.checkpoint.train_state import param_fqns

    if reshard_after_forward not in RESHARD:
        raise ConfigError(f"parallel.reshard_after_forward: must be one of {list(RESHARD)}, "
                          f"got {reshard_after_forward!r}")
    fqn_of = param_fqns(model)  # id(param) -> clean fqn (a tied pair once)
    params = {fqn_of[id(p)]: p for p in model.parameters()}
    bucket_of = match_buckets(list(params), buckets, field)
    _check_params(params, buckets, bucket_of, field)
    groups = {b.mesh_dim: _groups_of(mesh_or_group, b.mesh_dim) for b in buckets}
    layouts = _layouts(params, buckets, bucket_of, groups, field)
    local = _install_local_params(model, params, layouts)
    blocks = _units(model)
    unit_of: dict[int, int] = {}  # id(param) -> 1 + the first block holding it (0: the root)
    for u, (_, block, _) in enumerate(blocks, start=1):
        for p in block.parameters():
            unit_of.setdefault(id(p), u)
    members: dict[tuple[int, int], list[str]] = {}
    for fqn, p in params.items():
        members.setdefault((unit_of.get(id(local[fqn]), 0), bucket_of[fqn]), []).append(fqn)
    units = [_Unit("root", model, [])] + [_Unit(name, inner, []) for name, _, inner in blocks]
    for (u, bi), fqns in sorted(members.items()):
        b = buckets[bi]
        rep = groups[b.mesh_dim][1]
        units[u].groups.append(FlexGroup(
            f"{units[u].name}/{b.name or bi}", [local[f] for f in fqns], [layouts[f] for f in fqns],
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, replicate_group=rep,
            replicate_world=dist.get_world_size(rep) if rep is not None else 1,
            fp8_block=b.placement.block if b.fp8 else None))
    _link_units(units, reshard_after_forward)
    # attribute reads: the whole tensor while the group is active
    where = {id(p): (g, i) for u in units for g in u.groups for i, p in enumerate(g.params)}
    for module in model.modules():
        names = [n for n, q in module._parameters.items() if q is not None]
        if names:
            module._flex_slots = {n: where[id(module._parameters[n])] for n in names}
            swap_in_properties(module, names, _whole_property, "Flex")
    state = FlexShard(buckets, units, local, bucket_of, param_dtype)
    state.install(model)
    model.__dict__["_flex_shard"] = state
    return state


def _check_params(params: dict[str, nn.Parameter], buckets: list[Bucket], bucket_of: dict[str, int],
                  field: str) -> None:
    for fqn, p in params.items():
        if p.ndim == 0:
            raise ConfigError(f"{field}: {fqn!r} is a 0-d parameter; FlexShard splits or owns tensors of >= 1 dim")
        if hasattr(p, "device_mesh"):
            raise ConfigError(f"parallel.sharding: flex takes plain parameters; {fqn!r} is a DTensor "
                              f"(tp/ep are not supported with flex)")
        b = buckets[bucket_of[fqn]]
        if b.fp8 and (p.ndim != 2 or b.placement.dim != 0):
            raise ConfigError(f"{b.name or field}: fp8 gathers 2-D parameters split on dim 0; {fqn!r} is "
                              f"{tuple(p.shape)} with dim {b.placement.dim}")


def _layouts(params: dict[str, nn.Parameter], buckets: list[Bucket], bucket_of: dict[str, int],
             groups: dict[str, tuple], field: str) -> dict[str, FlexParam]:
    """Every parameter's FlexParam; owners balanced over every owned parameter of a mesh dim together."""
    owners: dict[str, int] = {}
    for mesh_dim, (group, _) in groups.items():
        owned = {f: tuple(p.shape) for f, p in params.items()
                 if isinstance(buckets[bucket_of[f]].placement, Owned) and buckets[bucket_of[f]].mesh_dim == mesh_dim}
        owners.update(assign_owners(owned, group_rank_world(group)[1]))
    layouts = {}
    for fqn, p in params.items():
        b = buckets[bucket_of[fqn]]
        group = groups[b.mesh_dim][0]
        rank, world = group_rank_world(group)
        dim, block = _block_and_dim(b.placement, tuple(p.shape), fqn, b.name or field)
        lay = FlexParam(placement=b.placement.name, global_shape=tuple(p.shape), dim=dim, offset=0, block=block,
                        owner=owners.get(fqn), group=group, rank=rank, world=world,
                        bucket=b.name or f"{field}[{bucket_of[fqn]}]", fqn=fqn)
        lay.offset = lay.piece_of(rank)[0]
        layouts[fqn] = lay
    return layouts


def _install_local_params(model: nn.Module, params: dict[str, nn.Parameter],
                          layouts: dict[str, FlexParam]) -> dict[str, nn.Parameter]:
    """Replace every parameter by a plain parameter of its local piece carrying ``_flex`` (tied modules
    share the new one); returns fqn -> the new parameter."""
    local = {}
    new: dict[int, nn.Parameter] = {}
    for fqn, p in params.items():
        piece = nn.Parameter(layouts[fqn].shard_of(p.detach()).clone(), requires_grad=p.requires_grad)
        piece._flex = layouts[fqn]
        local[fqn] = new[id(p)] = piece
    for module in model.modules():
        for n, q in list(module._parameters.items()):
            if q is not None:
                module._parameters[n] = new[id(q)]
    return local


def _link_units(units: list[_Unit], reshard_after_forward: str) -> None:
    """Prefetch order (root, block 0, block 1, ...) and who reshards (the root only under "always",
    the last block not under "except_last", as FSDP2's apply_fsdp)."""
    for i, unit in enumerate(units):
        unit.next = units[i + 1] if i + 1 < len(units) else None
        if i == 0:
            reshard = reshard_after_forward == "always"
        else:
            reshard = reshard_after_forward == "always" or (reshard_after_forward == "except_last"
                                                            and i < len(units) - 1)
        for g in unit.groups:
            g.reshard = reshard


def _whole_property(name: str) -> property:
    def get(self):
        group, index = self._flex_slots[name]
        if group.wholes is not None:
            return group.wholes[index]
        return self._parameters[name]

    return property(get)


def flex_state(model: nn.Module) -> FlexShard | None:
    """The :class:`FlexShard` of a flex-sharded model, else None."""
    return model.__dict__.get("_flex_shard")
