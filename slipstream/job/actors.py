"""Ray actors: thin wrappers that host one component each in its own process.

Each actor logs INFO to `<output_dir>/logs/<name>.log` (WARNING and up also reach the driver) and serves
its Prometheus metrics on its node's address (`node_address`), registering it in Redis for scraping.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from urllib.parse import urlparse

import msgspec
import ray

from common.logtext import PlainFormatter
from common.startup import without_gc
from generator_fleet.config import EvalConfig, GeneratorsSpec, RolloutConfig
from generator_fleet.engine.options import EngineOptions
from jobspec import JobSpec
from models.config import LoraSpec
from replay_buffer.client import connect
from replay_buffer.keys import JobKeys
from slipstream.job.model_files import local_model
from trainer.config import TrainerConfig
from trainer.result import TrainerResult


class JobRef(msgspec.Struct, frozen=True):
    """What an engine process needs of its job: the name (its metrics key) and the output directory (its
    log). Trainer and rollout processes get the same two fields in their component's config."""

    name: str
    output_dir: str


def job_ref(spec: JobSpec) -> JobRef:
    return JobRef(name=spec.name, output_dir=spec.output_dir)


def _setup_process(
    job: JobRef | TrainerConfig | RolloutConfig | EvalConfig,
    name: str,
    redis_url: str,
    threads: int | None = None,
) -> None:
    """Logging, threads and metrics of this actor's process, for the job `job` names. `threads`: torch's
    intra-op threads, for a process that computes with torch; None for one that does not (a rollout worker,
    the evaluator, a launcher of outside engines), which then never imports torch (with the tokenizer's
    and GPU metrics' paths kept clear of it too, a rollout worker of the tiny model starts in 1.2 CPU-s
    instead of 2.45)."""
    from slipstream.job import gpu_metrics

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    log_dir = Path(job.output_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    fh = logging.FileHandler(log_dir / f"{name}.log")
    fh.setFormatter(PlainFormatter(fmt._fmt))  # no colours or progress-bar redraws in the file
    sh = logging.StreamHandler()
    sh.setLevel(logging.WARNING)
    sh.setFormatter(fmt)
    root.handlers[:] = [fh, sh]
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns the state changes
    gpu_metrics.register()  # this process's GPUs, if it has any
    host = node_address(redis_url)
    port = serve_metrics(redis_url, job.name, name, host)
    logging.getLogger(__name__).info("%s: pid %d, metrics on %s:%d", name, os.getpid(), host, port)


def _with_model_path(config, path: str):
    """`config` (a rollout worker's or the evaluator's) reading the model (its tokenizer) from `path`."""
    if path == config.model.path:
        return config
    return msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, path=path))


def node_address(redis_url: str) -> str:
    """Where this actor's servers (a built-in engine, the metrics endpoint) listen: 127.0.0.1 on a Ray
    cluster of one node whose job dials Redis on loopback, so that nothing leaves it (Ray reports a host's
    external IP as its node's address even for a cluster on 127.0.0.1); on a cluster other nodes can join
    (its Redis on a routable address: `cluster up --host`) or have joined, this node's address in the
    cluster (the one its raylet registered, which the other nodes reach), never every interface, so that a
    node that joins after the job started reaches what runs here. Outside Ray, 127.0.0.1."""
    if not ray.is_initialized():
        return "127.0.0.1"
    head = urlparse(redis_url).hostname or "127.0.0.1"
    if head.startswith("127.") or head in ("localhost", "::1"):
        if len([n for n in ray.nodes() if n.get("Alive")]) == 1:
            return "127.0.0.1"
    return ray.util.get_node_ip_address()


def serve_metrics(redis_url: str, job: str, replica: str, host: str = "127.0.0.1") -> int:
    """This process's Prometheus registry on `host`, registered in Redis as `replica` of `job` for
    scraping (slipstream/cluster/targets.py); its port."""
    from prometheus_client import start_http_server

    server, _ = start_http_server(0, addr=host)  # port 0: the OS picks one, no race for it
    connect(redis_url).hset(JobKeys(job).metrics_targets, replica, f"{host}:{server.server_port}")
    return server.server_port


def _export(registry) -> None:
    """Serve a component's own registry (the engine's sglang:* and slipstream_engine_* metrics, kept
    per engine) on this process's metrics port too, the address Prometheus discovers (file_sd)."""
    from prometheus_client import REGISTRY
    from prometheus_client.registry import Collector

    class Forward(Collector):
        def collect(self):
            return registry.collect()

    REGISTRY.register(Forward())


@ray.remote(num_cpus=0, max_concurrency=2)  # watch() blocks; stop() must still get through
class EngineActor:
    """One built-in engine. `joining`: started mid-job (scaling up): it waits in the registry's joining set,
    taking no rollout traffic, until the weight bus has given it the current weights."""

    @without_gc  # its imports and model load: common/startup.py
    def __init__(
        self,
        job: JobRef,
        options: EngineOptions,
        redis_url: str,
        api_key: str,
        index: int,
        joining: bool = False,
    ) -> None:
        """`options`: the engine's (jobspec.engine_options)."""
        from generator_fleet.engine import EngineServer

        _setup_process(job, f"engine-{index}", redis_url, options.torch_threads or 1)
        lora = "a LoRA job's engines load the base weights from it" if options.lora is not None else ""
        who = f"engine-{index}"
        path, weights = local_model(options.model_path, who, redis_url, job.name, need_weights=lora)
        if not weights:  # random weights until the bus gives it the trainer's: no traffic before then
            options = msgspec.structs.replace(
                options,
                model_path=path,
                load_format="dummy",
                served_model_name=options.served_model_name or options.model_path,
            )
            joining = True
            logging.getLogger(__name__).info(
                "engine-%d starts with random weights and joins once the weight bus gave it the trainer's",
                index,
            )
        self.redis_url, self.job, self.joining = redis_url, job.name, joining
        self.lora = options.lora
        if options.host == "127.0.0.1":  # the job's own engines: reachable from the trainer's node too
            options = msgspec.structs.replace(options, host=node_address(redis_url))
        self.server = EngineServer(options, api_key=api_key)

    @without_gc  # the model's modeling import and load
    def start(self) -> str:

        from weight_bus.registry import EngineRegistration

        self.server.start()
        if self.lora is not None and not self.joining:
            # A LoRA job's version 0 is its untrained adapter (B = 0: the base model's outputs), served
            # from the start so that rollouts and the version-0 eval can name it; the trainer's first
            # publish replaces it. An engine joining mid-job gets the current adapter before traffic.
            self.server.runner.load_lora(self.lora.name, self.lora.peft_config(), {})
            logging.getLogger(__name__).info(
                "engine serves the untrained adapter %r at version 0", self.lora.name
            )
        _export(self.server.app.state.engine.metrics.registry)
        self.registration = EngineRegistration(
            connect(self.redis_url), self.job, self.server.url, joining=self.joining
        )
        return self.server.url

    def watch(self) -> None:
        """Returns when the server stopped; the job driver holds this call to learn of the engine's death
        (the call fails with the actor). An engine that a fatal CUDA error made unhealthy stops itself,
        and this call fails with the cause, so the driver replaces it."""
        self.server.serve_forever()
        if self.server.fatal is not None:
            try:
                self.registration.close()  # rollout workers stop routing here before the driver acts
            except Exception as e:  # the lease runs out anyway
                logging.getLogger(__name__).warning("leaving the engine registry failed: %s", e)
            raise RuntimeError(f"engine unhealthy: {self.server.fatal}")

    def pid(self) -> int:
        return os.getpid()

    def stop(self, drain_s: float = 0.0) -> None:
        """Leave the registry, give rollout workers `drain_s` to notice (scaling down: new requests go to
        the other engines), then stop; requests still running here fail and are retried elsewhere."""
        import time

        self.registration.close()
        if drain_s > 0:
            time.sleep(drain_s)
        self.server.stop()


@ray.remote(num_cpus=0, max_concurrency=2)  # watch() blocks; stop() must still get through
class SGLangEngineActor:
    """One real SGLang server (`engine: sglang`), a subprocess of this actor logging to
    `<output_dir>/logs/sglang-<index>.log`. The generator pool reserves its GPUs (`.options(num_gpus=...)`);
    Ray sets this actor's CUDA_VISIBLE_DEVICES to them and the server inherits it. The engine joins the
    registry itself, or the job's sglang-router when there is one (rollout requests then go there)."""

    def __init__(
        self,
        job: JobRef,
        model_path: str,
        generators: GeneratorsSpec,
        redis_url: str,
        api_key: str,
        index: int,
        lora: LoraSpec | None = None,
    ) -> None:
        from generator_fleet.launch import SGLangServer, write_untrained_adapter

        _setup_process(job, f"engine-{index}", redis_url)
        local_model(model_path, f"engine-{index}", redis_url, job.name, need_weights="SGLang loads it")
        self.redis_url, self.job, self.router_url = redis_url, job.name, generators.router_url
        self.api_key = api_key
        initial = None
        if lora is not None:
            # A LoRA job's version 0 (B = 0: the base model's outputs), loaded at start so that rollouts can
            # name the adapter before the trainer's first publish replaces it (unload + load).
            path = Path(job.output_dir) / "lora" / f"untrained-{index}"
            initial = str(write_untrained_adapter(model_path, lora, path))
        self.server = SGLangServer(
            model_path,
            generators.sglang,
            log_path=Path(job.output_dir) / "logs" / f"sglang-{index}.log",
            api_key=api_key,
            lora=lora,
            initial_adapter=initial,
        )
        self.registration = None

    def start(self) -> str:

        from generator_fleet.launch import HealthCheckedRegistration, router_add_worker

        self.server.start()
        if self.router_url:
            router_add_worker(self.router_url, self.server.url, self.api_key)
        else:
            self.registration = HealthCheckedRegistration(
                connect(self.redis_url),
                self.job,
                self.server.url,
                api_key=self.api_key,
                alive=self.server.alive,
            )
        return self.server.url

    def watch(self) -> None:
        """Returns when the SGLang server process has exited (see EngineActor.watch)."""
        import time

        while self.server.alive():
            time.sleep(1.0)

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        from generator_fleet.launch import router_remove_worker

        if self.registration is not None:
            self.registration.close()
        if self.router_url and self.server.alive():
            router_remove_worker(self.router_url, self.server.url, self.api_key)
        self.server.stop()


@ray.remote(num_cpus=0)
class ExternalEnginesActor:
    """Engines someone else runs (`engine: external`) and/or a job's sglang-router: checks they answer
    /health and holds their registry leases, renewed only while they keep answering."""

    def __init__(
        self, job: JobRef, redis_url: str, api_key: str | None, urls: list[str], router_url: str | None
    ) -> None:
        from generator_fleet.launch import ExternalEngines

        _setup_process(job, "external-engines", redis_url)
        self.redis_url, self.job = redis_url, job.name
        self.engines = ExternalEngines(urls, router_url, api_key)

    def attach(self) -> list[str]:

        return self.engines.attach(connect(self.redis_url), self.job)

    def stop(self) -> None:
        self.engines.detach()


@ray.remote(num_cpus=0)
class RolloutActor:
    @without_gc  # its imports and tokenizer: common/startup.py
    def __init__(
        self, config: RolloutConfig, redis_url: str, engine_urls: list[str], api_key: str, index: int
    ) -> None:
        from generator_fleet.rollout import RolloutWorker

        _setup_process(config, f"rollout-{index}", redis_url)
        path, _ = local_model(config.model.path, f"rollout-{index}", redis_url, config.name)  # the tokenizer
        config = _with_model_path(config, path)
        self.worker = RolloutWorker(config, redis_url, engine_urls, api_key, worker_id=index)

    async def run(self) -> dict:
        return await self.worker.run()

    async def stop(self) -> None:
        self.worker.stop()
        await asyncio.sleep(0)

    async def pid(self) -> int:
        return os.getpid()

    async def stacks(self) -> list[str]:
        """Where each of this process's asyncio tasks waits: its chain of awaits, outermost first (a
        stalled job's diagnosis: slipstream/job/faults.py)."""
        out = []
        for task in asyncio.all_tasks():
            frames, coro = [], task.get_coro()
            while coro is not None and len(frames) < 16:
                if frame := getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None):
                    code = frame.f_code
                    frames.append(f"{code.co_name} ({code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})")
                coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
            if frames:
                out.append(" > ".join(frames))
        return out


@ray.remote(num_cpus=0)
class EvalActor:
    """The job's evaluator (generator_fleet/evaluation.py), beside its rollout workers."""

    @without_gc  # its imports and tokenizer: common/startup.py
    def __init__(
        self,
        config: EvalConfig,
        redis_url: str,
        engine_urls: list[str],
        api_key: str,
        priority: int | None,
        index: int = 0,
    ) -> None:
        from generator_fleet.evaluation import Evaluator

        _setup_process(config, f"evaluator-{index}", redis_url)
        path, _ = local_model(
            config.model.path, f"evaluator-{index}", redis_url, config.name
        )  # the tokenizer
        config = _with_model_path(config, path)
        self.evaluator = Evaluator(config, redis_url, engine_urls, api_key, priority)

    async def run(self) -> dict:
        return await self.evaluator.run()

    async def evaluate_now(self, timeout_s: float | None = None) -> dict | None:
        return await self.evaluator.evaluate_now(timeout_s)

    async def stop(self) -> None:
        self.evaluator.stop()
        await asyncio.sleep(0)


@ray.remote(num_cpus=0, max_concurrency=2)  # run() blocks; stop() must still get through
class TrainerActor:
    """One rank of the trainer pool (one GPU with device cuda: the trainer pool reserves it). Created before
    the engines are up (its imports and model check overlap theirs); `setup` builds the trainer for the
    engines of that moment."""

    @without_gc  # its imports and model load: common/startup.py
    def __init__(self, config: TrainerConfig, redis_url: str, rank: int = 0, world_size: int = 1) -> None:
        import trainer.trainer  # noqa: F401 - the heavy imports, while the engines start

        _setup_process(config, f"trainer-{rank}", redis_url, config.trainer.torch_threads)
        need = "a trainer rank loads it"
        local_model(config.model.path, f"trainer-{rank}", redis_url, config.name, need_weights=need)
        self.config, self.redis_url, self.rank, self.world_size = config, redis_url, rank, world_size
        self.trainer = None
        self._store = None
        """Rank 0 of several: the trainer group's store, hosted by `rendezvous` until `setup` joins it."""

    def rendezvous(self, host: str | None = None) -> tuple[str, int]:
        """Rank 0: host the trainer group's store on this node (a port the OS picks, listening before
        any rank is told it) and say where it is: on `host`, else this node's IP. The ranks' transports
        listen on the same address (trainer.distributed.transport_on)."""
        from trainer.distributed import host_store

        host = host or ray.util.get_node_ip_address()
        self._store = host_store(host, self.world_size)
        return host, self._store.port

    @without_gc
    def setup(
        self, engine_urls: list[str], api_key: str | None, master: tuple[str, int] | None = None
    ) -> None:
        """Every rank at once (joining the group blocks until all ranks have), publishing to `engine_urls`."""
        from trainer.trainer import Trainer

        self.trainer = Trainer(self.config, self.redis_url, engine_urls, api_key, self.rank, self.world_size)
        self.trainer.setup(master, self._store)

    def run(self) -> TrainerResult:
        result = self.trainer.run()  # ends with the HF export of the final policy to <output_dir>/final_model
        self.trainer.close()
        return result

    def stop(self, restart: bool = False, checkpoint: bool = True) -> None:
        if self.trainer is not None:  # else not set up: the pool kills a rank that never trained
            self.trainer.stop(restart, checkpoint)

    def request_checkpoint(self) -> None:
        if self.trainer is not None:
            self.trainer.request_checkpoint()

    def pid(self) -> int:
        return os.getpid()
