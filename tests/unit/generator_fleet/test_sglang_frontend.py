"""SGLang's own frontend (`sglang.lang`: `@sgl.function`, `sgl.gen`, RuntimeEndpoint) runs unmodified against
a real built-in engine on the tiny model. The frontend sends `stop_regex: []` (and the other constrained
keys empty) with every gen; the engine takes empty values as unconstrained. Constrained gens
(`regex=`, `json_schema=`) run against the engine's xgrammar masks; JSON runs on an untrained model over
printable ASCII (the tiny-tools tokenizer), whose output only the grammar can make valid."""

from __future__ import annotations

import json
import re

import http_calls
import httpx
import pytest
from sse_stream import stream_objects

sgl = pytest.importorskip("sglang", reason="SGLang's frontend (sglang.lang) is not installed")

API_KEY = "frontend-test-key"


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    from generator_fleet.engine import EngineServer

    server = EngineServer(str(tiny_model_dir), api_key=API_KEY, context_length=256).start()
    try:
        yield sgl.RuntimeEndpoint(server.url, api_key=API_KEY)
    finally:
        server.stop()


@sgl.function
def _complete(s, prompt, stop=None):
    s += prompt
    s += sgl.gen("out", max_tokens=16, temperature=0.0, stop=stop)


def test_gen_with_stop_runs_and_matches_the_unstopped_greedy_output(backend):
    free = _complete.run(prompt="12+34=", stop=None, backend=backend)
    full = free["out"]
    assert full, "greedy generation produced no text"
    cut = next((c for c in full[1:] if not c.isspace()), None)
    assert cut is not None, f"greedy text {full!r} has no stop candidate"
    stopped = _complete.run(prompt="12+34=", stop=cut, backend=backend)
    # SGLang trims the stop string: the output is the greedy text up to its first occurrence.
    assert stopped["out"] == full[: full.index(cut)]


def test_streaming_text_iter_yields_the_same_text(backend):
    whole = _complete.run(prompt="7+8=", stop=None, backend=backend)["out"]
    state = _complete.run(prompt="7+8=", stop=None, backend=backend, stream=True)
    pieces = list(state.text_iter("out"))
    assert "".join(pieces) == whole


def test_run_batch(backend):
    prompts = ["1+1=", "23+5=", "9+90="]
    singles = [_complete.run(prompt=p, stop=None, backend=backend)["out"] for p in prompts]
    states = _complete.run_batch([{"prompt": p, "stop": None} for p in prompts], backend=backend)
    assert [s["out"] for s in states] == singles


def test_structural_tag_is_refused_and_empty_grammar_keys_accepted(backend):
    r = http_calls.post(
        backend.base_url + "/generate",
        json={"text": "1+2=", "sampling_params": {"max_new_tokens": 2, "structural_tag": "{}"}},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert r.status_code == 400, r.text
    assert "sampling_params.structural_tag is not supported" in r.text
    empties = {
        "stop_regex": ([], "", None),
        "regex": ("", None),
        "json_schema": ("", None),
        "ebnf": ("", None),
    }
    for key, values in empties.items():
        for empty in values:
            r = http_calls.post(
                backend.base_url + "/generate",
                json={"text": "1+2=", "sampling_params": {"max_new_tokens": 2, key: empty}},
                headers={"Authorization": f"Bearer {API_KEY}"},
            )
            assert r.status_code == 200, (key, empty, r.text)


def _post(backend, body: dict) -> httpx.Response:
    return http_calls.post(
        backend.base_url + "/generate", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120
    )


def _first_match_prefix(text: str, pattern: str) -> str:
    """The shortest prefix of `text` in which `pattern` matches (the tiny model's tokens are characters)."""
    for end in range(1, len(text) + 1):
        if re.search(pattern, text[:end]):
            return text[:end]
    raise AssertionError(f"{pattern!r} never matches {text!r}")


def test_stop_regex_stops_at_the_first_match_and_keeps_it(backend):
    prompt, n_tokens = "12+34=", 16
    full = _post(backend, {"text": prompt, "sampling_params": {"max_new_tokens": n_tokens, "temperature": 0}})
    full_text = full.json()["text"]
    stop_char = next((c for c in full_text[1:] if not c.isspace()), None)
    assert stop_char is not None, f"greedy text {full_text!r} has no stop candidate"
    pattern = re.escape(stop_char) + "|zzz[0-9]+"
    expected = _first_match_prefix(full_text, pattern)
    sp = {"max_new_tokens": n_tokens, "temperature": 0, "stop_regex": [pattern]}

    one = _post(backend, {"text": prompt, "sampling_params": sp}).json()
    assert one["text"] == expected  # SGLang keeps the regex match in the text
    assert one["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}

    # n > 1 and a batch: every copy stops at the same point.
    batch = _post(backend, {"text": [prompt, prompt], "sampling_params": {**sp, "n": 2}}).json()
    assert [b["text"] for b in batch] == [expected] * 4

    # Streaming ends at the same point.
    body = {"text": prompt, "sampling_params": {**sp, "stop_regex": pattern}, "stream": True}
    chunks = stream_objects(backend.base_url, body, API_KEY)
    assert chunks[-1]["text"] == expected
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}


def test_bad_stop_regex_is_a_400(backend):
    r = _post(backend, {"text": "1+2=", "sampling_params": {"stop_regex": "(unclosed"}})
    assert r.status_code == 400 and "invalid stop_regex" in r.text, r.text
    r = _post(backend, {"text": "1+2=", "sampling_params": {"stop_regex": ["a"] * 33}})
    assert r.status_code == 400 and "at most 32 stop_regex" in r.text, r.text


def test_frontend_gen_with_stop_regex(backend):
    @sgl.function
    def prog(s):
        s += "12+34="
        s += sgl.gen("out", max_tokens=16, temperature=0.0, stop_regex=r"[0-9]|={3}")

    free = _complete.run(prompt="12+34=", backend=backend)["out"]
    out = prog.run(backend=backend)["out"]
    assert re.search(r"[0-9]|={3}", free), f"greedy text {free!r} has nothing to stop at"
    assert out == _first_match_prefix(free, r"[0-9]|={3}")


def test_select_picks_a_choice(backend):
    @sgl.function
    def prog(s):
        s += "12+34="
        s += sgl.select("pick", choices=["46", "=====", "7"])

    state = prog.run(backend=backend)
    scores = state.get_meta_info("pick")["normalized_prompt_logprobs"]
    # select scores each choice with the engine's prompt logprobs and takes the best normalized one.
    assert len(scores) == 3 and all(x < 0 for x in scores), scores
    assert state["pick"] == ["46", "=====", "7"][max(range(3), key=scores.__getitem__)]


def test_frontend_regex_gen_fully_matches(backend):
    pattern = r"[0-9]{2}\+[0-9]{1,3}=[0-9]{1,3}"

    @sgl.function
    def prog(s, prompt):
        s += prompt
        s += sgl.gen("out", max_tokens=24, temperature=0.0, regex=pattern)
        s += sgl.gen("free", max_tokens=4, temperature=0.0)

    for prompt in ("12+34=", "7+8=", "1"):
        state = prog.run(prompt=prompt, backend=backend)
        assert re.fullmatch(pattern, state["out"]), (prompt, state["out"])
        assert state.get_meta_info("out")["finish_reason"]["type"] == "stop"


def test_frontend_regex_gen_sampled_in_a_batch(backend):
    @sgl.function
    def prog(s, prompt):
        s += prompt
        s += sgl.gen("out", max_tokens=16, temperature=1.0, regex=r"(1|22|333){1,4}=")

    states = prog.run_batch([{"prompt": p} for p in ("1+", "2+", "3+", "4+")], backend=backend)
    for st in states:
        assert re.fullmatch(r"(1|22|333){1,4}=", st["out"]), st["out"]


def test_ebnf_over_http(backend):
    # at most three terms: every sample completes well within max_new_tokens (an unbounded sum may not)
    ebnf = (
        'root ::= sum "=" digits\nsum ::= digits ("+" digits)? ("+" digits)?\ndigits ::= [1-9] [0-9]? [0-9]?'
    )
    r = _post(
        backend,
        {
            "text": "12+34=",
            "sampling_params": {"max_new_tokens": 40, "temperature": 0.7, "ebnf": ebnf, "n": 4},
        },
    )
    assert r.status_code == 200, r.text
    for o in r.json():
        assert re.fullmatch(r"[1-9][0-9]{0,2}(\+[1-9][0-9]{0,2}){0,2}=[1-9][0-9]{0,2}", o["text"]), o["text"]
        assert o["meta_info"]["finish_reason"]["type"] == "stop"


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "role": {"enum": ["dev", "ops"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "admin", "role", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def json_backend(untrained_tools_model_dir):
    from generator_fleet.engine import EngineServer

    server = EngineServer(
        str(untrained_tools_model_dir),
        api_key=API_KEY,
        context_length=512,
        constrained_json_disable_any_whitespace=True,
    ).start()
    try:
        yield sgl.RuntimeEndpoint(server.url, api_key=API_KEY)
    finally:
        server.stop()


def _check_person(obj) -> None:
    """PERSON_SCHEMA by hand (jsonschema when installed)."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        jsonschema.validate(obj, PERSON_SCHEMA)
    assert set(obj) == {"name", "age", "admin", "role", "tags"}, obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8
    assert isinstance(obj["age"], int) and not isinstance(obj["age"], bool) and 0 <= obj["age"] <= 120
    assert isinstance(obj["admin"], bool)
    assert obj["role"] in ("dev", "ops")
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 2
    assert all(isinstance(t, str) and len(t) <= 3 for t in obj["tags"])


def test_frontend_json_schema_gen_parses_and_satisfies_the_schema(json_backend):
    @sgl.function
    def prog(s, who, temp):
        s += f"Describe {who} as JSON: "
        s += sgl.gen("person", max_tokens=160, temperature=temp, json_schema=json.dumps(PERSON_SCHEMA))

    runs = [prog.run(who="Ada", temp=0.0, backend=json_backend)]
    runs += prog.run_batch([{"who": w, "temp": 1.0} for w in ("Bob", "Cy", "Di", "Ed")], backend=json_backend)
    for st in runs:
        _check_person(json.loads(st["person"]))

    # The same untrained model without the grammar does not write this JSON.
    @sgl.function
    def free(s):
        s += "Describe Ada as JSON: "
        s += sgl.gen("person", max_tokens=60, temperature=0.0)

    text = free.run(backend=json_backend)["person"]
    with pytest.raises((ValueError, AssertionError)):
        _check_person(json.loads(text))
