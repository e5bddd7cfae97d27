"""The family x layout matrix of docs/parallelism.md, from the tested layouts and lockstep's refusals.

``python -m lockstep.parallel.plan.matrix`` prints it as Markdown: a cell names the loss-parity
test(s) of :data:`lockstep.parallel.tested_layouts.TESTED_LAYOUTS` proving that family under that
combination of degrees, or the ConfigError lockstep raises for it (asked of the code itself: the
degrees via ``ParallelConfig.resolve``, a debug model's layers via the EP, CP and PP checks), or
"untested" when lockstep would run it but no parity test covers it.
"""

from __future__ import annotations

import re

FAMILIES = ("llama3", "qwen3", "qwen3_moe", "deepseek_v3", "qwen3_next", "qwen3_5", "gpt_oss")
#: a debug flavor per family with MoE layers where the family has them (EP needs them)
DEBUG_FLAVOR = {"qwen3_5": "debug-moe"}
#: column -> degrees of a representative layout (world = product)
COMBOS: dict[str, dict[str, int]] = {
    "dp_shard": {"dp_shard": 2},
    "hsdp": {"dp_replicate": 2, "dp_shard": 2},
    "tp": {"tp": 2},
    "pp": {"pp": 2},
    "cp": {"cp": 2},
    "ep": {"dp_shard": 2, "ep": 2},
    "dp_shard x tp": {"dp_shard": 2, "tp": 2},
    "tp x ep": {"dp_shard": 2, "ep": 2, "tp": 2},
    "hsdp x ep": {"dp_replicate": 2, "dp_shard": 2, "ep": 2},
    "ep over dp_shard x cp": {"dp_shard": 2, "cp": 2, "ep": 4},
    "cp x tp": {"cp": 2, "tp": 2},
    "pp x tp": {"pp": 2, "tp": 2},
    "pp x ep": {"pp": 2, "dp_shard": 2, "ep": 2},
    "pp x dp_shard": {"pp": 2, "dp_shard": 2},
    "pp x dp_shard x tp": {"pp": 2, "dp_shard": 2, "tp": 2},
    "pp x dp_shard x ep": {"pp": 2, "dp_shard": 4, "ep": 2},
    "cp x pp": {"cp": 2, "pp": 2},
}


def combo_of(world: int, degrees: dict) -> str:
    """The matrix column of a tested layout's degrees."""
    d = {k: degrees.get(k, 1) for k in ("dp_replicate", "tp", "pp", "cp", "ep")}
    d["dp_shard"] = degrees.get("dp_shard", world // (d["dp_replicate"] * d["tp"] * d["pp"] * d["cp"]))
    parts = []
    if d["pp"] > 1:
        parts.append("pp")
    if d["dp_replicate"] > 1:
        parts.append("hsdp")
    if d["ep"] > 1 and d["cp"] > 1:
        return "ep over dp_shard x cp"
    if d["dp_shard"] > 1 and (d["ep"] == 1 or d["dp_shard"] > d["ep"]) and d["dp_replicate"] == 1 and (
            d["tp"] > 1 or d["pp"] > 1 or d["ep"] > 1) and not (d["tp"] > 1 and d["ep"] > 1):
        parts.append("dp_shard")
    if d["cp"] > 1:
        parts.append("cp")
    if d["tp"] > 1:
        parts.append("tp")
    if d["ep"] > 1:
        parts.append("ep")
    if not parts:
        return "hsdp" if d["dp_replicate"] > 1 else "dp_shard"
    key = " x ".join(parts)
    return {"cp x pp": "cp x pp", "pp x cp": "cp x pp", "hsdp": "hsdp"}.get(key, key)


def _refusal(family: str, degrees: dict) -> str:
    """lockstep's ConfigError for ``family`` under ``degrees`` ('' when it would run)."""
    import math

    import torch

    from lockstep.config.base import ConfigError
    from lockstep.models.common.moe import MoE
    from lockstep.models.common.transformer import build_meta_model
    from lockstep.models.registry import model_config
    from lockstep.parallel.context import refuse_unsupported_mixers
    from lockstep.parallel.dims import ParallelConfig
    from lockstep.parallel.pipeline_stage import check_splittable

    world = math.prod(degrees.values()) // (degrees["ep"] if "ep" in degrees and degrees.get("cp", 1) == 1 else 1)
    if degrees.get("cp", 1) > 1 and "ep" in degrees:
        world = degrees["dp_shard"] * degrees["cp"]
    try:
        ParallelConfig(**degrees).resolve(world)
        cfg = model_config(family, DEBUG_FLAVOR.get(family, "debug"))
        with torch.device("meta"):
            model = build_meta_model(cfg)
        if degrees.get("ep", 1) > 1 and not any(isinstance(m, MoE) for m in model.modules()):
            raise ConfigError(f"parallel.ep: {degrees['ep']} needs MoE layers, but the model has none")
        if degrees.get("cp", 1) > 1:
            refuse_unsupported_mixers(model)
        if degrees.get("pp", 1) > 1:
            try:
                check_splittable(model)
            except ValueError as err:
                raise ConfigError(str(err)) from None
    except ConfigError as err:
        return str(err)
    return ""


def matrix() -> str:
    """The Markdown matrix (rows: combinations, columns: families)."""
    from lockstep.parallel.tested_layouts import TESTED_LAYOUTS
    from lockstep.recipes import get_recipe

    tested: dict[tuple[str, str], list[str]] = {}
    extra: list[str] = []
    for test_id, recipe, world, degrees, _ in TESTED_LAYOUTS:
        family = get_recipe(recipe).config().model.family
        combo = combo_of(world, degrees)
        if combo not in COMBOS and combo not in extra:
            extra.append(combo)
        tested.setdefault((family, combo), []).append(test_id)
    lines = ["| combination | " + " | ".join(FAMILIES) + " |", "|---" * (len(FAMILIES) + 1) + "|"]
    refusals: list[str] = []
    for combo in list(COMBOS) + extra:
        cells = []
        for family in FAMILIES:
            ids = tested.get((family, combo))
            if ids:
                cells.append("tested: " + ", ".join(f"`{i}`" for i in ids))
                continue
            why = _refusal(family, COMBOS[combo]) if combo in COMBOS else ""
            if why:
                generic = re.sub(r"parallel\.ep: \d+", "parallel.ep: N", why.replace(family, "FAMILY"))
                if generic not in refusals:
                    refusals.append(generic)
                cells.append(f"refused (R{refusals.index(generic) + 1})")
            else:
                cells.append("untested")
        lines.append(f"| {combo} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"- R{i + 1}: `{text}`" for i, text in enumerate(refusals)]
    return "\n".join(lines)

if __name__ == "__main__":
    print(matrix())
