"""Engine registry on a real redis-server, and rollout routing that follows it with real engines: an
engine that joins gets traffic, one whose lease lapses gets none, a dead engine's batch is retried
elsewhere."""

import asyncio

import redis.asyncio as aioredis
from registry_helpers import live

import jobspec
from generator_fleet.engine import EngineServer
from generator_fleet.rollout import EngineRouter, RolloutWorker
from weight_bus.registry import EngineRegistration, EngineRegistry, engines_key

KEY = "reg-key"


def test_registration_lease_and_deregistration(redis_server, redis_client, job_id):
    a = EngineRegistration(redis_client, job_id, "http://a:1", lease_s=60)
    b = EngineRegistration(redis_client, job_id, "http://b:2", lease_s=60)
    assert live(redis_server, job_id) == ["http://a:1", "http://b:2"]
    b._stop.set()  # b stops renewing ...
    redis_client.zadd(engines_key(job_id), {"http://b:2": 0})  # ... and its lease runs out
    assert live(redis_server, job_id) == ["http://a:1"]
    a.close()
    assert live(redis_server, job_id) == []


def test_joining_engine_is_hidden_until_promoted_and_demoted_one_rejoins(redis_server, redis_client, job_id):
    registry = EngineRegistry(redis_client, job_id)
    a = EngineRegistration(redis_client, job_id, "http://a:1", lease_s=60)
    late = EngineRegistration(redis_client, job_id, "http://late:2", lease_s=60, joining=True)
    assert live(redis_server, job_id) == ["http://a:1"] and registry.joining() == ["http://late:2"]
    late.renew()  # renewing does not make it live
    assert live(redis_server, job_id) == ["http://a:1"]
    assert registry.promote("http://late:2") and not registry.promote("http://late:2")
    late.renew()  # once live, it stays live
    assert live(redis_server, job_id) == ["http://a:1", "http://late:2"] and registry.joining() == []

    registry.demote("http://a:1")  # the weight bus dropped it: no traffic from now on ...
    assert live(redis_server, job_id) == ["http://late:2"]
    a.renew()  # ... and if it is alive, it waits as a joiner for the current weights
    assert registry.joining() == ["http://a:1"] and live(redis_server, job_id) == ["http://late:2"]
    a.close()
    late.close()
    assert registry.joining() == [] and live(redis_server, job_id) == []


def test_router_follows_membership_and_balances():
    router = EngineRouter(["http://a:1"], None)
    router.outstanding["http://a:1"] = 3
    router.update(["http://a:1", "http://b:2"])
    assert router.pick() == "http://b:2"  # fewest outstanding
    # a group's home engine (its prefix cache holds the group's context) while it is routable and not
    # excluded, however loaded
    assert router.pick(prefer="http://a:1") == "http://a:1"
    assert router.pick(exclude={"http://a:1"}, prefer="http://a:1") == "http://b:2"
    router.update(["http://b:2"])
    assert router.pick(prefer="http://a:1") == "http://b:2"  # gone from the fleet
    assert router.pick(exclude={"http://b:2"}) == "http://b:2" and "http://a:1" in router.clients


def test_worker_routes_to_joined_engine_and_retries_a_dead_one(redis_server, tiny_model_dir, job_id):
    spec = jobspec.from_dict({"name": job_id, "model": {"path": str(tiny_model_dir)}})
    first = EngineServer(str(tiny_model_dir), api_key=KEY, torch_threads=1).start()
    second = EngineServer(str(tiny_model_dir), api_key=KEY, torch_threads=1).start()
    try:
        worker = RolloutWorker(spec.rollout_config(), redis_server.url, [first.url], KEY)

        async def scenario():
            worker.engines = EngineRouter([first.url], KEY)
            worker.redis = aioredis.Redis.from_url(redis_server.url)
            reg = EngineRegistration(redis_server.client(), job_id, second.url, lease_s=60)
            follow = asyncio.create_task(worker._follow_registry())
            try:
                deadline = asyncio.get_running_loop().time() + 30
                while worker.engines.routable != [second.url]:  # the registry lists only `second`
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.05)
                res = await worker._generate([[1, 5, 6]], [{"max_new_tokens": 3, "temperature": 0}])
                assert len(res[0].output_ids) == 3
                # A dead engine in the routable set: the batch is retried on a live one.
                first.stop()
                worker.engines.update([first.url, second.url])
                worker.engines.outstanding[second.url] = 100  # make the dead one the first pick
                res = await worker._generate([[1, 5, 6]], [{"max_new_tokens": 3, "temperature": 0}])
                assert len(res[0].output_ids) == 3
            finally:
                follow.cancel()
                reg.close()
                await worker.engines.aclose()
                await worker.redis.aclose()

        asyncio.run(scenario())
    finally:
        second.stop()
        first.stop()
