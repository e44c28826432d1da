"""`slipstream run`: bring up a job on a local Ray instance — private Redis, engines, rollout workers,
one trainer — stream its progress, and tear everything down on every way out (Ctrl-C included).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import msgspec
import redis

from jobspec import JobSpec, engine_options, to_json
from replay_buffer import JobKeys, ReplayBuffer
from replay_buffer.client import connect
from replay_buffer.redis_server import ManagedRedis
from slipstream.cluster.services import project_pythonpath

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[2]


STOP_TIMEOUT_S = 30.0
TOOLS_WARMUP_PROBLEMS = 4000


class JobResult(msgspec.Struct):
    version: int
    elapsed_s: float
    final_model: str
    progress: list[dict]
    buffer: dict


def resolve_paths(spec: JobSpec) -> JobSpec:
    """Absolute paths (actors run with another working directory), by jobspec.resolve_paths' rule:
    relative to this process's working directory."""
    import jobspec

    return jobspec.resolve_paths(spec, Path.cwd())


def prepare_model(spec: JobSpec) -> None:
    """Build the model if the spec asks for a recipe and the directory has none yet. Jobs (and `run`s)
    sharing one model.path build it once: under an exclusive lock on `.<name>.lock` beside it, into a
    temporary directory beside it, renamed into place when complete; a second job waits for the lock
    and then finds the finished model, never a half-written one."""
    import fcntl
    import tempfile

    path = Path(spec.model.path)
    if (path / "config.json").exists():
        return
    build = spec.model.build
    if build is None:
        raise FileNotFoundError(f"model.path {path} has no config.json and model.build is not set")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("model %s is being built by another job; waiting for it", path)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "config.json").exists():
            log.info("model %s was built by another job; using it", path)
            return
        if path.exists():
            if not path.is_dir() or any(path.iterdir()):
                raise FileExistsError(
                    f"model.path {path} exists but holds no model (no config.json; an interrupted build?): "
                    "remove it, or point model.path elsewhere"
                )
            path.rmdir()  # an empty directory: the build takes its place
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.building-", dir=path.parent))
        try:
            log.info("building %s model at %s (in %s until complete)", build, path, tmp)
            _build_model(spec, build, tmp)
            os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("built %s model at %s", build, path)


def _build_model(spec: JobSpec, build: str, path: Path) -> None:
    if build == "tiny-arith":
        from model_zoo.warmup import build_tiny_arith

        build_tiny_arith(
            path,
            max_operand=spec.dataset.max_operand,
            warmup_steps=spec.model.warmup_steps,
            seed=spec.dataset.seed,
        )
    elif build == "tiny-tools":
        from generator_fleet.tasks import build_task
        from model_zoo.tiny_tools import build_tiny_tools

        build_tiny_tools(
            path,
            build_task(spec.dataset).problems,
            warmup_steps=spec.model.warmup_steps,
            seed=spec.dataset.seed,
        )
    elif build == "smollm2-135m":
        from model_zoo.smollm2 import build_smollm2

        build_smollm2(path)
    else:
        raise ValueError(f"unknown model.build {build!r}")


def format_progress(r: dict, total_steps: int, agent: bool = False) -> str:
    line = (
        f"step {r['step']:>4}/{total_steps}  version {r['version']:>4}  reward {r['reward_mean']:.3f}  "
        f"staleness {r['staleness_mean']:.2f} (max {r['staleness_max']})  "
        f"loss {r['loss']:+.4f}  tok/s {r['tokens_per_s']:.0f}  step {r['step_s'] * 1e3:.0f} ms  "
        f"wait {r['wait_s'] * 1e3:.0f} ms  swap {r['pause_s'] * 1e3:.0f} ms"
    )
    if agent:  # multi-turn jobs: how the episodes went
        line += (
            f"  turns {r['turns_mean']:.2f}  tool calls {r['tool_calls_mean']:.2f} (errors "
            f"{r['tool_errors_mean']:.2f})  budget-out {r['finish_tool_budget']:.2f}"
        )
    return line


RUN_FILES = ("samples.txt", "progress.jsonl", "report_reward.png", "report_staleness.png",
             "report_throughput.png")  # fmt: skip
"""Per-run outputs in a job's output_dir: a new run of the job starts without them."""


def reset_run_state(out: Path, managed_redis: bool) -> None:
    """A new run of a job starts fresh: a previous run's private Redis (its AOF would bring back the old
    version and stream, and the job would think it was already done) and its per-run outputs go.
    The model directory, checkpoints and logs stay. (The job driver resets the run's Redis keys:
    ReplayBuffer.begin_run.)"""
    stale = [out / name for name in RUN_FILES]
    if managed_redis:
        stale.append(out / "redis")
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path)
            log.info("removed the previous run's %s", path)
        elif path.exists():
            path.unlink()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _interrupt_on_signals() -> None:
    """Ctrl-C and SIGTERM both unwind run_job through its `finally` (actors, Ray, Redis stopped).
    Installed after ray.init, which sets handlers of its own; SIGINT is re-enabled even when the shell
    started us with it ignored (background jobs)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _raise_interrupt)


class ProgressReader:
    """Follows a job's trainer progress stream: the records of its current run (one JSON record per
    optimizer step; a new run of the name starts with an empty stream). `elapsed_s` is the run's clock,
    which every trainer pool of the run continues (ReplayBuffer.start_clock). Each record gains
    `tokens_per_s` and `samples_per_s`: response tokens and samples trained so far in the run ÷ its
    elapsed_s. A record whose version is not past the previous one's (the pool restarted from an older
    checkpoint: the steps after it were lost and the trainer dropped their records) supersedes the records
    it repeats: they leave `records` and the sums."""

    def __init__(self, r: redis.Redis, job: str) -> None:
        self.r, self.key = r, JobKeys(job).progress
        self.last_id = "0"
        self.records: list[dict] = []
        """Every record of the run so far, superseded ones removed."""
        self.tokens = 0
        self.samples = 0

    def read(self, block_ms: int = 500) -> list[dict]:
        out = []
        block = block_ms if block_ms > 0 else None  # BLOCK 0 would wait forever
        for _, entries in self.r.xread({self.key: self.last_id}, block=block, count=100) or []:
            for entry_id, fields in entries:
                self.last_id = entry_id
                rec = json.loads(fields[b"j"])
                while self.records and self.records[-1]["version"] >= rec["version"]:
                    gone = self.records.pop()
                    self.tokens -= gone["response_tokens"]
                    self.samples -= gone.get("samples", 0)
                self.tokens += rec["response_tokens"]
                self.samples += rec.get("samples", 0)
                elapsed = max(rec["elapsed_s"], 1e-9)
                rec["tokens_per_s"] = self.tokens / elapsed
                rec["samples_per_s"] = self.samples / elapsed
                self.records.append(rec)
                out.append(rec)
        return out


class EngineURLs(NamedTuple):
    workers: list[str]
    """Every engine; the weight bus pauses and updates each of them."""
    rollout: list[str]
    """Where rollout requests go: the sglang-router when there is one, else the engines."""
    api_key: str | None
    """The key every engine (and router) takes."""


def engine_actor(spec: JobSpec):
    """(actor class with the Ray resources of one launched engine, its GPUs): `builtin` or `sglang`."""
    from slipstream.job.actors import EngineActor, SGLangEngineActor

    g = spec.generators
    if g.engine == "sglang":
        gpus = g.sglang.tp_size if g.sglang.gpus_per_engine is None else g.sglang.gpus_per_engine
        return SGLangEngineActor.options(num_gpus=gpus, num_cpus=g.cpus_per_engine), gpus
    return EngineActor.options(num_gpus=g.gpus_per_engine, num_cpus=g.cpus_per_engine), g.gpus_per_engine


def launch_engine(spec: JobSpec, redis_url: str, api_key: str, index: int, joining: bool = False):
    """The actor of launched engine `index` (`builtin` or `sglang`), not started yet. `joining`: a
    built-in engine started mid-job waits in the registry's joining set until the bus gave it weights."""
    cls, _ = engine_actor(spec)
    if spec.generators.engine == "builtin":
        return cls.remote(spec, engine_options(spec), redis_url, api_key, index, joining=joining)
    return cls.remote(spec, redis_url, api_key, index)


def start_engines(spec: JobSpec, redis_url: str, api_key: str, engine_actors: list) -> EngineURLs:
    """Start (`builtin`, `sglang`) or attach to (`external`) the job's engines, appending each actor to
    `engine_actors` as soon as it exists so that teardown reaches it even when a start fails. Launched
    engines take the job's fresh `api_key`; external ones the key in `generators.api_key_env`."""
    import ray

    from slipstream.job.actors import ExternalEnginesActor

    g = spec.generators
    if g.engine == "external":
        api_key = None
        if g.api_key_env is not None:
            api_key = os.environ.get(g.api_key_env)
            if not api_key:
                raise RuntimeError(f"generators.api_key_env: environment variable {g.api_key_env} is not set")
        attach = ExternalEnginesActor.remote(spec, redis_url, api_key, g.urls, g.router_url)
        engine_actors.append(attach)
        workers = ray.get(attach.attach.remote())
    else:
        _, gpus = engine_actor(spec)
        have = ray.cluster_resources().get("GPU", 0)
        if gpus * g.num_engines > have:  # Ray would wait for them forever
            raise RuntimeError(
                f"engine {g.engine}: {g.num_engines} engines x {gpus} GPUs, but Ray sees {have:g} GPUs "
                "(generators.gpus_per_engine, or generators.sglang.gpus_per_engine: 0 for a CPU build)"
            )
        started = [launch_engine(spec, redis_url, api_key, i) for i in range(g.num_engines)]
        engine_actors += started
        workers = ray.get([e.start.remote() for e in started])
        if g.router_url:  # the engines joined the router; the router joins the registry
            attach = ExternalEnginesActor.remote(spec, redis_url, api_key, workers, g.router_url)
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


def init_local_ray(env: dict[str, str] | None = None, num_cpus: int | None = None) -> None:
    """A private Ray instance for one job on this machine; every actor gets the project on its path,
    no hub access, and `env`."""
    import ray

    ray.init(
        address="local",
        num_cpus=num_cpus or max(2, os.cpu_count() or 2),
        include_dashboard=False,
        log_to_driver=True,
        logging_level=logging.WARNING,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": project_pythonpath(),
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
                **(env or {}),
            }
        },
    )


def run_job(spec: JobSpec, on_progress: Callable[[dict], None] | None = None) -> JobResult:
    """Run `spec` to completion on a fresh local Ray instance with the cluster's job driver
    (slipstream/job/driver.py: the same pools, supervision and teardown); returns the summary."""
    import ray

    from slipstream.cluster.job_store import JobStore
    from slipstream.job.driver import JobDriver

    spec = resolve_paths(spec)
    out = Path(spec.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    reset_run_state(out, managed_redis=spec.redis.url is None)
    (out / "job.json").write_text(to_json(spec))
    prepare_model(spec)

    managed = None
    if spec.redis.url is None:
        managed = ManagedRedis(data_dir=out / "redis", appendfsync=spec.redis.appendfsync).start()
    redis_url = spec.redis.url or managed.url
    url_file = out / "redis.url"  # for `slipstream buffer stats JOB` while the job runs; holds a secret
    url_file.touch(mode=0o600)
    url_file.write_text(redis_url)
    r = connect(redis_url)
    driver = None
    t0 = time.monotonic()
    try:
        init_local_ray()
        log.info("ray started; job %s", spec.name)
        _interrupt_on_signals()
        store = JobStore(r)
        store.create(spec.name, to_json(spec), spec.generators.num_engines, spec.trainer.num_trainers)
        driver = JobDriver(spec, redis_url, store, on_progress=on_progress)
        result = driver.run()
        driver.close()
        stats = ReplayBuffer(r, spec.name).stats()
        progress = driver.records
        (out / "progress.jsonl").write_text("".join(json.dumps(p) + "\n" for p in progress))
        from slipstream.job.report import write_report_logged

        write_report_logged(progress, out)  # PNG plots; never fails the job
        return JobResult(result["version"], time.monotonic() - t0, result["final_model"], progress, stats)
    finally:
        if driver is not None:
            driver.close()  # idempotent: a second call finds nothing left to stop
        if ray.is_initialized():
            ray.shutdown()
        r.close()
        if managed:
            managed.stop()
            url_file.unlink(missing_ok=True)
        log.info("job %s: everything stopped", spec.name)
