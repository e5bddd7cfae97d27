"""``lockstep plan``: the command line (arguments, recipe defaults, text or JSON output)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from lockstep.config.base import ConfigError
from lockstep.parallel.checkpointing import ActivationCheckpointConfig
from lockstep.parallel.plan.build import Plan, build_plan
from lockstep.parallel.plan.layout import AC_MODES, SCHEDULES, Layout, flag_error
from lockstep.parallel.plan.verify import verify_fsdp


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lockstep plan", description=(
        "Scale dry run: per-rank memory and per-step collectives of a parallel layout, from a meta-device "
        "build of the model (nothing is allocated)."))
    src = p.add_argument_group("model")
    src.add_argument("--recipe", help="take model, batch, seq-len, dtypes and degrees from a recipe")
    src.add_argument("--family", help="model family (llama3, qwen3, qwen3_moe, deepseek_v3, qwen3_next, qwen3_5, "
                     "gpt_oss)")
    src.add_argument("--flavor", help="flavor of the family, e.g. 8B, 70B, 30B-A3B, 671B, kimi_k2")
    lay = p.add_argument_group("layout (world = pp x dp_replicate x dp_shard x cp x tp; ep inside dp_shard "
                               "or spanning dp_shard x cp)")
    lay.add_argument("--world", type=int, help="number of ranks (required unless a recipe's degrees multiply to it)")
    lay.add_argument("--pp", type=int, default=None, help="pipeline stages (default 1)")
    lay.add_argument("--dp-replicate", type=int, default=None, help="HSDP replicas (default 1)")
    lay.add_argument("--dp-shard", type=int, default=None, help="FSDP shards; -1 = the rest (default)")
    lay.add_argument("--tp", type=int, default=None, help="tensor parallel degree (default 1)")
    lay.add_argument("--ep", type=int, default=None,
                     help="expert parallel degree: divides dp-shard, or equals dp-shard x cp (default 1)")
    lay.add_argument("--cp", type=int, default=None, help="context parallel degree (default 1)")
    lay.add_argument("--cp-method", choices=("allgather", "ring"), default=None, help="cp K/V exchange")
    run = p.add_argument_group("step")
    run.add_argument("--seq-len", type=int, help="tokens per sequence (default: recipe, else min(4096, max_seq_len))")
    run.add_argument("--batch-size", type=int, help="global sequences per optimizer step")
    run.add_argument("--microbatches", type=int, help="micro-batches per step per dp rank (default: pp, or 1)")
    run.add_argument("--pp-schedule", default=None, choices=SCHEDULES, help="pipeline schedule (default 1F1B)")
    run.add_argument("--pp-split", default=None, help="layers per stage: even, cost, or e.g. 31,30")
    run.add_argument("--param-dtype", help="stored parameter dtype: bf16 or fp32 (default fp32)")
    run.add_argument("--grad-dtype", help="gradient / reduction dtype: bf16 or fp32 (default fp32)")
    run.add_argument("--compute-dtype", help="FSDP all-gather + activation dtype (default: bf16)")
    run.add_argument("--no-master-weights", action="store_true", help="no fp32 master copy for bf16 params")
    run.add_argument("--activation-checkpoint", choices=AC_MODES)
    run.add_argument("--activation-checkpoint-save", nargs="+", metavar="GLOB",
                     help="mode regions: module-path globs / op kinds kept (training.activation_checkpoint.save)")
    run.add_argument("--reshard-after-forward", choices=("always", "never"))
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    out.add_argument("--verify-fsdp", action="store_true",
                     help="also build the worst stage under a fake process group and check shard shapes")
    out.add_argument("--verify-stage", type=int, help="stage to verify (default: the worst)")
    return p


def plan_from_args(argv: list[str]) -> tuple[Plan, Any, argparse.Namespace]:
    """Parse ``lockstep plan`` arguments into (plan, model config, args); raises ConfigError."""
    args = _parser().parse_args(argv)
    defaults: dict[str, Any] = {}
    if args.recipe:
        if args.family or args.flavor:
            flag_error("--recipe", "give either --recipe or --family/--flavor, not both")
        from lockstep.recipes import get_recipe

        cfg = get_recipe(args.recipe).config()
        config = cfg.model
        par = cfg.parallel
        defaults = dict(dp_replicate=par.dp_replicate, dp_shard=par.dp_shard, tp=par.tp, ep=par.ep, cp=par.cp,
                        pp=par.pp, pp_schedule=par.pp_schedule, pp_split=par.pp_split, cp_method=par.cp_method,
                        recipe_microbatches=par.pp_microbatches or None,
                        seq_len=cfg.training.seq_len, batch_size=cfg.training.batch_size * cfg.training.grad_accum,
                        microbatches=cfg.training.grad_accum,
                        compute_dtype="bf16" if "bfloat16" in (cfg.training.dtype, par.fsdp_param_dtype) else "fp32",
                        activation_checkpoint=cfg.training.activation_checkpoint,
                        reshard_after_forward=par.reshard_after_forward
                        if par.reshard_after_forward in ("always", "never") else "always")
    else:
        if not (args.family and args.flavor):
            flag_error("--family", "give --recipe NAME, or --family F and --flavor V")
        from lockstep.models.registry import model_config

        config = model_config(args.family, args.flavor)
    if args.world is None:
        flag_error("--world", "the number of ranks is required")

    def pick(name: str, fallback: Any) -> Any:
        value = getattr(args, name)
        return value if value is not None else defaults.get(name, fallback)

    layout = Layout(world=args.world, pp=pick("pp", 1), dp_replicate=pick("dp_replicate", 1),
                    dp_shard=pick("dp_shard", -1), tp=pick("tp", 1), ep=pick("ep", 1), cp=pick("cp", 1))
    microbatches = pick("microbatches", None)
    if args.recipe and args.microbatches is None and layout.pp > 1:
        microbatches = defaults.get("recipe_microbatches")  # grad_accum is a no-PP setting: pp_microbatches or PP's choice
    plan = build_plan(
        config, layout, seq_len=pick("seq_len", min(4096, config.max_seq_len)), batch_size=pick("batch_size", None),
        microbatches=microbatches, param_dtype=pick("param_dtype", "fp32"), grad_dtype=pick("grad_dtype", "fp32"),
        compute_dtype=pick("compute_dtype", "bf16"), master_weights=not args.no_master_weights,
        activation_checkpoint=_activation_checkpoint(args, defaults), pp_schedule=pick("pp_schedule", "1F1B"),
        reshard_after_forward=pick("reshard_after_forward", "always"), pp_split=pick("pp_split", "even"),
        cp_method=pick("cp_method", "allgather"))
    if args.recipe:
        refusal = _image_refusal(cfg, layout)
        if refusal:
            plan.notes.append(f"lockstep's trainer refuses this layout today: {refusal}")
    return plan, config, args


def _image_refusal(cfg: Any, layout: Layout) -> str:
    """Why lockstep's trainer refuses ``layout`` for a recipe training on image+text batches ('' if it
    does not, or the recipe trains on text): the config check ``lockstep train`` runs."""
    from lockstep.data.image_mix import check_image_training
    from lockstep.parallel.dims import ParallelConfig
    from lockstep.parallel.tested_layouts import trains_on_images

    if not trains_on_images(cfg):
        return ""
    try:
        check_image_training(cfg.data, cfg.model, ParallelConfig(tp=layout.tp, cp=layout.cp, pp=layout.pp),
                             cfg.training.mode)
    except ConfigError as err:
        return str(err)
    return ""


def _activation_checkpoint(args: argparse.Namespace, defaults: dict[str, Any]) -> ActivationCheckpointConfig:
    """The recipe's section, with ``--activation-checkpoint`` / ``--activation-checkpoint-save`` applied."""
    base = defaults.get("activation_checkpoint") or ActivationCheckpointConfig()
    mode = args.activation_checkpoint or base.mode
    if args.activation_checkpoint_save is not None:
        save = list(args.activation_checkpoint_save)
    else:
        save = list(base.save) if mode == base.mode else []
    if save and mode != "regions":
        flag_error("--activation-checkpoint-save", f"names save regions of mode 'regions', but the mode is {mode!r}")
    return ActivationCheckpointConfig(mode=mode, save=save)


def cmd_plan(argv: list[str]) -> int:
    """``lockstep plan ...``: print the plan (text or ``--json``); 0 on success, 1 if verification
    found mismatches or failed. ConfigError propagates (``lockstep`` prints it and returns 2)."""
    plan, config, args = plan_from_args(argv)
    rc = 0
    if args.verify_fsdp:
        try:
            plan.verify = verify_fsdp(plan, config, args.verify_stage)
        except ConfigError:
            raise
        except Exception as err:  # report why the real build failed instead of a traceback
            plan.verify = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        rc = 0 if plan.verify.get("ok") else 1
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(plan.format())
    return rc


def main(argv: list[str] | None = None) -> int:
    import sys

    try:
        return cmd_plan(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        print(f"lockstep plan: config error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
