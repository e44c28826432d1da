"""Bad input to the control API over real HTTP: schemathesis generates requests from its OpenAPI schema for
every route, valid and schema-violating, once with random job names and once with the name of a job that
exists; none may get a 5xx, every 4xx says what is wrong in JSON, and what the schema declares holds.
Then the bearer token on every route, the 1 MiB body limit, and one regression test per bug found.

The cluster behind it is real but has no Ray: a real Redis (its own, the jobs' state) and the real
JobControl, whose Ray job-submission address has nothing listening. So a schema-valid POST /jobs that
happens to be a valid job spec (an empty spec is one: every section has defaults) is refused when Ray
is asked to run it, 503 "Ray job submission failed", and never launches a training job. Those 503s are
the one 5xx expected here; they are counted apart and must carry that message. The job that exists is
written straight to Redis in state "running" with no Ray job, so stop/scale/checkpoint only write Redis."""

from __future__ import annotations

import json
import os
import secrets

import http_calls
import httpx
import pytest
import schemathesis
from api_fuzz import error_message, fuzz
from cluster_helpers import control_without_ray, serving

from slipstream.cluster.api import MAX_BODY_BYTES, create_app
from slipstream.cluster.control import JobControl

TOKEN = "fuzz-" + secrets.token_hex(8)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES = int(os.environ.get("SLIPSTREAM_FUZZ_EXAMPLES", "15"))
"""Generated requests per route, generation mode and pass; more for a deeper run."""
JOB = "fuzz-job"
PUBLIC = {("GET", "/healthz"), ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc")}
NO_RAY = "Ray job submission failed"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """(url, control) of a control API over a real Redis and an address where Ray would be."""
    with control_without_ray(tmp_path_factory.mktemp("home"), api_token=TOKEN) as control:
        # A kept-alive connection stays open between cases: on a loaded box hypothesis can take longer than
        # uvicorn's 5 s default to make the next case, and a close racing the next request is a reset.
        with serving(create_app(TOKEN, control), timeout_keep_alive=600) as url:
            yield url, control


@pytest.fixture(scope="module")
def schema(api):
    return schemathesis.openapi.from_url(f"{api[0]}/openapi.json")


def _running_job(control: JobControl) -> None:
    spec = json.dumps({"name": JOB, "generators": {"num_engines": 1}})
    if not control.store.exists(JOB):  # a name recorded as running cannot be submitted again
        control.store.create(JOB, spec, 1, 1)
    control.store.update_status(JOB, state="running")


def assert_4xx(r: httpx.Response, status: int, *words: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    message = error_message(r.json())
    assert message, r.text
    for w in words:
        assert w in message, (w, message)
    return message


def test_fuzz_every_route(api, schema):
    url, control = api
    _running_job(control)
    runs = [
        fuzz(schema, url, AUTH, EXAMPLES),
        fuzz(
            schema,
            url,
            AUTH,
            EXAMPLES,
            skip=lambda method, path, mode: "{name}" not in path,  # the first pass covered those
            path_parameters={"name": JOB},
            after_call=lambda method, path: _running_job(control),
        ),
    ]
    cases = sum(r.cases for r in runs)
    errors = [e for r in runs for e in r.server_errors]
    no_ray = [e for e in errors if e.startswith("POST /jobs: 503") and NO_RAY in e]
    # a forced stop has Ray stop the job's submission: without Ray, a 503 naming it
    no_ray += [e for e in errors if e.startswith(f"POST /jobs/{JOB}/stop: 503") and "Ray could not stop" in e]
    unexpected = [e for e in errors if e not in no_ray]
    statuses = {s for r in runs for s in r.by_status}
    print(f"fuzz: {cases} cases, {len(unexpected)} 5xx (+{len(no_ray)} expected 503s: no Ray)")
    print(f"by status {sorted(statuses)}")
    seconds = {f"{op} (pass {i})": t for i, r in enumerate(runs) for op, t in r.seconds.items()}
    print("\n".join(f"{t:6.2f} s {op}" for op, t in sorted(seconds.items(), key=lambda kv: -kv[1])[:8]))
    assert not unexpected, "\n".join(unexpected)
    problems = [p for r in runs for p in r.problems]
    assert not problems, "\n".join(problems)
    assert cases > 300
    assert {200, 401, 404, 422} <= statuses or {200, 404, 422} <= statuses


def test_every_route_but_health_and_docs_needs_the_token(api, schema):
    url, _ = api
    routes = [(op.method.upper(), op.path) for op in (r.ok() for r in schema.get_all_operations())]
    assert len(routes) >= 8
    for method, path in routes + sorted(PUBLIC):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            r = http_calls.request(
                method, url + path.replace("{name}", JOB), headers=headers, json={}, timeout=30
            )
            if (method, path) in PUBLIC:
                assert r.status_code == 200, (method, path, r.status_code)
            else:
                assert_4xx(r, 401, "token")


def test_body_over_1_mib_is_413(api):
    url, _ = api
    r = http_calls.post(f"{url}/jobs", headers=AUTH, json={"spec": "x" * MAX_BODY_BYTES}, timeout=30)
    assert_4xx(r, 413, f"{MAX_BODY_BYTES} bytes")
    r = http_calls.post(f"{url}/jobs", headers=AUTH, json={"spec": "0"}, timeout=30)
    assert_4xx(r, 422, "mapping")


# ---- regressions: what the fuzzer and the probes around it found -------------------------------------


def submit(url: str, **body) -> httpx.Response:
    return http_calls.post(f"{url}/jobs", headers=AUTH, json=body, timeout=30)


def test_refused_operations_are_in_the_schema(api, schema):
    # Was: a refused operation answered 422 {"detail": "message"} where the schema declared only FastAPI's
    # list of field errors, so every such answer broke the schema.
    url, _ = api
    responses = schema.raw_schema["paths"]["/jobs/{name}/scale"]["post"]["responses"]
    assert responses["422"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorBody"
    }
    r = http_calls.post(f"{url}/jobs/{JOB}/scale", headers=AUTH, json={}, timeout=30)
    assert_4xx(r, 422, "generators and/or trainers")


@pytest.mark.parametrize("override", ["a=[", "name=!!python/object:os.system x"])
def test_an_override_that_is_not_yaml_is_422(api, override):
    # Was: a 500 (yaml's ParserError / ConstructorError escaped submit).
    assert_4xx(submit(api[0], spec="", overrides=[override]), 422, "override", "YAML")


def test_a_spec_nested_too_deeply_is_422(api):
    # Was: a 500 (RecursionError in the YAML loader); 20k brackets are well under the 1 MiB limit.
    assert_4xx(submit(api[0], spec="a: " + "[" * 20000), 422, "nested too deeply")


@pytest.mark.parametrize(
    "body, key",
    [
        ({"spec": "name: a", "cwd": "a\0b"}, "cwd"),
        ({"spec": 'output_dir: "/tmp/a\\0b"'}, "$.output_dir"),
        ({"spec": 'model: {path: "m\\0"}'}, "$.model.path"),
        ({"spec": 'trainer: {checkpoint_dir: "c\\0"}'}, "$.trainer.checkpoint_dir"),
    ],
)
def test_a_nul_byte_in_a_path_is_422_naming_the_key(api, body, key):
    # Was: a 500 ("embedded null byte" from pathlib), or (checkpoint_dir) a job submitted with it.
    assert_4xx(submit(api[0], **body), 422, "NUL byte", f"`{key}`")


def test_an_output_dir_that_cannot_be_made_is_422(api):
    # Was: a 500 (FileNotFoundError from mkdir).
    assert_4xx(submit(api[0], spec="name: nodir\noutput_dir: /proc/slipstream/out"), 422, "`$.output_dir`")


def test_scale_beyond_any_cluster_is_422_and_changes_nothing(api):
    # Was: 200, and desired generators = 10**30 written for the driver to act on.
    url, control = api
    _running_job(control)
    before = control.store.desired(JOB)
    for key in ("generators", "trainers"):
        r = http_calls.post(f"{url}/jobs/{JOB}/scale", headers=AUTH, json={key: 10**30}, timeout=30)
        assert_4xx(r, 422, "4096")
    assert control.store.desired(JOB) == before
