"""What the registry's tests and the launch tests both ask of the engine registry."""

import asyncio

import redis.asyncio as aioredis

from weight_bus.registry import live_engines


def live(redis_server, job: str) -> list[str]:
    """The engines whose lease is live in `job`'s registry, read the way rollout workers read it."""

    async def go():
        r = aioredis.Redis.from_url(redis_server.url)
        try:
            return await live_engines(r, job)
        finally:
            await r.aclose()

    return asyncio.run(go())
