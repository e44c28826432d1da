"""SGLang's own frontend (`sglang.lang`: `@sgl.function`, `sgl.gen`, RuntimeEndpoint) runs unmodified against
a real built-in engine on the tiny model. The frontend sends `stop_regex: []` (and the other constrained
keys empty) with every gen; the engine takes empty values as unconstrained."""

from __future__ import annotations

import pytest

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
    s += sgl.gen("out", max_tokens=12, temperature=0.0, stop=stop)


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


def test_non_empty_constrained_keys_are_still_refused(backend):
    import httpx

    for key, value in (("stop_regex", ["a+"]), ("regex", "[0-9]+"), ("structural_tag", "{}")):
        r = httpx.post(
            backend.base_url + "/generate",
            json={"text": "1+2=", "sampling_params": {"max_new_tokens": 2, key: value}},
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
        assert r.status_code == 400, (key, r.text)
        assert f"sampling_params.{key} is not supported" in r.text
    empties = {
        "stop_regex": ([], "", None),
        "regex": ("", None),
        "json_schema": ("", None),
        "ebnf": ("", None),
    }
    for key, values in empties.items():
        for empty in values:
            r = httpx.post(
                backend.base_url + "/generate",
                json={"text": "1+2=", "sampling_params": {"max_new_tokens": 2, key: empty}},
                headers={"Authorization": f"Bearer {API_KEY}"},
            )
            assert r.status_code == 200, (key, empty, r.text)
