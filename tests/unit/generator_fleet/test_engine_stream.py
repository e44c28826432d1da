"""Streaming /generate (SSE) on the built-in engine over real HTTP: SGLang framing, cumulative events,
final event equal to the non-streaming answer, disconnect aborts."""

import asyncio
import json

import http_calls
import pytest

from generator_fleet.client import EngineClient
from generator_fleet.engine import EngineServer

KEY = "stream-key"
PROMPT = [1, 5, 6, 3, 7, 14]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # context_length past the tiny config's 64: the disconnect test needs a request still running.
    server = EngineServer(str(tiny_model_dir), api_key=KEY, torch_threads=1, context_length=4096).start()
    yield server
    server.stop()


def _events(url: str, body: dict) -> list[str]:
    with http_calls.stream(
        "POST", url + "/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]


def test_sse_events_are_cumulative_and_end_with_done(engine):
    events = _events(
        engine.url, {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True, "stream": True}
    )
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert objs[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert all(o["meta_info"]["finish_reason"] is None for o in objs[:-1])
    lengths = [len(o["output_ids"]) for o in objs]
    assert lengths == sorted(lengths) and lengths[-1] == 12
    for o in objs:  # cumulative: every event extends the previous one
        assert o["output_ids"] == objs[-1]["output_ids"][: len(o["output_ids"])]
        assert len(o["meta_info"]["output_token_logprobs"]) == len(o["output_ids"])
    plain = http_calls.post(
        engine.url + "/generate",
        json={"input_ids": PROMPT, "sampling_params": GREEDY},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ).json()
    assert objs[-1]["output_ids"] == plain["output_ids"]


def test_batch_stream_events_carry_index(engine):
    events = _events(
        engine.url, {"input_ids": [PROMPT, PROMPT[:3]], "sampling_params": GREEDY, "stream": True}
    )
    objs = [json.loads(e) for e in events[:-1]]
    assert {o["index"] for o in objs} == {0, 1}
    finals = [o for o in objs if o["meta_info"]["finish_reason"]]
    assert sorted(o["index"] for o in finals) == [0, 1]


def test_client_stream_and_disconnect_aborts(engine):
    async def scenario():
        async with EngineClient(engine.url, api_key=KEY) as c:
            results = [r async for r in c.generate_stream(PROMPT, GREEDY)]
            assert results[-1].finish_reason == "length" and len(results[-1].output_ids) == 12
            assert all(r.finish_reason == "" for r in results[:-1])
            # Leave a long stream after its first event: the engine aborts the request.
            long = {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}
            async for r in c.generate_stream(PROMPT, long):
                assert r.output_ids
                break
            deadline = asyncio.get_running_loop().time() + 30
            while (await c.server_info())["internal_states"][0]["num_running_reqs"]:
                assert asyncio.get_running_loop().time() < deadline, "stream was not aborted"
                await asyncio.sleep(0.05)

    asyncio.run(scenario())
