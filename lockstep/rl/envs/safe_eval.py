"""A calculator: arithmetic expressions evaluated from a whitelisted Python AST, with size limits.

Only these are accepted (anything else is an :class:`EvalError` naming the construct, before any
evaluation): int and float literals; ``+ - * / // % **``, ``<< >>`` and unary ``+ -``;
parentheses; the constants ``pi``, ``e``, ``tau``; calls of the functions in :data:`FUNCTIONS` with
positional arguments. No names, attributes, subscripts, strings, comprehensions, lambdas or keyword
arguments can be written, so an expression can reach no object but numbers and those functions.

Limits (:class:`Limits`): the source length, the number of AST nodes, and the size of every integer
(``max_int_bits``), so time and memory stay small. The audit of what can grow an integer:

- refused *before* it runs when the result would be too large: ``*``, ``**`` (``int.__pow__``; there
  is no ``pow()``, so no 3-argument form), ``<<``, ``factorial``; ``round(n, -k)`` of an integer
  (Python computes ``10**k``): when ``10**k`` is over the limit the result is 0 (|n| < 10**k / 2),
  returned without computing it;
- checked after it runs, its cost being bounded by its (limited) arguments: ``+ -``, ``lcm``
  (<= the product's bits), ``floor``/``ceil``/``round`` of a float (<= 1024 bits), integer literals;
- cannot grow an integer: ``/`` (a float), ``// % >>``, ``abs``, ``min``, ``max``, ``gcd`` and the
  float functions; float overflow is an error. Complex results (``(-8) ** 0.5``) are refused.
- no strings or sequences exist, so no repetition and no ``int(str)``.

Every integer any operation produces is checked against the limit (``bit_length`` is O(1)).
``lockstep.rl.envs.sandbox`` can also run this file as a separate process under a hard time limit
and ``RLIMIT_AS`` memory limit (``python -I -S safe_eval.py`` reads ``{"expr", "limits",
"memory_mb", "cpu_s"}`` JSON on stdin and writes ``{"ok", "value" | "error"}``); it imports only the
standard library for that reason.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any

#: callable names -> (function, number of arguments: an int, or (min, max))
FUNCTIONS: dict[str, tuple[Callable[..., Any], int | tuple[int, int]]] = {
    "abs": (abs, 1), "round": (round, (1, 2)), "min": (min, (2, 16)), "max": (max, (2, 16)),
    "sqrt": (math.sqrt, 1), "exp": (math.exp, 1), "log": (math.log, (1, 2)), "log2": (math.log2, 1),
    "log10": (math.log10, 1), "sin": (math.sin, 1), "cos": (math.cos, 1), "tan": (math.tan, 1),
    "floor": (math.floor, 1), "ceil": (math.ceil, 1), "factorial": (math.factorial, 1),
    "gcd": (math.gcd, 2), "lcm": (math.lcm, 2),
}
CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau}
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
           ast.LShift: operator.lshift, ast.RShift: operator.rshift}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
#: names for refused constructs in error messages
_DESCRIBE = {ast.Attribute: "attribute access", ast.Subscript: "subscripts", ast.Lambda: "lambda",
             ast.Compare: "comparisons", ast.BoolOp: "and/or", ast.IfExp: "conditional expressions",
             ast.List: "lists", ast.Tuple: "tuples", ast.Dict: "dicts", ast.Set: "sets",
             ast.ListComp: "comprehensions", ast.GeneratorExp: "comprehensions", ast.JoinedStr: "strings",
             ast.NamedExpr: "assignment", ast.Starred: "starred arguments", ast.Await: "await"}


class EvalError(ValueError):
    """The expression is refused or fails; the message is what the model is told."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What an expression may cost."""

    #: longest accepted expression, in characters
    max_chars: int = 500
    #: most AST nodes
    max_nodes: int = 200
    #: largest integer result (bits) of any operation; 0 = unlimited (then only a process limit helps)
    max_int_bits: int = 4096


def parse_expression(source: str, limits: Limits = Limits()) -> ast.Expression:
    """The checked AST of ``source``; EvalError on a syntax error or anything not whitelisted."""
    if not isinstance(source, str):
        raise EvalError(f"expected an expression string, got {type(source).__name__}")
    source = source.strip()
    if not source:
        raise EvalError("empty expression")
    if len(source) > limits.max_chars:
        raise EvalError(f"expression too long ({len(source)} > {limits.max_chars} characters)")
    try:
        tree = ast.parse(source.replace("^", "**"), mode="eval")
    except SyntaxError as err:
        raise EvalError(f"syntax error: {err.msg}") from None
    nodes = list(ast.walk(tree))
    if len(nodes) > limits.max_nodes:
        raise EvalError(f"expression too complex ({len(nodes)} > {limits.max_nodes} nodes)")
    for node in nodes:
        _check_node(node)
        if isinstance(node, ast.Constant):
            _check_result(node.value, limits, "the number")
    return tree


def _check_node(node: ast.AST) -> None:
    if isinstance(node, (ast.Expression, ast.Load, ast.operator, ast.unaryop)):
        if isinstance(node, ast.operator) and type(node) not in _BINARY:
            raise EvalError(f"operator {type(node).__name__} is not allowed")
        if isinstance(node, ast.unaryop) and type(node) not in _UNARY:
            raise EvalError(f"operator {type(node).__name__} is not allowed")
        return
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        return
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise EvalError(f"only numbers are allowed, got {type(node.value).__name__} {node.value!r:.20}")
        return
    if isinstance(node, ast.Name):
        if node.id not in CONSTANTS and node.id not in FUNCTIONS:
            raise EvalError(f"unknown name {node.id!r} (constants: {sorted(CONSTANTS)}; functions: "
                            f"{sorted(FUNCTIONS)})")
        return
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            what = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)
            raise EvalError(f"unknown function {what!r} (functions: {sorted(FUNCTIONS)})")
        if node.keywords:
            raise EvalError("keyword arguments are not allowed")
        return
    what = _DESCRIBE.get(type(node), type(node).__name__)
    raise EvalError(f"{what} not allowed in a calculator expression")


def evaluate(source: str, limits: Limits = Limits()) -> int | float:
    """The value of ``source`` (see the module docstring); EvalError on anything refused or failing."""
    tree = parse_expression(source, limits)
    try:
        return _eval(tree.body, limits)
    except EvalError:
        raise
    except ZeroDivisionError:
        raise EvalError("division by zero") from None
    except OverflowError:
        raise EvalError("number too large (overflow)") from None
    except (ValueError, TypeError) as err:
        raise EvalError(f"math error: {err}") from None
    except MemoryError:
        raise EvalError("memory limit exceeded") from None
    except RecursionError:
        raise EvalError("expression nested too deeply") from None


def _bits(x: int | float) -> int:
    return abs(int(x)).bit_length() if isinstance(x, int) else 0


def _too_big(bits: float, limits: Limits, what: str) -> None:
    if limits.max_int_bits and bits > limits.max_int_bits:
        raise EvalError(f"result too large ({what} would have ~{int(bits)} bits > {limits.max_int_bits})")


def _check_result(value: Any, limits: Limits, what: str) -> Any:
    """``value`` when it is a real number within the integer size limit; EvalError otherwise."""
    if isinstance(value, complex):
        raise EvalError(f"math error: {what} is not a real number")
    if isinstance(value, int):
        _too_big(_bits(value), limits, what)
    return value


def _round_to_zero(args: list[Any], limits: Limits) -> bool:
    """Whether ``round(n, ndigits)`` of an integer would compute ``10**-ndigits`` over the size
    limit; its result is then 0 (every integer here is under the limit, so |n| < 10**-ndigits / 2)."""
    if len(args) != 2 or not limits.max_int_bits or not all(isinstance(a, int) for a in args):
        return False
    # 10**k has over max_int_bits + 1 bits when k > (max_int_bits + 1) * log10(2) + 1
    if -args[1] <= (limits.max_int_bits + 1) * math.log10(2) + 1:
        return False
    _too_big(_bits(args[0]), limits, "the rounded number")  # cannot fire: checked when it was made
    return True


def _eval(node: ast.expr, limits: Limits) -> int | float:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in CONSTANTS:
            raise EvalError(f"{node.id!r} is a function; call it: {node.id}(...)")
        return CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp):
        return _check_result(_UNARY[type(node.op)](_eval(node.operand, limits)), limits, "the result")
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, limits), _eval(node.right, limits)
        op = type(node.op)
        both_int = isinstance(a, int) and isinstance(b, int)
        if op is ast.Mult and both_int:
            _too_big(_bits(a) + _bits(b), limits, "the product")
        elif op is ast.Pow and both_int and b > 0 and abs(a) > 1:
            _too_big(b * math.log2(abs(a)), limits, "the power")
        elif op is ast.LShift and both_int and b > 0:
            _too_big(_bits(a) + b, limits, "the shift")
        return _check_result(_BINARY[op](a, b), limits, "the result")
    if isinstance(node, ast.Call):
        name = node.func.id  # checked in parse_expression
        fn, arity = FUNCTIONS[name]
        low, high = (arity, arity) if isinstance(arity, int) else arity
        if not low <= len(node.args) <= high:
            raise EvalError(f"{name}() takes {low if low == high else f'{low} to {high}'} arguments, "
                            f"got {len(node.args)}")
        args = [_eval(a, limits) for a in node.args]
        if name == "factorial" and isinstance(args[0], int) and args[0] > 2:
            n = args[0]
            _too_big(n * math.log2(n) - n * math.log2(math.e), limits, "the factorial")
        if name == "round" and _round_to_zero(args, limits):
            return 0
        return _check_result(fn(*args), limits, f"{name}()")
    raise EvalError(f"{type(node).__name__} not allowed")  # unreachable after parse_expression


def format_value(value: int | float) -> str:
    """The result as the calculator shows it: integers exactly, floats to 12 significant digits."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EvalError(f"result is not a number: {type(value).__name__}")
    if isinstance(value, int):
        return str(value)
    if math.isfinite(value) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g")


def evaluate_text(source: str, limits: Limits = Limits()) -> str:
    """``format_value(evaluate(source))``."""
    try:
        return format_value(evaluate(source, limits))
    except ValueError as err:  # str(int) over sys.int_max_str_digits
        if isinstance(err, EvalError):
            raise
        raise EvalError(f"result too large to print: {err}") from None


def _worker() -> None:
    """One evaluation in this (sandbox) process: limit it, read the request, write the answer.

    stdout must be a pipe (as the sandbox gives it): with RLIMIT_FSIZE = 0 a write to a file fails."""
    import json
    import resource
    import sys
    import unicodedata  # noqa: F401  (the parser imports it for non-ASCII names; no fds to load it later)

    try:
        request = json.loads(sys.stdin.read())
    except ValueError:
        request = {}
    memory = int(request.get("memory_mb", 0)) * 2**20
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu = int(request.get("cpu_s", 0))
    if cpu:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # no file writes
    resource.setrlimit(resource.RLIMIT_NOFILE, (3, 3))  # stdin/out/err only: no files, no sockets
    try:
        out = {"ok": True, "value": evaluate_text(request["expr"], Limits(**request.get("limits", {})))}
    except EvalError as err:
        out = {"ok": False, "error": str(err)}
    except MemoryError:
        out = {"ok": False, "error": f"memory limit exceeded ({request.get('memory_mb')} MiB)"}
    except Exception as err:  # noqa: BLE001  the model sees the kind only: messages may hold host paths
        out = {"ok": False, "error": f"evaluation failed: internal error ({type(err).__name__})"}
    sys.stdout.write(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    _worker()
