"""The colocated sync schedule's memory handoff (weight_bus/colocation.py) against real built-in engines
over HTTP: engines release their memory, get their weights back, then their KV cache (they generate
again); an engine that dies while released sits out the rest of the step without failing it, and the
failure is counted."""

from concurrent.futures import ThreadPoolExecutor

import http_calls
import pytest
from bus_engines import AUTH, KEY, EngineProcess

from generator_fleet.engine import EngineServer
from weight_bus import colocation
from weight_bus.colocation import MemoryHandoff, resume_engines
from weight_bus.engine_client import EngineClient


def _released(client: EngineClient, url: str) -> list[str]:
    return sorted(client.server_info(url)["memory_released"])


def _generates(url: str) -> bool:
    body = {"input_ids": [[1, 2, 3]], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    resp = http_calls.post(url + "/generate", json=body, headers=AUTH, timeout=60)
    return resp.status_code == 200 and len(resp.json()[0]["output_ids"]) == 2


def test_release_resume_in_order_and_an_engine_dead_while_released_sits_out(model_dir, tmp_path):
    live = EngineServer(str(model_dir), api_key=KEY, torch_threads=1).start()
    doomed = EngineProcess(model_dir, tmp_path / "doomed.log")
    client = EngineClient(KEY, 10.0)
    pool = ThreadPoolExecutor(4)
    failures = colocation.HANDOFF_FAILURES._value.get()
    try:
        h = MemoryHandoff(client, pool)
        h.release([live.url, doomed.url])
        assert h.released == [live.url, doomed.url] and h.released_count == 2 and h.release_s > 0
        assert _released(client, live.url) == ["cuda_graph", "kv_cache", "weights"]
        assert colocation.RELEASED._value.get() == 2

        doomed.kill()  # dies while released: the rest of the step goes on with the live engine
        h.resume_weights()
        assert h.released == [live.url] and _released(client, live.url) == ["cuda_graph", "kv_cache"]
        h.finish()
        assert h.released == [] and h.resumed_count == 1 and h.resume_s > 0
        assert _released(client, live.url) == []
        assert colocation.HANDOFF_FAILURES._value.get() == failures + 1
        assert colocation.RELEASED._value.get() == 0
        assert _generates(live.url)

        # a step that failed before its publish: finish() gives the weights back first, then the rest
        h.release([live.url])
        h.finish()
        assert _released(client, live.url) == [] and h.resumed_count == 1 and _generates(live.url)
        h.finish()  # nothing released: nothing to do

        # after a trainer's death: every engine resumed; one that was not released may refuse, none fails
        client.release_memory_occupation(live.url)
        resume_engines([live.url], KEY)
        assert _released(client, live.url) == [] and _generates(live.url)
    finally:
        client.close()
        pool.shutdown()
        live.stop()
        doomed.kill()


def test_a_step_whose_engines_all_refuse_their_kv_cache_back_fails_with_the_setting_to_change(
    model_dir, monkeypatch
):
    """Every released engine refuses to take its KV cache back (as a CUDA out-of-memory does when the
    trainer's memory and the engine's pool do not fit one device): nothing would ever generate again, so
    the step fails with the cause and the settings to change instead of the job waiting forever."""
    live = EngineServer(str(model_dir), api_key=KEY, torch_threads=1).start()
    client = EngineClient(KEY, 10.0)
    pool = ThreadPoolExecutor(2)
    resume = live.runner.resume_memory

    def short_of_memory(tags):
        if "kv_cache" in tags:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1.20 GiB (injected)")
        return resume(tags)

    try:
        h = MemoryHandoff(client, pool)
        monkeypatch.setattr(live.runner, "resume_memory", short_of_memory)
        h.release([live.url])
        h.resume_weights()
        with pytest.raises(colocation.NoRoomToResume, match="mem_fraction_static.*micro_batch_tokens"):
            h.finish()
        assert live.url in h.failures and h.released == [] and h.resumed_count == 0
        monkeypatch.setattr(live.runner, "resume_memory", resume)  # room again: the next step goes on
        h.release([live.url])
        h.finish()
        assert h.resumed_count == 1 and _generates(live.url)
    finally:
        client.close()
        pool.shutdown()
        live.stop()
