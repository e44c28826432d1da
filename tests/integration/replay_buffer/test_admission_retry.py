"""A lost reply to an admission call, for real: Redis applied the call, then the connection dropped before
its reply arrived, and the product's client (replay_buffer/client.connect_async) sent it again. Through a
TCP proxy that swallows that one reply, the worker holds one slot, not two: a second would never be given
back while the worker lives, and enough of them (a Redis restart under busy workers) hold admission shut."""

from __future__ import annotations

import asyncio

from tls_proxy import pipe

from replay_buffer import BufferProducer
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


def test_a_retried_admission_holds_one_slot(redis_server, redis_client, job_id):
    keys = JobKeys(job_id)

    async def scenario():
        proxy = ReplyDropper(redis_server.port)
        port = await proxy.start()
        r = connect_async(redis_server.url.replace(f":{redis_server.port}/", f":{port}/"))
        p = BufferProducer(r, job_id, worker_id="w0")
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
