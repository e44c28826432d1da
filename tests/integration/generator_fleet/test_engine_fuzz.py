"""Bad input to the built-in engine over real HTTP: schemathesis generates requests from its OpenAPI
schema (request bodies from the msgspec Structs the handlers decode) for every route, valid and
schema-violating; none may get a 5xx or hang, every 4xx says what is wrong in JSON, and what the schema
declares holds. Then the limits: body size (413) and max_new_tokens beyond the context (400), the API key
on every route, and one regression test per bug the fuzzer found.

What the fuzzer is kept from: schema-valid POST /init_weights_update_group (a valid request is a real
rendezvous that waits for its peers up to the group timeout; its input checks are fuzzed with invalid
bodies and tested below). A pause or memory release it sends is undone after each request so /generate
keeps answering.
The engine's context is its tiny model's 64 positions, so any generation the fuzzer asks for is short."""

from __future__ import annotations

import os

import http_calls
import httpx
import pytest
import schemathesis
from api_fuzz import error_message, fuzz
from schemathesis import GenerationMode

from generator_fleet.engine import EngineServer

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONTEXT_LENGTH = 64
MAX_BODY_BYTES = 1 << 20
MAX_REQUESTS = 64
EXAMPLES = int(os.environ.get("SLIPSTREAM_FUZZ_EXAMPLES", "25"))
"""Generated requests per route and generation mode (valid / schema-violating); more for a deeper run."""
PUBLIC = {("GET", "/health"), ("GET", "/metrics")}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    server = EngineServer(
        str(tiny_model_dir),
        api_key=API_KEY,
        context_length=CONTEXT_LENGTH,
        max_body_bytes=MAX_BODY_BYTES,
        max_requests_per_call=MAX_REQUESTS,
    ).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def schema(engine):
    return schemathesis.openapi.from_url(f"{engine.url}/openapi.json", headers=AUTH)


def post(engine, path: str, body=None, **kw) -> httpx.Response:
    return http_calls.post(f"{engine.url}{path}", json=body, headers=AUTH, timeout=30, **kw)


def assert_4xx(r: httpx.Response, status: int, *words: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    message = error_message(r.json())
    assert message, r.text
    for w in words:
        assert w in message, (w, message)
    return message


def test_schema_describes_the_request_bodies(schema):
    raw = schema.raw_schema
    body = raw["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/GenerateReqIn"}
    assert "max_new_tokens" in raw["components"]["schemas"]["SamplingParamsIn"]["properties"]
    assert raw["paths"]["/update_weight_version"]["post"]["requestBody"]["required"] is True
    assert raw["paths"]["/abort_request"]["post"]["requestBody"]["required"] is False


def test_fuzz_every_route(engine, schema):
    def skip(method: str, path: str, mode: GenerationMode) -> bool:
        # A valid body is a real rendezvous: it waits for peers that never come (see the module docstring).
        return path == "/init_weights_update_group" and mode == GenerationMode.POSITIVE

    def after_call(method: str, path: str) -> None:
        if path == "/pause_generation":
            post(engine, "/continue_generation")
        if path == "/release_memory_occupation":
            post(engine, "/resume_memory_occupation")

    run = fuzz(schema, engine.url, AUTH, EXAMPLES, skip=skip, after_call=after_call)
    print(f"fuzz: {run.cases} cases, {len(run.server_errors)} 5xx; by status {sorted(run.by_status.items())}")
    print("\n".join(f"{t:6.2f} s {op}" for op, t in sorted(run.seconds.items(), key=lambda kv: -kv[1])[:8]))
    assert not run.server_errors, "\n".join(run.server_errors)
    assert not run.problems, "\n".join(run.problems)
    assert run.cases > 300
    assert any(400 <= s < 500 for s in run.by_status) and 200 in run.by_status
    assert http_calls.get(f"{engine.url}/health_generate", headers=AUTH, timeout=30).status_code == 200


def test_every_route_but_health_and_metrics_needs_the_key(engine, schema):
    routes = [(op.method.upper(), op.path) for op in (r.ok() for r in schema.get_all_operations())]
    assert len(routes) > 15
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = http_calls.request(method, f"{engine.url}{path}", headers=headers, timeout=30)
            if (method, path) in PUBLIC:
                assert r.status_code == 200, (method, path, r.status_code)
            else:
                assert_4xx(r, 401, "Unauthorized")


def test_body_over_the_limit_is_413(engine):
    big = b'{"text": "' + b"a" * MAX_BODY_BYTES + b'"}'
    r = http_calls.post(f"{engine.url}/generate", content=big, headers=AUTH, timeout=30)
    assert_4xx(r, 413, f"{MAX_BODY_BYTES} bytes")

    def chunks():  # no Content-Length: refused while it is read
        for _ in range(4):
            yield b"x" * (MAX_BODY_BYTES // 2)

    r = http_calls.post(f"{engine.url}/generate", content=chunks(), headers=AUTH, timeout=30)
    assert_4xx(r, 413, f"{MAX_BODY_BYTES} bytes")
    # Under the limit still works, and the key is checked before the size.
    assert post(
        engine, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    ).is_success
    r = http_calls.post(f"{engine.url}/generate", content=big, timeout=30)
    assert r.status_code == 401


def test_max_new_tokens_beyond_the_context_is_400(engine):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": CONTEXT_LENGTH}}
    assert_4xx(post(engine, "/generate", body), 400, "maximum context length", f"{CONTEXT_LENGTH}")
    r = post(engine, "/generate", {"input_ids": [1] * CONTEXT_LENGTH})
    assert_4xx(r, 400, "longer than the model's context length")
    body["sampling_params"]["max_new_tokens"] = CONTEXT_LENGTH - 4
    r = post(engine, "/generate", body)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] <= CONTEXT_LENGTH - 4


# ---- regressions: what the fuzzer found ------------------------------------------------------------


def healthy(engine) -> bool:
    return http_calls.get(f"{engine.url}/health_generate", headers=AUTH, timeout=30).status_code == 200


def test_huge_n_or_batch_is_400_not_a_stalled_engine(engine):
    # Was: the handler built n requests on the event loop; n=10**12 never returned and stalled every client.
    r = post(engine, "/generate", {"input_ids": [1, 2], "sampling_params": {"n": 10**12}})
    assert_4xx(r, 400, "n=1000000000000", f"at most {MAX_REQUESTS} per call")
    r = post(engine, "/generate", {"input_ids": [[1]] * (MAX_REQUESTS // 2 + 1), "sampling_params": {"n": 2}})
    assert_4xx(r, 400, f"{MAX_REQUESTS // 2 + 1} prompt(s) x n=2")
    body = {"input_ids": [[1]] * (MAX_REQUESTS // 2), "sampling_params": {"n": 2, "max_new_tokens": 1}}
    assert len(post(engine, "/generate", body).json()) == MAX_REQUESTS
    assert healthy(engine)


def test_sampling_seed_beyond_64_bits_is_400(engine):
    # Was: a 500 ("Overflow when unpacking long long" from torch.Generator.manual_seed).
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "sampling_seed": 2**70}}
    assert_4xx(post(engine, "/generate", body), 400, "sampling_seed", str(2**70))
    body["sampling_params"]["sampling_seed"] = 2**64 - 1
    assert post(engine, "/generate", body).status_code == 200


def test_logit_bias_out_of_range_is_400(engine):
    # Was: a 500 ("probability tensor contains either inf, nan"): 1e308 overflows the fp32 logits.
    for bias in (1e308, -1e308, 100.5):
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "logit_bias": {"3": bias}}}
        assert_4xx(post(engine, "/generate", body), 400, "logit_bias", "[-100, 100]")
    body["sampling_params"]["logit_bias"] = {"3": 100.0, "4": -100.0}
    assert post(engine, "/generate", body).status_code == 200


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("master_port", 70000, ["master_port", "70000"]),  # was torch's pybind signature dump
        ("master_port", "http", ["master_port", "'http'"]),
        ("world_size", 1, ["world_size", "at least 2"]),
        ("rank_offset", 0, ["rank_offset", "rank 0 is the trainer"]),  # was a wait for a peer at port 0
        ("rank_offset", 2, ["rank_offset", "world_size=2"]),
        ("timeout_s", -1.0, ["timeout_s", "positive"]),  # was a rendezvous with a negative timeout
    ],
)
def test_bad_weight_group_fields_are_400_naming_the_field(engine, field, value, words):
    body = {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1, "world_size": 2}
    body["backend"], body["timeout_s"], body[field] = "gloo", 1.0, value
    message = assert_4xx(post(engine, "/init_weights_update_group", body), 400, *words)
    assert message.startswith("Failed to init weight update group")
    assert get_groups(engine) == []


def get_groups(engine) -> list[str]:
    return http_calls.get(f"{engine.url}/server_info", headers=AUTH, timeout=30).json()[
        "weight_update_groups"
    ]
