"""``lockstep rl --recipe NAME [--a.b.c VALUE ...]``: an RL run (trainer + generator processes).

The config resolves like ``lockstep train``'s: recipe, then field flags (``--steps``, ``--run-dir``,
``--rollout.group-size``, ``--workers.max-offpolicy-steps``, ``--numerics.batch-invariant``, ...),
validated before any work. With ``workers.generators = N >= 1`` (or a data-parallel trainer,
``--parallel.dp-shard T``) the command re-launches itself as ``T + N`` torchrun workers (ranks
0..T-1 train, the others generate); ``T = 1, N = 0`` runs in this process. A lost generator that
stops the run (``liveness``) ends the trainer with exit status 3.
"""

from __future__ import annotations

import argparse
import sys

from lockstep.config.base import ConfigError


def _parser() -> argparse.ArgumentParser:
    from lockstep.cli import add_meta_flags, add_resume_from_flag

    parser = argparse.ArgumentParser(
        prog="lockstep rl", add_help=False, allow_abbrev=False,
        description="RL post-training from a named RL recipe. Any config field can be set with --a.b.c VALUE "
        "(see --help-fields).")
    parser.add_argument("--recipe", default="rl-debug", help="RL recipe name (see `lockstep recipes`)")
    add_resume_from_flag(parser)
    return add_meta_flags(parser)


def resolve_rl_config(argv: list[str]):
    """The RLConfig ``lockstep rl argv`` would run, and the parsed meta-flags."""
    from lockstep.cli import apply_field_flags, apply_resume_from
    from lockstep.recipes import get_recipe
    from lockstep.rl.config import RLConfig

    args, rest = _parser().parse_known_args(argv)
    config = get_recipe(args.recipe).config()
    if not isinstance(config, RLConfig):
        raise ConfigError(f"--recipe: {args.recipe!r} is a training recipe; run it with "
                          f"`lockstep train --recipe {args.recipe}` (RL recipes: `lockstep recipes`)")
    config = apply_field_flags(config, rest, help_fields=args.help_fields, command="rl")
    config = apply_resume_from(config, args.resume_from)
    config.validate()
    return config, args


def cmd_rl(argv: list[str]) -> int:
    from lockstep.cli import resolve_command

    config, _, code = resolve_command(argv, _parser, resolve_rl_config)
    if code is not None:
        return code
    from lockstep.parallel.launch import finish, relaunch_with_torchrun, world_size_from_env

    if config.world_size > 1 and world_size_from_env() == 1:
        return relaunch_with_torchrun(config.world_size, ["rl", *argv])
    from lockstep.rl.heartbeat import reset_lost
    from lockstep.rl.liveness import PeerLost, peer_lost
    from lockstep.rl.loop import run_rl

    reset_lost()

    try:
        result = run_rl(config)
    except PeerLost as lost:  # the detection line is on stderr already
        _leave(3, lost.outcome or str(lost))
    if result is not None:
        _summary(result)
    if peer_lost():  # a generator was dropped: destroy_process_group could wait on it forever
        _leave(0)
    finish(0)
    return 0


def _leave(code: int, line: str = "") -> None:
    """End this process without ``destroy_process_group`` (a peer is gone; leaving must not wait on it)."""
    import os

    if line:
        print(line, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _summary(result) -> None:
    steps = result.steps
    print(f"\nrun directory: {result.run_dir}")
    if steps:
        first, last = steps[0], steps[-1]
        print(f"reward: {first['reward/mean']:.3f} (step {first['step']}) -> {last['reward/mean']:.3f} "
              f"(step {last['step']}); pass rate {first['pass_rate']:.3f} -> {last['pass_rate']:.3f}")
        print(f"logprob_diff/max over steps: {max(s['logprob_diff/max'] for s in steps):.3g}; "
              f"policy lag max {max(s['policy_lag/max'] for s in steps)}")
    for e in result.evals:
        print(f"eval (step {e['step']}{', ' + e['phase'] if 'phase' in e else ''}): pass rate "
              f"{e['eval/pass_rate']:.3f}, mean reward {e['eval/reward_mean']:.3f} over {e['eval/tasks']} held-out tasks")
    sys.stdout.flush()
