"""RL environments: one small interface (prompt -> episode -> reward) and a registry by name.

    from lockstep.rl.envs import get_environment
    env = get_environment("reasoning_gym:chain_sum")      # or "math", "math:gsm_symbolic", "calculator"
    task = env.reset(seed=3)                               # Task: chat messages + scoring data
    result = env.step(task, "... <answer>-4</answer>")     # StepResult(reward=1.0, done=True)

Built in: ``reasoning_gym:<dataset>`` and ``math[:<source>]`` (single turn,
:mod:`~lockstep.rl.envs.single_turn`), ``echo`` (dense-reward smoke test), ``calculator[:<source>]`` (multi-turn tool use,
:mod:`~lockstep.rl.envs.calculator`), ``shape_count`` (an image question,
:mod:`~lockstep.rl.envs.shape_count`). The interface is in :mod:`~lockstep.rl.envs.base`; adding an
environment is described in docs/rl.md ("Environments"). ``reasoning-gym`` and ``math-verify``
come with the ``rl`` extra and are imported only when an environment that needs them is built.
"""

from lockstep.rl.envs.base import (ANSWER_FORMATS, Environment, StepResult, Task, environment_name, extract_answer,
                                   format_instruction)
from lockstep.rl.envs.calculator import CalculatorConfig, CalculatorEnv
from lockstep.rl.envs.echo import EchoConfig, EchoEnv
from lockstep.rl.envs.registry import environment_config, get_environment, list_environments, register_environment
from lockstep.rl.envs.sandbox import EvalResult, Sandbox, SandboxConfig
from lockstep.rl.envs.shape_count import ShapeCountConfig, ShapeCountEnv
from lockstep.rl.envs.single_turn import MathConfig, ReasoningGymConfig, SingleTurnEnv
from lockstep.rl.envs.sources import ArithmeticConfig, ArithmeticSource, Problem, ReasoningGymSource, math_equal

__all__ = [
    "ANSWER_FORMATS", "ArithmeticConfig", "ArithmeticSource", "CalculatorConfig", "CalculatorEnv", "EchoConfig",
    "EchoEnv", "Environment",
    "EvalResult", "MathConfig", "Problem", "ReasoningGymConfig", "ReasoningGymSource", "Sandbox", "SandboxConfig",
    "ShapeCountConfig", "ShapeCountEnv",
    "SingleTurnEnv", "StepResult", "Task", "environment_config", "environment_name", "extract_answer",
    "format_instruction", "get_environment", "list_environments", "math_equal", "register_environment",
]
