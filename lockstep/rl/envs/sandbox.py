"""Where calculator expressions run: in this process, or in a limited child process.

Both modes use the AST-whitelisted evaluator of :mod:`lockstep.rl.envs.safe_eval` (numbers,
arithmetic operators, a few math functions; no names, attributes, imports or strings), which also
refuses any integer result over ``max_int_bits`` before computing it. The whitelist is checked in
this process first, so a refused expression costs no process.

``isolation="process"`` (the default) then evaluates each expression in a fresh
``python -I -S safe_eval.py`` (isolated mode: no site-packages, no environment variables, no
current directory on the path; an empty environment) that limits itself before reading the
expression: address space ``RLIMIT_AS = memory_mb``, CPU seconds ``RLIMIT_CPU``, no file writes
(``RLIMIT_FSIZE = 0``) and no new file descriptors (``RLIMIT_NOFILE = 3``: no files, no sockets).
The parent kills it after ``timeout_s`` of wall time. Cost: ~25 ms of process start per call
(``evaluate_many`` starts up to ``max_parallel`` at once). ``isolation="inline"`` evaluates in this
process (microseconds) and relies on the whitelist and the size limits alone.

Every failure (syntax, refused construct, math error, time or memory limit) is returned as an
error message for the model, never raised. A crash of the evaluator reads "evaluation failed:
<reason>" with a short reason, never its stderr (tracebacks name host paths). The child imports
what the whitelisted functions and the parser may load lazily (``unicodedata``, for non-ASCII
names) before it lowers its file-descriptor limit.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from lockstep.config.base import Config, require, require_choice, require_positive
from lockstep.rl.envs import safe_eval

ISOLATION = ["process", "inline"]
_WORKER = str(Path(safe_eval.__file__).resolve())


@dataclasses.dataclass
class EvalResult:
    """One expression's outcome: ``value`` text, or ``error`` text."""

    ok: bool
    value: str | None = None
    error: str | None = None

    @property
    def text(self) -> str:
        """What the calculator shows: the value, or ``error: ...``."""
        return self.value if self.ok else f"error: {self.error}"


@dataclasses.dataclass(kw_only=True)
class SandboxConfig(Config):
    """How calculator expressions are evaluated and what they may cost."""

    #: "process": a fresh limited child process per expression; "inline": in this process
    isolation: str = "process"
    #: wall-clock limit per expression (process mode, counted from when all of a batch's children
    #: have started), seconds
    timeout_s: float = 2.0
    #: address-space limit of the child process (RLIMIT_AS), MiB
    memory_mb: int = 256
    #: child processes run at once by evaluate_many
    max_parallel: int = 8
    #: longest expression, characters
    max_chars: int = 500
    #: most AST nodes in an expression
    max_nodes: int = 200
    #: largest integer result of any operation, bits (0 = unlimited: only the process limits apply)
    max_int_bits: int = 4096

    def validate(self, path: str = "sandbox") -> None:
        require_choice(self.isolation, ISOLATION, f"{path}.isolation")
        require_positive(self.timeout_s, f"{path}.timeout_s")
        require(isinstance(self.memory_mb, int) and self.memory_mb >= 32, f"{path}.memory_mb",
                f"must be an integer >= 32 (the interpreter itself needs ~20 MiB), got {self.memory_mb!r}")
        require(isinstance(self.max_parallel, int) and self.max_parallel >= 1, f"{path}.max_parallel",
                f"must be an integer >= 1, got {self.max_parallel!r}")
        require_positive(self.max_chars, f"{path}.max_chars")
        require_positive(self.max_nodes, f"{path}.max_nodes")
        require(isinstance(self.max_int_bits, int) and self.max_int_bits >= 0, f"{path}.max_int_bits",
                f"must be an integer >= 0 (0 = unlimited), got {self.max_int_bits!r}")

    def build(self) -> "Sandbox":
        return Sandbox(self)


class Sandbox:
    """Evaluates calculator expressions under :class:`SandboxConfig`; see the module docstring."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config = config or SandboxConfig()
        config.validate()
        self.limits = safe_eval.Limits(config.max_chars, config.max_nodes, config.max_int_bits)

    def evaluate(self, expression: str) -> EvalResult:
        return self.evaluate_many([expression])[0]

    def evaluate_many(self, expressions: Sequence[str]) -> list[EvalResult]:
        """One result per expression, in order; process mode runs up to ``max_parallel`` at once."""
        results: list[EvalResult | None] = [None] * len(expressions)
        todo: list[int] = []
        for i, expr in enumerate(expressions):
            try:
                safe_eval.parse_expression(expr, self.limits)
            except safe_eval.EvalError as err:
                results[i] = EvalResult(False, error=str(err))
                continue
            if self.config.isolation == "inline":
                results[i] = _inline(expr, self.limits)
            else:
                todo.append(i)
        step = self.config.max_parallel
        for start in range(0, len(todo), step):
            chunk = todo[start:start + step]
            for i, result in zip(chunk, self._run_processes([expressions[i] for i in chunk])):
                results[i] = result
        return results  # type: ignore[return-value]

    def _run_processes(self, expressions: list[str]) -> list[EvalResult]:
        c = self.config
        request = {"limits": dataclasses.asdict(self.limits), "memory_mb": c.memory_mb,
                   "cpu_s": int(c.timeout_s) + 1}
        procs: list[subprocess.Popen] = []
        try:
            for expr in expressions:
                proc = subprocess.Popen([sys.executable, "-I", "-S", _WORKER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={}, cwd="/",
                                        text=True)
                procs.append(proc)
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({**request, "expr": expr}))
                proc.stdin.close()
            deadline = time.monotonic() + c.timeout_s
            # answers are small (< the pipe buffer), so waiting before reading cannot block
            return [self._collect(proc, deadline) for proc in procs]
        finally:
            for proc in procs:  # on any error (or interrupt) leave no child behind
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

    def _collect(self, proc: subprocess.Popen, deadline: float) -> EvalResult:
        assert proc.stdout is not None and proc.stderr is not None
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            result = EvalResult(False, error=f"time limit exceeded ({self.config.timeout_s:g} s)")
        else:
            result = _decode(proc.returncode, proc.stdout.read(), proc.stderr.read(), self.config)
        proc.stdout.close()
        proc.stderr.close()
        return result


def _inline(expr: str, limits: safe_eval.Limits) -> EvalResult:
    try:
        return EvalResult(True, value=safe_eval.evaluate_text(expr, limits))
    except safe_eval.EvalError as err:
        return EvalResult(False, error=str(err))


def _decode(returncode: int, stdout: str, stderr: str, config: SandboxConfig) -> EvalResult:
    """The child's JSON answer, or what its death means."""
    try:
        answer = json.loads(stdout)
        if answer["ok"]:
            return EvalResult(True, value=str(answer["value"]))
        return EvalResult(False, error=str(answer["error"]))
    except (ValueError, KeyError, TypeError):
        pass
    if "MemoryError" in stderr:
        return EvalResult(False, error=f"memory limit exceeded ({config.memory_mb} MiB)")
    if returncode < 0:  # killed by a signal: SIGXCPU / SIGKILL from RLIMIT_CPU
        return EvalResult(False, error=f"time limit exceeded ({config.timeout_s:g} s)")
    # never the stderr text itself: a traceback names host paths (the interpreter, this file)
    return EvalResult(False, error=f"evaluation failed: the evaluator exited with status {returncode}")
