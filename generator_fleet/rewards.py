"""Answer checks over the final assistant text (`text, gold -> float` in [0, 1]), and the registered
rewards `math_verify` and `tool` built on them (generator_fleet/tasks/__init__.py: REWARDS).

math-verify bounds its sympy work with `signal.alarm`, which only works on the main thread, and
without it some answers never finish (`\\boxed{9^{9^{9^{9}}}}` runs for minutes). So on the main
thread we let math-verify time itself out, and on any other thread (`asyncio.to_thread`, executors)
the check runs in a helper process that is killed when it overruns.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_NUMBER = r"[-+]?\$?\s?\d[\d,]*(?:\.\d+)?"
_GSM8K_ANSWER = re.compile(r"####\s*(" + _NUMBER + ")")
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*(" + _NUMBER + ")", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")

VERIFY_TIMEOUT_S = 5
"""math-verify's own per-step limit (parse gold, parse prediction, each comparison); whole seconds
because it uses signal.alarm."""
WORKER_START_TIMEOUT_S = 120.0
"""How long a fresh helper process may take to import math-verify (sympy) before we give up."""


def format_reward(text: str, gold: str | None = None) -> float:
    """1.0 when `text` states its final answer in an agreed form: `#### <number>`, `\\boxed{...}` or
    `The answer is <number>`; else 0.0. `gold` is ignored (it is there for the registry's signature)."""
    if _GSM8K_ANSWER.search(text) or _ANSWER_IS.search(text):
        return 1.0
    return 1.0 if any(b.strip() for b in _BOXED.findall(text)) else 0.0


def _verify(text: str, gold: str, timeout_s: int | None) -> float:
    """math-verify on this thread; `timeout_s` None disables its signal-based limits."""
    from math_verify import parse, verify

    gold_parsed = parse(gold, parsing_timeout=timeout_s)
    if not gold_parsed:
        raise ValueError(f"math-verify cannot parse the gold answer {gold!r}")
    pred_parsed = parse(text, parsing_timeout=timeout_s)
    if not pred_parsed:
        return 0.0
    return 1.0 if verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s) else 0.0


def _serve() -> None:
    """Helper process main: one JSON request `[text, gold]` per stdin line, one JSON reply per stdout
    line, `{"reward": r}` or `{"error": message}`."""
    import math_verify  # noqa: F401  (import before saying ready, so the first request is not slow)

    timeout_s = int(sys.argv[1])
    print("ready", flush=True)
    for line in sys.stdin:
        text, gold = json.loads(line)
        try:
            reply = {"reward": _verify(text, gold, timeout_s)}
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)


class MathVerifier:
    """`verifier(text, gold) -> 1.0 | 0.0`, with a hard time limit on any thread.

    Off the main thread, calls go one at a time (a lock) to a helper process started on first use; a
    call that overruns `hard_timeout_s` scores 0.0, and the process is killed and restarted.
    """

    def __init__(self, timeout_s: int = VERIFY_TIMEOUT_S, hard_timeout_s: float | None = None) -> None:
        if timeout_s < 1:
            raise ValueError(f"timeout_s must be a whole number of seconds >= 1, got {timeout_s}")
        self.timeout_s = int(timeout_s)
        # Parsing gold, parsing the prediction and comparing are each limited to timeout_s.
        self.hard_timeout_s = hard_timeout_s if hard_timeout_s is not None else 3 * self.timeout_s + 1.0
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def __call__(self, text: str, gold: str) -> float:
        if threading.current_thread() is threading.main_thread():
            return _verify(text, gold, self.timeout_s)
        with self._lock:
            return self._call_worker(text, gold)

    def _call_worker(self, text: str, gold: str) -> float:
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        self._proc.stdin.write(json.dumps([text, gold]) + "\n")
        self._proc.stdin.flush()
        line = self._readline(self.hard_timeout_s)
        if line is None:
            log.warning(
                "math-verify overran %.0f s; scoring 0 and restarting its process", self.hard_timeout_s
            )
            self.close()
            return 0.0
        reply = json.loads(line)
        if "error" in reply:
            raise ValueError(reply["error"])
        return reply["reward"]

    def _readline(self, timeout_s: float) -> str | None:
        """One reply line, or None when none arrives in time (or the helper died)."""
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        line = self._proc.stdout.readline() if ready else ""
        return line or None

    def _start(self) -> None:
        """A fresh interpreter, not fork or multiprocessing: forking a multi-threaded process (event
        loop, torch) can deadlock the child, and multiprocessing's spawn re-imports the caller's
        `__main__`."""
        self.close()
        root = str(Path(__file__).resolve().parents[1])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        }
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from generator_fleet.rewards import _serve; _serve()",
                str(self.timeout_s),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        if self._readline(WORKER_START_TIMEOUT_S) != "ready\n":
            self.close()
            raise RuntimeError(
                f"math-verify helper process did not start within {WORKER_START_TIMEOUT_S:.0f} s"
            )

    def close(self) -> None:
        """Stop the helper process (a later off-main-thread call starts a new one)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc.stdin.close()
            self._proc.stdout.close()
        self._proc = None


_math_verifier = MathVerifier()
"""Shared by math_verify_reward so a process has at most one helper; it holds no episode state."""


def math_verify_reward(text: str, gold: str) -> float:
    """1.0 when the final answer in `text` equals `gold` per math-verify ("The answer is 42",
    "\\boxed{42}", "42.0", "#### 42" all match "42"), else 0.0. Safe on any thread; never hangs.
    Raises ValueError when `gold` itself cannot be parsed (a dataset bug)."""
    return _math_verifier(text, gold)


def math_verify_score(problem, response, format_weight: float) -> float:
    """The registered reward `math_verify`: the share `1 - format_weight` for the right final answer
    (math-verify against `problem.answer`), `format_weight` for stating it in an agreed form."""
    correct = math_verify_reward(response.text, str(problem.answer))
    return (1.0 - format_weight) * correct + format_weight * format_reward(response.text)


def tool_score(problem, response, format_weight: float) -> float:
    """The registered reward `tool`: what a tool set during the episode (check_answer), 0 if none."""
    return response.tool_reward or 0.0


_AFTER_NUMBER = re.compile(r"\s*[-+*/×^=(\d]")
"""What may not follow a stated final number: an operator or more digits make it an expression."""


def stated_number_reward(text: str, gold: str) -> float:
    """1.0 when the last final answer stated in an agreed form (`The answer is <n>`, `#### <n>`) is a
    plain number equal to `gold`; an expression such as `The answer is 1+12` does not count, whatever it
    evaluates to (math-verify would accept it: a policy learns to restate the question)."""
    stated = list(_ANSWER_IS.finditer(text)) + list(_GSM8K_ANSWER.finditer(text))
    if not stated:
        return 0.0
    last = max(stated, key=lambda m: m.end())
    if _AFTER_NUMBER.match(text, last.end()):
        return 0.0
    try:
        value = float(last.group(1).replace("$", "").replace(",", "").replace(" ", ""))
        return 1.0 if value == float(str(gold).replace(",", "")) else 0.0
    except ValueError:
        return 0.0


def stated_number_score(problem, response, format_weight: float) -> float:
    """The registered reward `number`: the share `1 - format_weight` when the stated final answer is the
    right plain number (stated_number_reward), `format_weight` for stating it in an agreed form."""
    correct = stated_number_reward(response.text, str(problem.answer))
    return (1.0 - format_weight) * correct + format_weight * format_reward(response.text)
