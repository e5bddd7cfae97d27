"""Where environments get their problems and how an answer is checked.

- :class:`ArithmeticSource`: generated arithmetic with exact rational answers (integers, fractions,
  decimals), as bare expressions or short word problems; deterministic in the seed; no dependencies.
- :class:`ReasoningGymSource`: an entry of a ``reasoning-gym`` procedural dataset
  (``reasoning_gym.create_dataset(name, size=, seed=)``; entry ``seed % size``), with the dataset's
  own ``score_answer``.
- :func:`math_equal`: ``math-verify`` equivalence of two answers ("0.5" == "1/2" == "\\frac{1}{2}").

``reasoning-gym`` and ``math-verify`` come with the ``rl`` extra (``pip install -e '.[rl]'``) and
are imported on first use.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from fractions import Fraction
from typing import Any

from lockstep.config.base import Config, require, require_positive

#: what ``source`` fields accept besides a reasoning-gym dataset name
ARITHMETIC = "arithmetic"


@dataclasses.dataclass
class Problem:
    """A question, its reference answer as text, and what scoring needs."""

    question: str
    answer: str
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


def _import(module: str, package: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"{package} is needed for this environment: install the rl extra "
                          f"(pip install -c constraints.txt -e '.[rl]')") from err


def math_equal(gold: str, answer: str | None, *, timeout_s: int | None = 5) -> bool:
    """True when ``answer`` is mathematically equal to ``gold`` according to math-verify.

    Both are parsed with ``math_verify.parse`` (LaTeX, ``\\boxed{}`` or plain expressions); an answer
    that does not parse is wrong. math-verify times out with ``signal.alarm``, which only works in
    the main thread: elsewhere it runs without a timeout.
    """
    if answer is None or not answer.strip():
        return False
    math_verify = _import("math_verify", "math-verify")
    if threading.current_thread() is not threading.main_thread():
        timeout_s = None
    parsed_gold = math_verify.parse(gold, parsing_timeout=timeout_s)
    parsed = math_verify.parse(answer, parsing_timeout=timeout_s)
    if not parsed_gold or not parsed:
        return False
    return bool(math_verify.verify(parsed_gold, parsed, timeout_seconds=timeout_s))


# ------------------------------------------------------------------------------------ arithmetic


@dataclasses.dataclass(kw_only=True)
class ArithmeticConfig(Config):
    """Generated arithmetic problems with exact answers."""

    #: operands per problem: drawn uniformly in [min_terms, max_terms]
    min_terms: int = 2
    max_terms: int = 3
    #: integers are drawn in [1, max_value]
    max_value: int = 20
    #: chance that an operand is a fraction a/b (b in [2, 9]) or a one-decimal number
    fraction_prob: float = 0.0
    decimal_prob: float = 0.0
    #: chance that a two-operand problem is posed as a short word problem
    word_prob: float = 0.0

    def validate(self, path: str = "arithmetic") -> None:
        require(isinstance(self.min_terms, int) and self.min_terms >= 2, f"{path}.min_terms",
                f"must be an integer >= 2, got {self.min_terms!r}")
        require(isinstance(self.max_terms, int) and self.max_terms >= self.min_terms, f"{path}.max_terms",
                f"must be an integer >= min_terms ({self.min_terms}), got {self.max_terms!r}")
        require_positive(self.max_value, f"{path}.max_value")
        for name in ("fraction_prob", "decimal_prob", "word_prob"):
            value = getattr(self, name)
            require(0 <= value <= 1, f"{path}.{name}", f"must be in [0, 1], got {value!r}")
        require(self.fraction_prob + self.decimal_prob <= 1, f"{path}.fraction_prob",
                f"fraction_prob + decimal_prob must be <= 1, got {self.fraction_prob + self.decimal_prob}")

    def build(self) -> "ArithmeticSource":
        return ArithmeticSource(self)


#: word problems for ``a op b``: (operator, template)
_WORD_TEMPLATES = [
    ("+", "A shop has {a} apples and receives {b} more. How many apples does it have now?"),
    ("-", "A tank holds {a} litres of water and {b} litres are drained. How many litres are left?"),
    ("*", "There are {a} boxes with {b} pencils in each. How many pencils are there in total?"),
    ("/", "{a} kilograms of rice are shared equally among {b} families. How many kilograms does each get?"),
]


def format_fraction(value: Fraction) -> str:
    """``3``, ``-7/4``: the exact answer as text."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


class ArithmeticSource:
    """Problem ``seed`` of :class:`ArithmeticConfig`: a ``random.Random(seed)`` draw, answered exactly."""

    def __init__(self, config: ArithmeticConfig) -> None:
        config.validate()
        self.config = config

    def _operand(self, rng: random.Random) -> tuple[Fraction, str]:
        c, u = self.config, rng.random()
        if u < c.fraction_prob:
            num, den = rng.randint(1, 9), rng.randint(2, 9)
            return Fraction(num, den), f"({num}/{den})"  # parenthesised: "2 / (3/4)" is unambiguous
        if u < c.fraction_prob + c.decimal_prob:
            tenths = rng.randint(1, 10 * c.max_value)
            return Fraction(tenths, 10), f"{tenths / 10:.1f}"
        n = rng.randint(1, c.max_value)
        return Fraction(n), str(n)

    def problem(self, seed: int) -> Problem:
        rng = random.Random(seed)
        c = self.config
        if c.word_prob and rng.random() < c.word_prob:
            op, template = rng.choice(_WORD_TEMPLATES)
            a, b = rng.randint(2, c.max_value), rng.randint(2, c.max_value)
            if op == "-":
                a, b = max(a, b), min(a, b)
            value = {"+": Fraction(a + b), "-": Fraction(a - b), "*": Fraction(a * b), "/": Fraction(a, b)}[op]
            return Problem(template.format(a=a, b=b), format_fraction(value), {"expression": f"{a} {op} {b}"})
        while True:
            terms = [self._operand(rng) for _ in range(rng.randint(c.min_terms, c.max_terms))]
            ops = [rng.choice("+-*/") for _ in terms[1:]]
            expression = " ".join([terms[0][1]] + [f"{o} {t[1]}" for o, t in zip(ops, terms[1:])])
            value = _evaluate_exact(terms, ops)
            if value is not None:
                return Problem(f"Compute {expression}.", format_fraction(value), {"expression": expression})


def _evaluate_exact(terms: list[tuple[Fraction, str]], ops: list[str]) -> Fraction | None:
    """Value of ``t0 o1 t1 ...`` with * and / before + and -; None on division by zero."""
    sums: list[Fraction] = [terms[0][0]]
    signs: list[int] = [1]
    for op, (value, _) in zip(ops, terms[1:]):
        if op in "+-":
            sums.append(value)
            signs.append(1 if op == "+" else -1)
        elif op == "*":
            sums[-1] *= value
        else:
            if value == 0:
                return None
            sums[-1] /= value
    return sum((s * v for s, v in zip(signs, sums)), Fraction(0))


# ---------------------------------------------------------------------------------- reasoning-gym


class ReasoningGymSource:
    """Entry ``seed % size`` of ``reasoning_gym.create_dataset(dataset, size=size, seed=seed, **kwargs)``."""

    def __init__(self, dataset: str, *, size: int = 100_000, seed: int = 0,
                 kwargs: dict[str, Any] | None = None) -> None:
        reasoning_gym = _import("reasoning_gym", "reasoning-gym")
        try:
            self.dataset = reasoning_gym.create_dataset(dataset, size=size, seed=seed, **(kwargs or {}))
        except ValueError as err:  # "Dataset 'x' not registered", or a bad dataset option
            raise ValueError(f"dataset: reasoning-gym cannot create {dataset!r}: {err}") from err
        self.name, self.size = dataset, size

    def problem(self, seed: int) -> Problem:
        entry = self.dataset[seed % self.size]
        return Problem(str(entry["question"]), str(entry["answer"]), {"entry": entry})

    def score(self, problem: Problem, answer: str | None) -> float:
        """The dataset's own ``score_answer`` (in [0, 1]; some datasets give partial credit)."""
        return float(self.dataset.score_answer(answer, problem.data["entry"]))


def check_reasoning_gym_dataset(name: str, field: str) -> None:
    """ConfigError naming ``field`` unless ``name`` is a reasoning-gym dataset (when it is installed)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        return  # checked again when the environment is built, with the install hint
    require(name in DATASETS, field, f"{name!r} is neither {ARITHMETIC!r} nor a reasoning-gym dataset "
            f"(some are {sorted(DATASETS)[:8]} ...; see reasoning_gym.factory.DATASETS)")
