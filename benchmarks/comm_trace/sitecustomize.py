"""Bytes on the wire per collective, measured inside every rank of a benchmark run.

``benchmarks/parallel_overhead.py`` puts this directory first on ``PYTHONPATH`` and sets
``LOCKSTEP_BENCH_COMM_DIR``; Python then imports this module at start-up in the launcher and in
every torchrun worker. When ``torch.distributed.init_process_group`` returns, a
``TorchDispatchMode`` is entered that sees every collective op the dispatcher runs -- the c10d ops
behind ``torch.distributed.*`` (FSDP2, pipelining's send/recv, the trainer's all-reduces) and the
functional collectives behind DTensor (TP, EP), forward and backward -- and adds up the bytes of
the tensors each call moves (all-gather: the gathered output; reduce-scatter, all-reduce,
all-to-all, send, recv, broadcast: the input). ``destroy_process_group`` writes the totals to
``$LOCKSTEP_BENCH_COMM_DIR/rank<RANK>.json``. Without the variable nothing is patched.
"""

import os

if os.environ.get("LOCKSTEP_BENCH_COMM_DIR"):
    import json

    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    def _nbytes(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, (list, tuple)):
            return sum(_nbytes(t) for t in x)
        return 0

    # op name -> (kind, which argument holds the bytes moved: 0 = first tensor argument, "out" = output)
    _OPS = {
        "allgather_": ("all-gather", "out0"), "_allgather_base_": ("all-gather", 0),
        "allgather_into_tensor_coalesced_": ("all-gather", 0),
        "all_gather_into_tensor": ("all-gather", "out"), "all_gather_into_tensor_out": ("all-gather", "out"),
        "all_gather_into_tensor_coalesced": ("all-gather", "out"),
        "reduce_scatter_": ("reduce-scatter", 1), "_reduce_scatter_base_": ("reduce-scatter", 1),
        "reduce_scatter_tensor_coalesced_": ("reduce-scatter", 1),
        "reduce_scatter_tensor": ("reduce-scatter", 0), "reduce_scatter_tensor_coalesced": ("reduce-scatter", 0),
        "allreduce_": ("all-reduce", 0), "allreduce_coalesced_": ("all-reduce", 0),
        "all_reduce": ("all-reduce", 0), "all_reduce_": ("all-reduce", 0), "all_reduce_coalesced": ("all-reduce", 0),
        "alltoall_base_": ("all-to-all", 1), "alltoall_": ("all-to-all", 1), "all_to_all_single": ("all-to-all", 0),
        "send": ("send", 0), "recv_": ("recv", 0), "recv_any_source_": ("recv", 0),
        "broadcast_": ("broadcast", 0), "broadcast": ("broadcast", 0),
    }

    class _CommBytes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes: dict[str, int] = {}
            self.calls: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ns = func.namespace
            if ns in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
                name = func._schema.name.split("::")[-1]
                rule = _OPS.get(name)
                if rule is not None:
                    kind, where = rule
                    if where == "out":
                        n = _nbytes(out)
                    elif where == "out0":
                        n = _nbytes(args[0])
                    else:
                        n = _nbytes(args[where]) if len(args) > where else 0
                    self.bytes[kind] = self.bytes.get(kind, 0) + n
                    self.calls[kind] = self.calls.get(kind, 0) + 1
            return out

    _mode = _CommBytes()
    _init, _destroy = dist.init_process_group, dist.destroy_process_group

    def init_process_group(*args, **kwargs):
        result = _init(*args, **kwargs)
        _mode.__enter__()
        return result

    def destroy_process_group(*args, **kwargs):
        if dist.is_initialized():
            path = os.path.join(os.environ["LOCKSTEP_BENCH_COMM_DIR"], f"rank{dist.get_rank()}.json")
            with open(path, "w") as f:
                json.dump({"bytes": _mode.bytes, "calls": _mode.calls}, f)
        return _destroy(*args, **kwargs)

    dist.init_process_group, dist.destroy_process_group = init_process_group, destroy_process_group
