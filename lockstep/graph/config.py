"""The ``graph`` section of a run's config: which passes rewrite the captured step, and its debugging aids."""

from __future__ import annotations

import dataclasses

from lockstep.config.base import Config, require


@dataclasses.dataclass(kw_only=True)
class GraphConfig(Config):
    """Passes and debugging of the captured training step (used when ``training.mode = "graph"``)."""

    #: opt-in passes to enable by name, on top of the default ones (e.g. "inductor"); unknown names are errors
    enable: list[str] = dataclasses.field(default_factory=list)
    #: default passes to turn off by name; unknown names are errors
    disable: list[str] = dataclasses.field(default_factory=list)
    #: write the graph after each pass here (readable code + a per-block summary); "" = off
    dump_dir: str = ""
    #: run eager and graph side by side for this many steps and report the first diverging node (0 = off)
    check_steps: int = 0
    #: activation budget of the memory pass, as a fraction of what the unmodified graph saves for
    #: backward (0 = off: the default policy; 1 = save everything)
    memory_budget: float = 0.0
    #: module-path globs ("layers.*.attention") whose nodes the opt-in "inductor" pass compiles; empty =
    #: the whole graph
    inductor_regions: list[str] = dataclasses.field(default_factory=list)

    def validate(self, path: str = "graph") -> None:
        require(self.check_steps >= 0, f"{path}.check_steps", f"must be >= 0, got {self.check_steps}")
        require(0.0 <= self.memory_budget <= 1.0, f"{path}.memory_budget",
                f"must be in [0, 1] (a fraction of the saved activations), got {self.memory_budget}")
        for i, glob in enumerate(self.inductor_regions):
            require(bool(glob), f"{path}.inductor_regions[{i}]", "must be a non-empty module-path glob")
        require(not self.inductor_regions or "inductor" in self.enable, f"{path}.inductor_regions",
                "names regions for the inductor pass, which is off: add \"inductor\" to graph.enable")
        both = sorted(set(self.enable) & set(self.disable))
        require(not both, f"{path}.enable", f"passes {both} are both enabled and disabled")
        from lockstep.graph.passes import check_pass_names  # the registry names the known passes

        check_pass_names(self.enable, f"{path}.enable")
        check_pass_names(self.disable, f"{path}.disable")


def check_graph_layout(degrees: dict[str, int], activation_checkpoint: str, batch_invariant: bool) -> None:
    """Refuse, naming the field, what ``training.mode = "graph"`` cannot capture yet: tensor, context,
    pipeline and expert parallelism (their hooks and DTensor dispatch are not traced), batch-invariant
    kernels (C kernels writing through data pointers, invisible to a trace), and activation checkpointing
    other than none/full (selective's dispatch-mode caches and torch_remat do not trace; the graph's
    ``memory`` pass chooses what to save). Called by ``TrainerConfig.validate`` and by the runtime."""
    from lockstep.config.base import ConfigError

    for name in ("tp", "cp", "pp", "ep"):
        if degrees.get(name, 1) > 1:
            raise ConfigError(f"training.mode: graph supports data parallelism (dp_shard, dp_replicate) only, "
                              f"got parallel.{name}={degrees[name]}; use training.mode=eager for this layout")
    if batch_invariant:
        raise ConfigError("numerics.batch_invariant: its kernels cannot be captured in a graph; "
                          "use training.mode=eager")
    if activation_checkpoint not in ("none", "full"):
        raise ConfigError(f"training.activation_checkpoint.mode: {activation_checkpoint!r} is not supported with "
                          f"training.mode=graph (none or full; graph.memory_budget chooses what to save)")
