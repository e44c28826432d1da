"""A lost reply to a rollout loop's buffer calls, for real: Redis applied the call, then the connection
dropped before its reply arrived, and the product's client (replay_buffer/client.connect_async) sent it
again. Through a TCP proxy that swallows that one reply:
- an admission holds one slot, not two: a second would never be given back while the worker lives, and
  enough of them (a Redis restart under busy workers) hold admission shut;
- a put stores its group once and counts its slot out once (twice: a duplicate to skip, and a reservation
  count below the truth, which the worker's leave would turn into a slot taken for good);
- a release gives its slot back once (twice: one admission more than the cap allows)."""

from __future__ import annotations

import asyncio

from sample_pair import one_token_group
from tls_proxy import pipe

from replay_buffer import BufferProducer, scripts
from replay_buffer.client import connect_async
from replay_buffer.keys import JobKeys


class ReplyDropper:
    """A TCP proxy in front of redis-server. Armed, it forwards the next EVALSHA to Redis, swallows Redis's
    reply and closes both connections, as a Redis killed right after applying a command does."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.armed = False
        self._drop_reply = False
        self.dropped = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, client_r, client_w) -> None:
        redis_r, redis_w = await asyncio.open_connection("127.0.0.1", self.target_port)

        def up(data: bytes) -> bytes:
            if self.armed and b"EVALSHA" in data.upper():
                self.armed, self._drop_reply = False, True
            return data

        def down(data: bytes) -> bytes | None:
            if self._drop_reply:  # applied by Redis; the client never hears of it
                self._drop_reply = False
                self.dropped += 1
                redis_w.close()
                return None
            return data

        await asyncio.gather(pipe(client_r, redis_w, up), pipe(redis_r, client_w, down))


async def _behind_dropper(redis_server, job_id) -> tuple[ReplyDropper, object, BufferProducer]:
    """(the proxy, the product's async client through it, worker w0's producer on that client)."""
    proxy = ReplyDropper(redis_server.port)
    port = await proxy.start()
    r = connect_async(redis_server.url.replace(f":{redis_server.port}/", f":{port}/"))
    return proxy, r, BufferProducer(r, job_id, worker_id="w0")


def test_a_retried_admission_holds_one_slot(redis_server, redis_client, job_id):
    keys = JobKeys(job_id)

    async def scenario():
        proxy, r, p = await _behind_dropper(redis_server, job_id)
        assert await p.admit(2, 1, caller=0) == 0  # the script is loaded; an ordinary call
        proxy.armed = True
        assert await p.admit(2, 1, caller=1) == 0  # applied, its reply lost, retried: the same answer
        assert proxy.dropped == 1
        assert int(redis_client.get(keys.started)) == 2
        assert int(redis_client.hget(keys.reservations, "w0")) == 2
        # the next call of the same loop is a new one, and takes a slot of its own
        assert await p.admit(2, 1, caller=1) == 0
        assert int(redis_client.get(keys.started)) == 3
        assert await p.leave() == 3  # every slot back, and the worker's answered calls gone with it
        assert int(redis_client.get(keys.started)) == 0
        assert redis_client.hkeys(keys.admit_calls) == []
        await r.aclose()
        proxy.server.close()

    asyncio.run(scenario())


def test_a_retried_put_or_release_ends_its_slot_once(redis_server, redis_client, job_id):
    keys = JobKeys(job_id)

    async def scenario():
        proxy, r, p = await _behind_dropper(redis_server, job_id)
        # two loops admitted at version 0, each with its prompt in flight
        for caller, prompt in ((0, "a"), (1, "b")):
            assert await p.admit(2, 1, caller=caller) == 0
            await p.begin(prompt)
        await r.script_load(scripts.END_SLOT)  # the armed EVALSHA is the call itself, not a NOSCRIPT miss
        proxy.armed = True
        # applied, its reply lost, retried
        entry = await p.put(one_token_group(job_id, "a"), admitted_at=0, caller=0)
        assert proxy.dropped == 1
        assert [e[0].decode() for e in redis_client.xrange(keys.groups)] == [entry]  # stored once
        assert int(redis_client.hget(keys.stats, "produced")) == 1
        assert int(redis_client.hget(keys.reservations, "w0")) == 1
        assert int(redis_client.get(keys.started)) == 2  # a put keeps its slot (the trainer's step frees it)
        proxy.armed = True
        await p.release("b", admitted_at=0, caller=1)  # applied, its reply lost, retried
        assert proxy.dropped == 2
        assert int(redis_client.get(keys.started)) == 1  # given back once
        assert int(redis_client.hget(keys.reservations, "w0")) == 0
        assert redis_client.lrange(keys.inflight("w0"), 0, -1) == []
        assert redis_client.hgetall(keys.admitted) == {}  # neither admission is in flight any more
        # the loops' next admissions are new calls: each takes a slot and ends it once more
        assert await p.admit(2, 1, caller=0) == 0
        await p.release(admitted_at=0, caller=0)
        assert int(redis_client.get(keys.started)) == 1
        assert await p.leave() == 0  # nothing held, nothing to give back
        assert redis_client.hkeys(keys.admit_calls) == []
        await r.aclose()
        proxy.server.close()

    asyncio.run(scenario())
