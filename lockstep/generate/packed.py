"""Decode linears on prepacked weights: packed once into a kernel's layout, repacked when written.

A bf16 ``F.linear`` on CPU hands oneDNN a plain ``[N, K]`` weight, which it reorders into its
blocked (AMX/VNNI) layout on *every* call: at decode sizes that reorder reads and writes the whole
weight again and costs as much as the product. ``EngineConfig.pack_weights`` packs each linear
weight of the module tree the engine runs once, for one kernel (``linear_kernel``):

- bf16 ``"bf16"`` (``EngineConfig.linear_kernel`` "amx", and "auto" at the ISA levels amx and avx512
  with avx512_bf16): :mod:`lockstep.ops.decode_linear`'s C kernel of the process's ISA level (AMX
  tiles, or ``vdpbf16ps``) on a layout each thread streams in one run: ~1.5x oneDNN's prepacked
  linear on a SmolLM2 decode step's weights with AMX, 1.1-1.6x without (oneDNN capped to
  AVX512_CORE_BF16; ``benchmarks/decode_kernels.py``). fp32 sums in an order fixed by K (a row's
  result does not depend on the batch), not ``F.linear``'s bits.
- bf16 ``"onednn"`` (``"auto"`` below that): ``torch.ops.mkldnn._reorder_linear_weight`` (the
  prepacking Inductor's freezing uses) and ``torch.ops.mkldnn._linear_pointwise``: 1.4-2x faster
  than ``F.linear`` per linear at 1-64 rows here, and bitwise equal to ``F.linear`` on a contiguous
  input (the same oneDNN kernels; tested with AMX and capped to AVX-512). The packed path makes its
  input contiguous; ``F.linear`` itself hands oneDNN a transposed input as it lies, which takes
  another kernel: its bits then differ from its own on the contiguous copy (measured, without AMX at
  3-33 rows, with AMX at 33), and so from the packed layer's.
- fp32 ``"f32"`` (``"auto"`` on AVX-512 CPUs): :mod:`lockstep.ops.decode_linear`'s AVX-512 kernel;
  layers whose output width is not a multiple of 16 stay unpacked.

The C kernels hand calls of more than ``PLAIN_ROWS`` rows (long prefills) to ``F.linear``.

The packed copy follows the weight: every call compares the version counters and storages of the
weight and bias (moved by lockstep's AdamW steps, ``copy_``, ``load_state_dict``, checkpoint loads,
the RL weight sync) with those it was packed from and repacks when they moved; one layer and a
sibling group (below) use the same cache. A write that moves no version counter (a collective
writing straight into the storage) is not seen: ``Engine.sync_weights()`` repacks everything.

The ops' kernels are C++ (:mod:`lockstep.ops.packed_op`; a call ~2 us besides the product, ~8 us
through a Python kernel) where that library builds, for the C kernels' packs: they hold the weight
and bias objects each pack was made from weakly and check their version counters and storages; a
parameter *replaced* by a new object is seen there once the old object is freed (at once, unless
something else holds it: then ``Engine.sync_weights()``, as for the cast copy of
:mod:`lockstep.generate.weights`). Anything they do not hold goes to the Python kernel, which
repacks and hands them the pack. A pack's C function is resolved at the ISA level it was packed at.

The packed product is a registered op (``lockstep::packed_linear``), so ``compile_decode``
traces it as one call and the weights need not be graph constants (unlike Inductor's freezing).
Autograd and other devices take the ordinary linear; batch-invariant mode takes its own linear:
for bf16 on CPU that is :mod:`decode_linear`'s kernel on a fresh pack of the weight, so a packed
layer runs it on a cached pack instead (its own ``"bf16"`` pack, or a second one kept for the mode
by a ``"onednn"`` layer): the same bytes, the same bits, without packing every step.

Layers are registered under never-reused integer handles (what the compiled step's ops carry) in a
table of weak references: a dropped engine's layers leave it (and free their packs) when collected.
"""

from __future__ import annotations

import functools
import itertools
import operator
import weakref

import torch
from torch import nn

from lockstep import numerics
from lockstep.config.base import ConfigError
from lockstep.ops import decode_linear, packed_op

#: handle -> the layer (weakly: a dropped engine's layers leave it and their packed copies are freed)
_LAYERS: weakref.WeakValueDictionary[int, "PackedLinear"] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def available() -> bool:
    """Whether this torch build has the oneDNN prepacked linear."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packable(model: nn.Module) -> bool:
    """Whether the engine may pack ``model``'s linears: this torch build has the op, and the
    parameters are not sharded DTensors (FSDP2 re-gathers weights into the same storage each forward
    without moving a version counter, so a packed copy could not tell it was stale)."""
    if not available():
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed
        return True
    return not any(isinstance(p, DTensor) for p in model.parameters())


def linear_kernel(choice: str, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """``EngineConfig.linear_kernel`` resolved on this machine (at its :mod:`~lockstep.ops.isa` level)
    for an engine running ``dtype``: bf16: "bf16" (the C kernel) or "onednn"; fp32: "f32" (``"auto"``
    where AVX-512 is here) or None (unpacked)."""
    if dtype == torch.float32:
        return "f32" if choice == "auto" and decode_linear.available(torch.float32) else None
    if dtype != torch.bfloat16:
        return None
    if choice == "auto":  # measured faster than oneDNN at decode rows with AMX and with vdpbf16ps
        return "bf16" if decode_linear.kernel() in ("amx", "avx512_bf16") else "onednn"
    if choice == "amx":
        if not decode_linear.amx_available():
            raise ConfigError("engine.linear_kernel: 'amx' needs a Linux x86 CPU with AMX (amx_bf16, amx_tile, "
                              "avx512_bf16 in /proc/cpuinfo), a C compiler and $LOCKSTEP_CPU_ISA unset or 'amx'; "
                              "use 'onednn' or 'auto'")
        return "bf16"
    return choice


#: above this many rows (a long prefill) the C kernels' weight streaming no longer pays: measured on
#: SmolLM2 shapes, F.linear is within 0.9-1.2x of them at 256 rows and 1.2-1.5x faster at 1024
PLAIN_ROWS = 512
#: kernel -> the weight dtype it runs
_KERNEL_DTYPE = {"bf16": torch.bfloat16, "onednn": torch.bfloat16, "f32": torch.float32}
#: the C kernels (decode_linear): packed by decode_linear.pack, bias in fp32
_C_KERNELS = ("bf16", "f32")


class PackedLinear(numerics.SwitchableLinear):
    """A linear whose no-grad CPU forward runs on a prepacked copy of its weight (module docstring).

    Only the class changes (as with ``SwitchableLinear``): same parameters, names and state dict."""

    _pack_handle: int
    #: id() of the layer the handle was given to (a deep copy carries the number, not the identity)
    _pack_owner: int
    _pack_key: tuple
    _pack_hint: int
    #: "bf16", "onednn" or "f32"; None: this layer runs unpacked (an fp32 shape the kernel does not take)
    _pack_kernel: str | None
    #: packs this layer leads: key (its handle, a sibling group's handles, or ("bi", handle) for
    #: batch-invariant mode) -> (packed weight, bias, stamps, C-kernel output width or None for oneDNN)
    _packs: dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (self._pack_kernel is None or w.dtype != _KERNEL_DTYPE[self._pack_kernel] or x.dtype != w.dtype
                or w.device.type != "cpu" or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
            return super().forward(x)
        if numerics.is_batch_invariant():
            # the batch-invariant bf16 linear is decode_linear's kernel on a fresh pack of this
            # weight; a cached pack holds the same bytes (bias added after, as that path does)
            if (w.dtype != torch.bfloat16 or torch.compiler.is_compiling() or not decode_linear.available()
                    or self.k_split > 1):  # K summed in slices (lockstep.parallel.tp_sums): not one pack
                return super().forward(x)
            out = _single_product(self, x, with_bias=False, kernel="bf16")
            return out + self.bias if self.bias is not None else out
        if torch.compiler.is_compiling():
            return torch.ops.lockstep.packed_linear(x, self._pack_handle)
        if self._pack_kernel in _C_KERNELS and x.numel() > PLAIN_ROWS * x.shape[-1]:
            return super().forward(x)  # a long prefill: the library GEMM is as fast or faster there
        if _CPP_KERNELS and self._pack_kernel in _C_KERNELS and self._pack_owner == id(self):
            # the C++ kernel: ~2 us besides the product (not for a deep copy, which carries this
            # layer's handle until pack_linears gives it its own: its weights are not the handle's)
            return torch.ops.lockstep.packed_linear(x, self._pack_handle)
        return _single_product(self, x)  # the Python kernel without the dispatcher's round trip into it

    @property
    def is_packed(self) -> bool:
        return bool(self._packs)

    def drop_packed(self) -> None:
        self._packs.clear()
        _forget(self._pack_handle)


def _stamp(layer: PackedLinear) -> tuple:
    """What moves when the layer's weight or bias is written in place or replaced."""
    params = layer._parameters  # not layer.weight: Module.__getattr__ costs ~0.4 us a name, and this runs every call
    w, b = params["weight"], params["bias"]
    return (w._version, w.data_ptr()) if b is None else (w._version, w.data_ptr(), b._version, b.data_ptr())


def _pack(layers: list[PackedLinear], stamps: list[tuple], kernel: str) -> tuple:
    """The layers' concatenated weight (and bias) packed for ``kernel``: (packed weight, bias,
    stamps, C-kernel output width or None for oneDNN)."""
    weight = torch.cat([layer.weight.detach() for layer in layers]) if len(layers) > 1 else layers[0].weight.detach()
    bias = None
    if any(layer.bias is not None for layer in layers):
        bias = torch.cat([layer.bias.detach() if layer.bias is not None else
                          layer.weight.new_zeros(layer.out_features) for layer in layers])
    if kernel in _C_KERNELS:
        return decode_linear.pack(weight), bias.float() if bias is not None else None, stamps, weight.shape[0]
    return torch.ops.mkldnn._reorder_linear_weight(weight, layers[0]._pack_hint), bias, stamps, None


def _run(entry: tuple, x: torch.Tensor) -> torch.Tensor:
    if entry[3] is not None:
        return decode_linear.linear(x, entry[0], entry[3], entry[1])
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(flat, entry[0], entry[1], "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _entry(layers: list[PackedLinear], key: tuple, kernel: str) -> tuple:
    """The layers' pack for ``kernel`` under ``key``, kept on the first layer (freed with it) and
    packed again when any part's weight or bias was written or replaced since."""
    stamps = [_stamp(layer) for layer in layers]
    entry = layers[0]._packs.get(key)
    if entry is None or entry[2] != stamps:
        entry = layers[0]._packs[key] = _pack(layers, stamps, kernel)
    return entry


def _single_product(layer: PackedLinear, x: torch.Tensor, with_bias: bool = True,
                    kernel: str | None = None) -> torch.Tensor:
    """``layer(x)`` on its packed weight; ``with_bias=False``: ``x @ W.T`` alone; ``kernel``: another
    kernel than the layer's (its pack kept under its own key)."""
    if kernel is None or kernel == layer._pack_kernel:
        entry = _entry([layer], layer._pack_key, layer._pack_kernel)
    else:
        entry = _entry([layer], ("bi", layer._pack_handle), kernel)
    if not with_bias and entry[1] is not None:
        entry = (entry[0], None, entry[2], entry[3])
    return _run(entry, x)


def _packed_product(layers: list[PackedLinear], x: torch.Tensor, key: tuple) -> torch.Tensor:
    """``cat([layer(x) for layer in layers], -1)`` as one product on the layers' packed
    concatenated weight (``key``: their handles)."""
    return _run(_entry(layers, key, layers[0]._pack_kernel), x)


# plain schemas + CPU kernels (torch.library.custom_op adds ~30 us a call, 6 ms a SmolLM2 decode step).
# The kernels are C++ (lockstep.ops.packed_op) where that library builds: they call the C kernels
# directly and hand missing or stale packs to _packed_linear_py; else the Python kernels below serve
# the ops (the dispatcher's trip into Python, ~6-8 us a call with the product's marshalling).
_LIB = torch.library.Library("lockstep", "FRAGMENT")
_LIB.define("packed_linear(Tensor x, int handle) -> Tensor")
_LIB.define("packed_linear_cat(Tensor x, int[] handles) -> Tensor")
_LIB.define("_packed_linear_py(Tensor x, int[] handles) -> Tensor")


def packed_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    """``layer(x)`` for the :class:`PackedLinear` registered as ``handle``, on its packed weight."""
    return _single_product(_LAYERS[handle], x)


def packed_linear_cat(x: torch.Tensor, handles: list[int]) -> torch.Tensor:
    """``cat([layer(x) for layer in handles], -1)`` as one product on one packed weight (the layers
    share their input: q/k/v, gate/up)."""
    return _packed_product([_LAYERS[h] for h in handles], x, tuple(handles))


def packed_linear_py(x: torch.Tensor, handles: list[int]) -> torch.Tensor:
    """The C++ kernels' way back (a pack they do not hold, or one whose weights moved): the product
    in Python, packing again where the weights moved, and a C kernel's pack handed to the C++ table."""
    layers, key = [_LAYERS[h] for h in handles], tuple(handles)
    entry = _entry(layers, key, layers[0]._pack_kernel)
    if entry[3] is not None and x.dtype == entry[0].dtype:
        sources = [t for layer in layers for t in (layer._parameters["weight"], layer._parameters["bias"])]
        k = layers[0].in_features
        torch.ops.lockstep._packed_register(list(key), sources, entry[0], entry[1], entry[3], k,
                                            decode_linear.kernel_address(entry[0].dtype, entry[3], k))
    return _run(entry, x)


def _forget(handle: int) -> None:
    """Drop the C++ table's packs that ``handle``'s layer is part of."""
    if _CPP_KERNELS:
        torch.ops.lockstep._packed_forget(handle)


def _serve_ops() -> bool:
    """Register the ops' CPU kernels (once, at the first :func:`pack_linears`: a cold C++ build takes
    seconds): the C++ ones where they build, else the Python ones; whether C++ serves them."""
    global _CPP_KERNELS, _SERVED
    if not _SERVED:
        _SERVED = True
        _LIB.impl("_packed_linear_py", packed_linear_py, "CPU")
        _CPP_KERNELS = decode_linear.available(torch.bfloat16) and packed_op.load()
        if not _CPP_KERNELS:
            _LIB.impl("packed_linear", packed_linear, "CPU")
            _LIB.impl("packed_linear_cat", packed_linear_cat, "CPU")
    return _CPP_KERNELS


_CPP_KERNELS = _SERVED = False


@torch.library.register_fake("lockstep::packed_linear")
def _(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _LAYERS[handle].out_features)


@torch.library.register_fake("lockstep::packed_linear_cat")
def _(x: torch.Tensor, handles: list[int]) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], sum(_LAYERS[h].out_features for h in handles))


def group_siblings(graph: torch.fx.Graph) -> None:
    """Packed linears that read the same input (q/k/v, gate/up) become one ``packed_linear_cat``
    and a split: fewer, wider products (each call has a fixed cost, and a wider one streams its
    weight better). Run by Inductor on the compiled decode step (:func:`sibling_grouping_pass`)."""
    single = torch.ops.lockstep.packed_linear.default
    by_input: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is single:
            by_input.setdefault(node.args[0], []).append(node)
    for x, nodes in by_input.items():
        if len(nodes) < 2:
            continue
        handles = [n.args[1] for n in nodes]
        sizes = [_LAYERS[h].out_features for h in handles]
        with graph.inserting_before(nodes[0]):  # the first reader: every use of the group comes later
            cat = graph.call_function(torch.ops.lockstep.packed_linear_cat.default, (x, handles))
        with graph.inserting_after(cat):
            split = graph.call_function(torch.ops.aten.split_with_sizes.default, (cat, sizes, -1))
        anchor = split
        for i, node in enumerate(nodes):
            with graph.inserting_after(anchor):
                anchor = graph.call_function(operator.getitem, (split, i))
            node.replace_all_uses_with(anchor)
        for node in nodes:
            graph.erase_node(node)
    graph.lint()


@functools.cache
def sibling_grouping_pass():
    """:func:`group_siblings` as an Inductor post-grad pass (built on first use: importing Inductor
    costs ~1.3 s, which a process that never compiles should not pay)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class GroupSiblingLinears(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            group_siblings(graph)

        def uuid(self) -> str:
            return get_hash_for_files((__file__,))

    return GroupSiblingLinears()


def pack_linears(model: nn.Module, batch_hint: int, kernel: str = "onednn") -> list[PackedLinear]:
    """Make every linear layer of ``model`` a :class:`PackedLinear` (packed lazily, at first use);
    ``batch_hint``: the row count oneDNN picks the blocked layout for; ``kernel``: "bf16", "onednn"
    or "f32" (:func:`linear_kernel`). Returns the layers."""
    if kernel not in _KERNEL_DTYPE:
        raise ValueError(f"pack_linears: kernel must be one of {', '.join(_KERNEL_DTYPE)}; got {kernel!r}")
    _serve_ops()
    layers = []
    for module in model.modules():
        # a deep copy of a packed layer (an engine's bf16 shadow of a model another engine packed)
        # carries the original's handle, kernel and packs: it is packed as a layer of its own
        copied = isinstance(module, PackedLinear) and _LAYERS.get(module._pack_handle) is not module
        if type(module) in (nn.Linear, numerics.SwitchableLinear) or copied:
            module.__class__ = PackedLinear
            module._pack_handle, module._pack_hint = next(_HANDLES), batch_hint
            module._pack_key, module._pack_owner = (module._pack_handle,), id(module)
            fits = decode_linear.supports(module.out_features, module.in_features, _KERNEL_DTYPE[kernel])
            module._pack_kernel = kernel if fits or kernel == "onednn" else (None if kernel == "f32" else "onednn")
            module._packs = {}
            _LAYERS[module._pack_handle] = module
            weakref.finalize(module, _forget, module._pack_handle).atexit = False
        if isinstance(module, PackedLinear):
            layers.append(module)
    return layers
