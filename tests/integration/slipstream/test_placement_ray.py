"""Ray placement of a colocated job (slipstream/job/placement.py) on a real local Ray. The GPU case runs on
a Ray that declares two GPUs (Ray assigns GPU ids and CUDA_VISIBLE_DEVICES from its own bookkeeping, so
the placement is checked without a GPU): engine i and trainer rank i get the same GPU, different slots
get different ones, and a replacement lands where its predecessor was. On CPU every actor is pinned to
the driver's node."""

import os
import time

import pytest
import ray
from ray_fixtures import shutdown_shared_ray

import jobspec
from slipstream.job.placement import Colocation, colocation, engine_spec

CUDA = {"placement": "colocated", "trainer": {"device": "cuda"}, "generators": {"gpus_per_engine": 1}}


@ray.remote(num_cpus=0)
class Where:
    def where(self) -> tuple[str, list, str | None]:
        return (
            ray.get_runtime_context().get_node_id(),
            [str(g) for g in ray.get_gpu_ids()],
            os.environ.get("CUDA_VISIBLE_DEVICES"),
        )


@pytest.fixture(scope="module")
def ray_with_two_gpus():
    shutdown_shared_ray()  # its own Ray, not the job tests' shared one
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def _where(options: dict) -> tuple[str, list, str | None]:
    actor = Where.options(**options).remote()
    try:
        return ray.get(actor.where.remote(), timeout=60)
    finally:
        ray.kill(actor)


def test_engine_and_trainer_rank_share_their_gpu(ray_with_two_gpus):
    one = colocation(jobspec.from_dict(CUDA))  # a job's: one slot per trainer rank
    assert isinstance(one, Colocation) and one.cuda and one.slots == 1
    place = Colocation(cuda=True, slots=2)  # two slots, as two ranks would have
    try:
        place.reserve()
        assert place.engine(0)["num_gpus"] == place.trainer(0)["num_gpus"] == 0.5
        slots = []
        for slot in (0, 1):
            e, t = _where(place.engine(slot)), _where(place.trainer(slot))
            assert e[1] == t[1] and len(e[1]) == 1, (e, t)  # one GPU, the same one
            assert e[2] == t[2] == e[1][0]  # and CUDA_VISIBLE_DEVICES agrees
            slots.append(e[1][0])
        assert slots[0] != slots[1]
        # a replacement for engine 1 (a new actor on slot 1) lands on the same GPU as rank 1
        assert _where(place.engine(1))[1] == [slots[1]]
        # the whole reservation is held: nothing else gets a GPU while the job runs
        assert ray.available_resources().get("GPU", 0) == 0
    finally:
        place.close()
    deadline = time.monotonic() + 30  # the removal is asynchronous; a bound, not a threshold
    while ray.available_resources().get("GPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("GPU", 0) == 2  # given back when the job ends


def test_more_trainer_gpus_than_a_node_has_fail_naming_them(ray_with_two_gpus):
    with pytest.raises(RuntimeError, match=r"3 trainer ranks need 3 GPUs on one node .* has 2"):
        Colocation(cuda=True, slots=3).reserve()


def test_on_cpu_every_actor_is_pinned_to_the_driver_node(ray_with_two_gpus):
    spec = jobspec.from_dict({"placement": "colocated", "generators": {"num_engines": 2}})
    place = colocation(spec)
    try:
        node = ray.get_runtime_context().get_node_id()
        for opts in (place.engine(0), place.engine(1), place.trainer(0)):
            assert opts["num_gpus"] == 0
            where = _where(opts)
            assert where[0] == node and where[1] == []
    finally:
        place.close()
    assert colocation(jobspec.from_dict({})) is None  # disaggregated: no colocation


def test_engine_defaults_follow_the_schedule():
    sync = jobspec.from_dict(
        {
            "placement": "colocated",
            "trainer": {"device": "cuda"},
            "generators": {"engine": "sglang"},
            "buffer": {"max_staleness": 0},
        }
    )
    assert engine_spec(sync).generators.sglang.enable_memory_saver  # it could not release without it
    asyn = jobspec.from_dict({**CUDA, "buffer": {"max_staleness": 1}})
    assert engine_spec(asyn).generators.mem_fraction_static == 0.3
    given = jobspec.from_dict({**CUDA, "generators": {**CUDA["generators"], "mem_fraction_static": 0.5}})
    assert engine_spec(given).generators.mem_fraction_static == 0.5
    cpu = jobspec.from_dict({"placement": "colocated"})
    assert engine_spec(cpu) is cpu
