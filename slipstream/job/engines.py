"""How a job's engines are launched, attached and stopped: the actor class and Ray resources of one
engine (`builtin`, `sglang`, or colocated on a trainer rank's device), starting the job's engines or
attaching to external ones (and a router), and stopping them before the other actors. The generator
pool (slipstream/job/generators.py) supervises and scales what these start."""

from __future__ import annotations

import os
from typing import NamedTuple

from jobspec import JobSpec, engine_options
from slipstream.job.placement import Colocation, engine_spec, require_resources
from slipstream.job.supervise import STOP_TIMEOUT_S


class EngineURLs(NamedTuple):
    workers: list[str]
    """Every engine; the weight bus pauses and updates each of them."""
    rollout: list[str]
    """Where rollout requests go: the sglang-router when there is one, else the engines."""
    api_key: str | None
    """The key every engine (and router) takes."""


def engine_actor(spec: JobSpec, placement: Colocation | None = None, slot: int = 0):
    """(actor class with the Ray resources of one launched engine, its GPUs): `builtin` or `sglang`.
    With a colocated `placement`, the engine takes its share of device slot `slot` instead."""
    from slipstream.job.actors import EngineActor, SGLangEngineActor

    g = spec.generators
    cls = SGLangEngineActor if g.engine == "sglang" else EngineActor
    if placement is not None:
        opts = placement.engine(slot)
        return cls.options(num_cpus=g.cpus_per_engine, **opts), opts["num_gpus"]
    res = dict(g.resources)
    if g.engine == "sglang":
        gpus = g.sglang.tp_size if g.sglang.gpus_per_engine is None else g.sglang.gpus_per_engine
        return cls.options(num_gpus=gpus, num_cpus=g.cpus_per_engine, resources=res), gpus
    return cls.options(
        num_gpus=g.gpus_per_engine, num_cpus=g.cpus_per_engine, resources=res
    ), g.gpus_per_engine


def launch_engine(
    spec: JobSpec,
    redis_url: str,
    api_key: str,
    index: int,
    joining: bool = False,
    placement: Colocation | None = None,
    slot: int = 0,
):
    """The actor of launched engine `index` (`builtin` or `sglang`), not started yet. `joining`: a
    built-in engine started mid-job waits in the registry's joining set until the bus gave it weights.
    `placement`, `slot`: a colocated engine shares device slot `slot` with trainer rank `slot`."""
    from slipstream.job.actors import job_ref

    if placement is not None:
        spec = engine_spec(spec)
    cls, _ = engine_actor(spec, placement, slot)
    if spec.generators.engine == "builtin":
        return cls.remote(job_ref(spec), engine_options(spec), redis_url, api_key, index, joining=joining)
    return cls.remote(
        job_ref(spec), spec.model.path, spec.generators, redis_url, api_key, index, spec.model.lora
    )


def start_engines(
    spec: JobSpec, redis_url: str, api_key: str, engine_actors: list, placement: Colocation | None = None
) -> EngineURLs:
    """Start (`builtin`, `sglang`) or attach to (`external`) the job's engines, appending each actor to
    `engine_actors` as soon as it exists so that teardown reaches it even when a start fails. Launched
    engines take the job's fresh `api_key`; external ones the key in `generators.api_key_env`. With a
    colocated `placement`, engine i shares device slot i with trainer rank i."""
    import ray

    from slipstream.job.actors import ExternalEnginesActor, job_ref

    g = spec.generators
    require_resources("generators.resources", g.resources)
    if g.engine == "external":
        api_key = None
        if g.api_key_env is not None:
            api_key = os.environ.get(g.api_key_env)
            if not api_key:
                raise RuntimeError(f"generators.api_key_env: environment variable {g.api_key_env} is not set")
        attach = ExternalEnginesActor.options(resources=dict(g.resources)).remote(
            job_ref(spec), redis_url, api_key, g.urls, g.router_url
        )
        engine_actors.append(attach)
        workers = ray.get(attach.attach.remote())
    else:
        if placement is not None:
            placement.reserve()  # fails naming what Ray lacks, instead of waiting forever
        else:
            _, gpus = engine_actor(spec)
            have = ray.cluster_resources().get("GPU", 0)
            if gpus * g.num_engines > have:  # Ray would wait for them forever
                raise RuntimeError(
                    f"engine {g.engine}: {g.num_engines} engines x {gpus} GPUs, but Ray sees {have:g} GPUs "
                    "(generators.gpus_per_engine, or generators.sglang.gpus_per_engine: 0 for a CPU build)"
                )
        started = [
            launch_engine(spec, redis_url, api_key, i, placement=placement, slot=i)
            for i in range(g.num_engines)
        ]
        engine_actors += started
        workers = ray.get([e.start.remote() for e in started])
        if g.router_url:  # the engines joined the router; the router joins the registry
            attach = ExternalEnginesActor.options(resources=dict(g.resources)).remote(
                job_ref(spec), redis_url, api_key, workers, g.router_url
            )
            engine_actors.append(attach)
            ray.get(attach.attach.remote())
    rollout = [g.router_url.rstrip("/")] if g.router_url else workers
    return EngineURLs(workers, rollout, api_key)


def stop_actors(engine_actors: list, actors: list) -> None:
    """Stop a job's actors: engines first and politely (an SGLang server is a process of its own, which
    ray.kill, a SIGKILL of the actor, would leave to the kernel's parent-death signal), then kill all."""
    import ray

    if engine_actors:
        stops = [e.stop.remote() for e in engine_actors]
        ray.wait(stops, num_returns=len(stops), timeout=STOP_TIMEOUT_S)
    for a in engine_actors + actors:
        try:
            ray.kill(a)
        except Exception:  # already dead
            pass
