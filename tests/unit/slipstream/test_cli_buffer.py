"""`slipstream buffer stats JOB` against a real redis-server."""

import json

from sample_pair import one_token_group

from replay_buffer import ReplayBuffer
from slipstream.cli import main


def test_buffer_stats_shows_depth_pending_dead_letter_and_staleness(
    redis_server, redis_client, job_id, capsys
):
    buf = ReplayBuffer(redis_client, job_id)
    buf.ensure_group()
    redis_client.xadd(buf.keys.groups, {"d": b"junk"})
    for _ in range(3):
        buf.put(one_token_group(job_id))
    buf.commit(buf.take_batch(2, 1, 1, block_ms=50), version=1)
    buf.take_batch(1, 1, 1, block_ms=50)  # read, not committed

    assert main(["buffer", "stats", job_id, "--redis-url", redis_server.url, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert (
        st["pending"] == 1 and st["consumed"] == 2 and st["dead_letter"] == 1 and st["dead_letter_depth"] == 1
    )
    assert st["staleness"] == {"1": 2}

    assert main(["buffer", "stats", job_id, "--redis-url", redis_server.url]) == 0
    text = capsys.readouterr().out
    assert "pending" in text and "dead_letter" in text and "staleness of consumed groups" in text


def test_buffer_stats_without_a_redis_says_why(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_REDIS_URL", raising=False)
    assert main(["buffer", "stats", "nojob", "--output-dir", str(tmp_path)]) == 2
    assert "redis.url" in capsys.readouterr().err
