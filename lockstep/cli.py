"""``lockstep`` command line: ``recipes``, ``train`` (recipe + transforms + overrides + field flags),
``convert``, ``plan``, ``generate`` and ``chat`` (see :mod:`lockstep.cli_generate`).

``lockstep rl`` (see :mod:`lockstep.cli_rl`); ``lockstep serve`` (see :mod:`lockstep.serve.cli`).

``lockstep train --recipe NAME [--transform T ...] [--override PATTERN=KIND,...] [--a.b.c VALUE ...]``
resolves the config in that order (recipe, transforms, field flags, overrides), validates it before
any work, and runs the trainer. ``--print-config`` prints the resolved tree and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from lockstep.checkpoint.format import CheckpointError
from lockstep.config.base import ConfigError, to_dict
from lockstep.models.hf.verified import WeightsError
from lockstep.run.directory import FilesystemError
from lockstep.run.nonfinite import NonFiniteError


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lockstep train",
        description="Train a model from a named recipe. Any config field can be set with --a.b.c VALUE "
        "(see --help-fields).",
        add_help=False, allow_abbrev=False,  # else --resume would abbreviate --resume-from
    )
    parser.add_argument("--recipe", default="shakespeare", help="recipe name (see `lockstep recipes`)")
    parser.add_argument("--transform", action="append", default=[], metavar="NAME[=ARG]",
                        help="model-config transform, applied in order (see `lockstep recipes`)")
    parser.add_argument("--override", action="append", default=[], metavar="PATTERN=KIND[,f=v...]",
                        help="replace the config of modules matching a glob, e.g. "
                        "'layers.*.attention=attention,backend=reference'")
    parser.add_argument("--nproc", type=int, default=1,
                        help="run as N local torchrun workers (gloo on CPU, NCCL on GPU)")
    parser.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                        help="save a full-state checkpoint every N steps and at the end (= --checkpoint.every)")
    add_resume_from_flag(parser)
    return add_meta_flags(parser)


def add_resume_from_flag(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--resume-from STEP``: --resume from that step's checkpoint (= --resume --checkpoint.resume-from STEP)."""
    parser.add_argument("--resume-from", type=int, default=None, metavar="STEP",
                        help="resume from this step's checkpoint instead of the newest that verifies "
                        "(= --resume --checkpoint.resume-from STEP; newer checkpoints are moved aside, not deleted)")
    return parser


def apply_resume_from(config, step: int | None):
    """``config`` with ``--resume-from STEP`` applied (resume on, checkpoint.resume_from = STEP)."""
    if step is None:
        return config
    return dataclasses.replace(config, resume=True,
                               checkpoint=dataclasses.replace(config.checkpoint, resume_from=step))


def add_meta_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--print-config, --help-fields and -h/--help, shared by the config-driven commands."""
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--help-fields", action="store_true", help="list every config field flag and exit")
    parser.add_argument("-h", "--help", action="store_true")
    return parser


def resolve_config(argv: list[str]):
    """The TrainerConfig that ``lockstep train argv`` would run, and the parsed meta-flags."""
    from lockstep.config.components import parse_override
    from lockstep.recipes import get_recipe
    from lockstep.recipes.transforms import apply_transform
    from lockstep.train.config import TrainerConfig

    args, rest = _train_parser().parse_known_args(argv)
    config = get_recipe(args.recipe).config()
    if not isinstance(config, TrainerConfig):
        raise ConfigError(f"--recipe: {args.recipe!r} is an RL recipe; run it with `lockstep rl --recipe {args.recipe}`")
    for spec in args.transform:
        config = apply_transform(config, spec)
    overrides = config.model.overrides
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, overrides=[]))
    config = apply_field_flags(config, rest, help_fields=args.help_fields, command="train")
    if args.checkpoint_every is not None:
        config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint,
                                                                            every=args.checkpoint_every))
    config = apply_resume_from(config, args.resume_from)
    model = config.model
    parsed = [parse_override(spec, bases=[model.attention, model.feed_forward, model.norm])
              for spec in args.override]
    config = dataclasses.replace(config, model=dataclasses.replace(model, overrides=[*overrides, *parsed]))
    config.validate()
    return config, args


def apply_field_flags(config, flags: list[str], *, help_fields: bool, command: str):
    """``config`` with field flags (``--a.b.c VALUE``) applied by tyro, after checking each flag
    names a field of the config's class (``--help-fields`` prints them all)."""
    import tyro

    field_args = flags + (["--help"] if help_fields else [])
    if not field_args:
        return config
    unknown = _unknown_flags(field_args, type(config))
    if unknown:
        raise ConfigError(f"unknown flag(s) {unknown}; see `lockstep {command} --help-fields`")
    return tyro.cli(type(config), default=config, args=field_args, prog=f"lockstep {command}")


def _unknown_flags(args: list[str], root: type | None = None) -> list[str]:
    """Flags that name no field of ``root`` (default TrainerConfig; tyro's own message is long;
    ours names them)."""
    from lockstep.train.config import TrainerConfig

    known = set(_field_flags(root or TrainerConfig, "")) | {"--help", "-h"}
    flags = [a.split("=", 1)[0] for a in args if a.startswith("-") and not _is_number(a)]
    return [f for f in flags if f.replace("_", "-") not in known]


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _field_flags(cls: type, prefix: str) -> list[str]:
    import typing

    flags = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        name = f"{prefix}{field.name}".replace("_", "-")
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            flags += _field_flags(hint, f"{prefix}{field.name}.")
            for sub in _subclass_fields(hint):
                flags += _field_flags(sub, f"{prefix}{field.name}.")
        else:
            head, _, leaf = name.rpartition(".")
            negated = f"--{head}.no-{leaf}" if head else f"--no-{leaf}"
            flags += [f"--{name}", negated] if hint is bool else [f"--{name}"]
    return flags


def _subclass_fields(cls: type) -> list[type]:
    return [s for s in cls.__subclasses__() if dataclasses.is_dataclass(s)]


def resolve_command(argv: list[str], parser_fn, resolve_fn):
    """``(config, args, None)`` for a config-driven command, or ``(None, None, 0)`` when it only
    printed its help (``-h``) or its resolved config (``--print-config``)."""
    args, _ = parser_fn().parse_known_args(argv)
    if args.help:
        parser_fn().print_help()
        return None, None, 0
    config, args = resolve_fn(argv)
    if args.print_config:
        print(json.dumps(to_dict(config), indent=2))
        return None, None, 0
    return config, args, None


def cmd_train(argv: list[str]) -> int:
    config, args, code = resolve_command(argv, _train_parser, resolve_config)
    if code is not None:
        return code
    from lockstep.parallel.launch import finish, relaunch_with_torchrun, world_size_from_env

    if args.nproc > 1 and world_size_from_env() == 1:
        return relaunch_with_torchrun(args.nproc, ["train", *_without_nproc(argv)])
    from lockstep.train.trainer import Trainer

    trainer = Trainer(config)
    if trainer.resumed and trainer.runtime.is_main:
        r = trainer.resumed
        print(f"resuming {trainer.run_dir} from the step {r['from_step']} checkpoint in {r['storage']} "
              f"(saved by {r['saved_world_size']} rank(s), now {r['world_size']})", flush=True)
    result = trainer.fit()
    if not trainer.runtime.is_main:
        finish(0)
        return 0
    first, last = result.val_losses.get(0), result.val_losses.get(max(result.val_losses, default=0))
    print(f"\nrun directory: {result.run_dir}")
    if result.losses:
        print(f"final train loss: {result.losses[-1]:.4f}")
    if first is not None and last is not None:
        print(f"validation loss: {first:.4f} -> {last:.4f}")
    if result.sample:
        print(f"sample (greedy):\n{result.sample}")
    finish(0)
    return 0


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def cmd_recipes(argv: list[str]) -> int:
    from lockstep.recipes import recipes
    from lockstep.recipes.transforms import transform_names

    print("recipes (lockstep train --recipe NAME):")
    for r in recipes():
        if r.kind == "train":
            print(f"  {r.name:<20} {r.description}")
    print("\nRL recipes (lockstep rl --recipe NAME):")
    for r in recipes():
        if r.kind == "rl":
            print(f"  {r.name:<20} {r.description}")
    print("\ntransforms (--transform NAME[=ARG]):")
    for name, doc in transform_names().items():
        print(f"  {name:<20} {doc}")
    return 0


def cmd_convert(argv: list[str]) -> int:
    from lockstep.models.hf.convert import cmd_convert as convert

    return convert(argv)


def cmd_plan(argv: list[str]) -> int:
    from lockstep.parallel.plan import cmd_plan as plan

    return plan(argv)


def cmd_generate(argv: list[str]) -> int:
    from lockstep.cli_generate import cmd_generate as generate

    return generate(argv)


def cmd_chat(argv: list[str]) -> int:
    from lockstep.cli_generate import cmd_chat as chat

    return chat(argv)


def cmd_serve(argv: list[str]) -> int:
    from lockstep.serve.cli import cmd_serve as serve

    return serve(argv)


def cmd_rl(argv: list[str]) -> int:
    from lockstep.cli_rl import cmd_rl as rl

    return rl(argv)


COMMANDS = {"train": cmd_train, "rl": cmd_rl, "recipes": cmd_recipes, "convert": cmd_convert, "plan": cmd_plan,
            "generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: lockstep {" + ",".join(COMMANDS) + "} ...")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"lockstep: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    try:
        return COMMANDS[argv[0]](argv[1:])
    except WeightsError as err:  # a ConfigError: caught first for its own label
        print(f"lockstep: weights error: {err}", file=sys.stderr)
        return 2
    except ConfigError as err:
        print(f"lockstep: config error: {err}", file=sys.stderr)
        return 2
    except CheckpointError as err:
        print(f"lockstep: checkpoint error: {err}", file=sys.stderr)
        return 2
    except NonFiniteError as err:
        print(f"lockstep: training stopped: {err}", file=sys.stderr)
        return 1
    except FilesystemError as err:
        print(f"lockstep: filesystem error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
