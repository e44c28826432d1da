"""Schemathesis over a live HTTP server (the engine's and the control API's fuzz tests): every operation of
its OpenAPI schema gets a fixed number of generated requests, schema-valid and schema-violating, with
derandomized Hypothesis so a run is the same size and the same requests every time. Nothing is shrunk:
each problem is recorded with a curl line to replay it, and the test asserts on the totals."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import requests
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.specs.openapi.checks import response_schema_conformance

MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)


@dataclass
class FuzzRun:
    cases: int = 0
    server_errors: list[str] = field(default_factory=list)
    """One line per 5xx (or request that got no answer): the operation, status, body and a curl line."""
    problems: list[str] = field(default_factory=list)
    """4xx without a JSON message, responses that break their declared schema."""
    by_status: dict[int, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time per operation and mode, to see where a run spends its time."""
    protocol_rejects: int = 0
    """Requests whose generated framing header (e.g. `transfer-encoding: ;`) the HTTP layer (uvicorn's h11)
    refused with its own plain-text 400 before any application code ran: correct, and not the app's to
    word."""


PROTOCOL_REJECT = "Invalid HTTP request received."
FRAMING_HEADERS = {"transfer-encoding", "content-length"}


def _bad_framing(case) -> bool:
    return any(name.lower() in FRAMING_HEADERS for name in (case.headers or {}))


def error_message(body: Any) -> str | None:
    """The human-readable message of an error body in any of the shapes the servers use: SGLang's
    {"message"} and {"error": {"message"}}, FastAPI's {"detail": str | [{"msg"}]}."""
    if not isinstance(body, dict):
        return None
    for candidate in (body.get("message"), (body.get("error") or {}).get("message"), body.get("detail")):
        if isinstance(candidate, list) and candidate and all(isinstance(d, dict) for d in candidate):
            candidate = "; ".join(str(d.get("msg", "")) for d in candidate)
        if isinstance(candidate, str) and candidate.strip():
            return candidate
    return None


def fuzz(
    schema,
    base_url: str,
    headers: dict[str, str],
    examples: int,
    skip: Callable[[str, str, GenerationMode], bool] = lambda method, path, mode: False,
    after_call: Callable[[str, str], None] = lambda method, path: None,
    timeout_s: float = 30.0,
    path_parameters: dict[str, Any] | None = None,
) -> FuzzRun:
    """Send up to `examples` generated requests per operation and generation mode (`skip` leaves out an
    operation in one mode; `after_call(method, path)` runs after each request, e.g. to undo a pause;
    `path_parameters` fixes those path parameters, e.g. to reach an existing resource)."""
    run = FuzzRun()
    session = requests.Session()

    def send(case) -> None:
        where = f"{case.method} {case.formatted_path}"
        curl = case.as_curl_command(headers=headers)
        try:
            response = case.call(base_url=base_url, headers=headers, session=session, timeout=timeout_s)
        except requests.RequestException as e:
            run.server_errors.append(f"{where}: no answer ({type(e).__name__}: {e})\n  {curl}")
            return
        finally:
            after_call(case.method, case.operation.path)
        run.cases += 1
        status = response.status_code
        run.by_status[status] = run.by_status.get(status, 0) + 1
        if status >= 500:
            run.server_errors.append(f"{where}: {status} {response.text[:300]}\n  {curl}")
            return
        if status == 400 and response.text.strip() == PROTOCOL_REJECT and _bad_framing(case):
            run.protocol_rejects += 1
            return
        if 400 <= status < 500:
            try:
                body = response.json()
            except ValueError:
                body = None
            if error_message(body) is None:
                run.problems.append(
                    f"{where}: {status} without a JSON message: {response.text[:200]}\n  {curl}"
                )
                return
        try:
            case.validate_response(response, checks=[response_schema_conformance], headers=headers)
        except (Failure, FailureGroup) as e:
            run.problems.append(f"{where}: {status} breaks the schema: {str(e)[:500]}")

    for result in schema.get_all_operations():
        op = result.ok()
        for mode in MODES:
            if skip(op.method.upper(), op.path, mode):
                continue
            test = settings(
                max_examples=examples,
                derandomize=True,
                database=None,
                deadline=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )(given(op.as_strategy(generation_mode=mode, path_parameters=path_parameters))(send))
            t0 = time.perf_counter()
            try:
                test()
            except Unsatisfiable:  # nothing to violate (no parameters, no body): the valid run covers it
                assert mode == GenerationMode.NEGATIVE, (op.method, op.path)
            run.seconds[f"{op.method.upper()} {op.path} {mode.value}"] = time.perf_counter() - t0
    return run
