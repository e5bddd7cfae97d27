"""The calculator sandbox's gaps (issue #15 item 6): every operation that can grow an integer is
size-guarded, the child process can load what the parser needs under its fd limit, an evaluator
crash never shows the model host paths, and ``extract_answer`` is linear in the text."""

from __future__ import annotations

import itertools
import json
import random
import re
import subprocess
import sys
import time
import tracemalloc

from lockstep.rl.envs import Sandbox, SandboxConfig, extract_answer, safe_eval, sandbox

LIMITS = safe_eval.Limits()
#: the parse and evaluation of a small expression peak near 13 KiB; an integer with 10**6 decimal
#: digits (what an unguarded round(x, -10**6) builds) takes 415 KiB
PEAK_BOUND = 128 * 1024


def _peak_bytes(expr: str) -> tuple[str, int]:
    """(the result text or the error, the peak of Python allocations while evaluating ``expr`` inline)."""
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        text = safe_eval.evaluate_text(expr, LIMITS)
    except safe_eval.EvalError as err:
        text = f"error: {err}"
    return text, tracemalloc.get_traced_memory()[1] - base


def test_inline_round_with_a_huge_negative_ndigits_builds_no_huge_number():
    tracemalloc.start()
    try:
        text, peak = _peak_bytes("round(7, -10**6)")
    finally:
        tracemalloc.stop()
    assert text == "0" and peak < PEAK_BOUND, (text, peak)
    box = Sandbox(SandboxConfig(isolation="inline"))
    assert box.evaluate("round(7, -10**9)").text == "0"  # unguarded: a 10**9-digit power of ten
    # the guard changes no result Python computes cheaply: near the threshold and either sign
    for expr, n, k in [("123456", 123456, -3), ("-15", -15, -1), ("25", 25, -1), ("2**4000", 2**4000, -1204),
                       ("2**4000", 2**4000, -1205), ("-(2**4000)", -(2**4000), -1233), ("2**4000", 2**4000, -1234),
                       ("5", 5, -1300), ("7", 7, 3)]:
        assert box.evaluate(f"round({expr}, {k})").text == str(round(n, k)), (expr, k)


def test_every_whitelisted_operation_stays_under_the_size_guard():
    """Each function and operator, on every combination of extreme arguments: an error or a result
    within ``max_int_bits``, and never a large allocation (tracemalloc peak) on the way."""
    values = ["(2**4000)", "(-(2**4000))", "(10**6)", "(-(10**6))", "4095", "(-3)", "0", "2.5", "1e300", "(-1e300)"]
    exprs = [f"-{v}" for v in values]
    for name, (_, arity) in safe_eval.FUNCTIONS.items():
        low, high = (arity, arity) if isinstance(arity, int) else arity
        for count in sorted({low, min(high, 2)}):
            exprs += [f"{name}({', '.join(args)})" for args in itertools.product(values, repeat=count)]
    for symbol in ["+", "-", "*", "/", "//", "%", "**", "<<", ">>"]:
        exprs += [f"{a} {symbol} {b}" for a, b in itertools.product(values, repeat=2)]
    tracemalloc.start()
    try:
        results = {expr: _peak_bytes(expr) for expr in exprs}
    finally:
        tracemalloc.stop()
    too_big = {e: peak for e, (_, peak) in results.items() if peak >= PEAK_BOUND}
    assert not too_big, too_big
    for expr, (text, _) in results.items():
        if not text.startswith("error: "):
            value = float(text) if any(c in text for c in ".en") else int(text)
            assert not isinstance(value, int) or value.bit_length() <= LIMITS.max_int_bits, expr
    assert "result too large" in results["(2**4000) * (2**4000)"][0]
    assert "result too large" in results["factorial(4095)"][0]
    assert results["round((2**4000), (-(10**6)))"][0] == "0"
    assert results["(2**4000) // (-3)"][0] == str(2**4000 // -3)


def test_more_guarded_results():
    box = Sandbox(SandboxConfig(isolation="inline"))
    assert "result too large" in box.evaluate("lcm(2**3000, 3**1500)").error  # ~5378 bits
    assert box.evaluate("lcm(2**3000, 2**3000)").text == str(2**3000)
    assert "result too large" in box.evaluate("2**4095 + 2**4095").error
    assert "not a real number" in box.evaluate("(-8) ** 0.5").error  # complex
    assert "result too large" in Sandbox(SandboxConfig(isolation="inline", max_int_bits=64)).evaluate(
        "floor(1e30)").error
    assert "result too large" in Sandbox(SandboxConfig(isolation="inline", max_int_bits=64)).evaluate(
        "99999999999999999999999").error  # a literal over the limit
    for name in ["pow", "comb", "perm", "prod", "int", "str"]:  # not whitelisted: nothing to guard
        assert "unknown function" in box.evaluate(f"{name}(2, 3)").error


def test_process_child_loads_what_the_parser_needs():
    # a non-ASCII name makes the parser import unicodedata (NFKC), after RLIMIT_NOFILE = 3
    results = Sandbox(SandboxConfig()).evaluate_many(["ｓqrt(16)", "ｐi * 2"])
    assert [r.text for r in results] == ["4", "6.28318530718"]


def test_an_evaluator_crash_shows_no_host_path(tmp_path, monkeypatch):
    missing = tmp_path / "missing_evaluator.py"
    monkeypatch.setattr(sandbox, "_WORKER", str(missing))  # python cannot open it: exit status 2
    result = Sandbox(SandboxConfig()).evaluate("1 + 1")
    assert result.error == "evaluation failed: the evaluator exited with status 2", result
    traceback = (f'Traceback (most recent call last):\n  File "{sys.executable}", line 1\n'
                 f"ImportError: {sys.prefix}/lib/x.so: cannot open shared object file\n")
    decoded = sandbox._decode(1, "", traceback, SandboxConfig())
    assert decoded.text == "error: evaluation failed: the evaluator exited with status 1"


def test_the_child_reports_an_unexpected_error_by_its_kind_only():
    request = {"expr": "1 + 1", "limits": {"no_such_limit": 1}, "memory_mb": 256, "cpu_s": 2}
    out = subprocess.run([sys.executable, "-I", "-S", sandbox._WORKER], input=json.dumps(request), env={},
                         capture_output=True, text=True, timeout=30, check=True, cwd="/")
    assert json.loads(out.stdout) == {"ok": False, "error": "evaluation failed: internal error (TypeError)"}


# --------------------------------------------------------------------------- extract_answer

_REFERENCE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def test_extract_answer_matches_the_regex_on_adversarial_inputs():
    rng = random.Random(0)
    pieces = ["<answer>", "</answer>", "<answer", "answer>", "</answer", "x", " 4 ", "\n", "<", ">", "/"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        found = _REFERENCE.findall(text)
        assert extract_answer(text) == (found[-1].strip() if found else None), text


def test_extract_answer_is_linear():
    # 8000 unclosed openers (64k characters): the lazy regex took 2.5-3.3 s (each opener scans to the
    # end); one pass takes well under a millisecond, so 0.5 s is a bound only a quadratic scan exceeds
    for text, expected in [("<answer>" * 8000, None), ("<answer>" * 8000 + "</answer>", "<answer>" * 7999),
                           ("<answer>1</answer>" + "<answer>" * 8000, "1")]:
        start = time.perf_counter()
        assert extract_answer(text) == expected
        assert time.perf_counter() - start < 0.5
