"""Rollout worker: keeps `concurrency` groups in flight, samples G responses per prompt from the engines,
scores them and streams each finished group into the replay buffer. It never waits for the trainer;
only admission control (max_staleness versions ahead) holds it back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time

from generator_fleet import metrics
from generator_fleet.client import EngineClient, EngineError, GenerateResult
from generator_fleet.config import RolloutConfig
from generator_fleet.tasks import build_task
from generator_fleet.tasks.heldout import training_task
from generator_fleet.workflow import build_workflow
from replay_buffer import BufferProducer, Sample, make_group
from replay_buffer.client import connect_async
from weight_bus.registry import live_engines

log = logging.getLogger(__name__)

ENGINE_REFRESH_S = 0.5
"""How often a worker re-reads the engine registry (seconds): joins and deaths take effect within this
(a promoted engine takes traffic within a fraction of a trainer step; one Redis read per worker each time)."""
ADMISSION_POLL_S = 0.05
"""How often a worker blocked by admission control re-checks the version (seconds)."""
MAX_ATTEMPTS = 5
"""Engine errors tolerated per group before the group is given up (its admission slot is released)."""
RETRY_BACKOFF_S = 0.1
"""First wait before retrying an engine that already failed this batch (no other engine to try); doubles
with every attempt. With every engine down, retries and given-up groups would otherwise spin as fast as
connections are refused, taking the CPU a replacement engine and the trainer need."""
GIVE_UP_BACKOFF_MAX_S = 4.0
"""Longest wait after a given-up group before the next one (doubling from RETRY_BACKOFF_S per group
given up in a row; a finished group resets it)."""


def adapter_name(model) -> str | None:
    """The adapter a job's generation requests name (`lora_path`): model.lora.name, None without LoRA."""
    return model.lora.name if model.lora is not None else None


class EngineRouter:
    """Routes each request to the live engine with the fewest outstanding requests. Membership follows
    the engine registry (`update`); a removed engine keeps its client until its in-flight calls end."""

    def __init__(self, urls: list[str], api_key: str | None, lora_path: str | None = None) -> None:
        """`lora_path`: the LoRA adapter every generation runs with (a LoRA job's `model.lora.name`)."""
        self.api_key = api_key
        self.lora_path = lora_path
        self.clients: dict[str, EngineClient] = {}
        self.outstanding: dict[str, int] = {}
        self.routable: list[str] = []
        self.update(urls)

    def update(self, urls: list[str]) -> None:
        for u in urls:
            if u not in self.clients:
                self.clients[u] = EngineClient(u, api_key=self.api_key, lora_path=self.lora_path)
                self.outstanding[u] = 0
        if sorted(urls) != sorted(self.routable):
            log.info("engines now %s (were %s)", sorted(urls), sorted(self.routable))
        self.routable = list(urls)

    def pick(self, exclude: set[str] = frozenset(), prefer: str | None = None) -> str:
        """`prefer` while it is routable and not excluded (the engine that holds a group's context in
        its prefix cache), else the engine with the fewest requests outstanding."""
        choices = [u for u in self.routable if u not in exclude] or self.routable
        if not choices:
            raise EngineError(None, "no live engine", "engine registry")
        if prefer in choices:
            return prefer
        return min(choices, key=lambda u: self.outstanding[u])

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients.values()))


class RolloutWorker:
    def __init__(
        self,
        config: RolloutConfig,
        redis_url: str,
        engine_urls: list[str],
        api_key: str | None,
        worker_id: int = 0,
    ) -> None:
        self.config = config
        self.redis_url = redis_url
        self.engine_urls = engine_urls
        self.api_key = api_key
        self.worker_id = worker_id
        self.rng = random.Random(config.dataset.seed * 1000 + worker_id)
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> dict:
        from models.tokenizers import load_tokenizer

        cfg = self.config
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.task = training_task(build_task(cfg.dataset), cfg.eval)
        self.workflow = build_workflow(cfg, self.tokenizer, self.task)
        self.engines = EngineRouter(self.engine_urls, self.api_key, adapter_name(cfg.model))
        r = connect_async(self.redis_url)
        # Unique per process: a restarted worker must not inherit (or release) a dead one's reservations.
        name = f"{socket.gethostname()}-{os.getpid()}-{self.worker_id}"
        self.producer = BufferProducer(
            r, cfg.name, worker_id=name, lease_ms=int(cfg.buffer.worker_lease_s * 1000)
        )
        self.produced = 0
        self.filtered = 0
        self._given_up_in_a_row = 0
        """Groups given up one after another (every engine failing): the wait before the next grows."""
        self._filter_version, self._filtered_in_version, self._cap_warned = -1, 0, False
        self.redis = r
        heartbeat = asyncio.create_task(self._heartbeat())
        registry = asyncio.create_task(self._follow_registry())
        log.info(
            "rollout worker %d: %d engines, concurrency %d",
            self.worker_id,
            len(self.engine_urls),
            cfg.rollout.concurrency,
        )
        try:
            await asyncio.gather(*(self._loop(i) for i in range(cfg.rollout.concurrency)))
        finally:
            heartbeat.cancel()
            registry.cancel()
            released = await self.producer.leave()
            if released:
                log.info("rollout worker %s released %d unfinished reservations", name, released)
            await self.engines.aclose()
            await r.aclose()
        log.info(
            "rollout worker %d stopped after %d groups (%d filtered)",
            self.worker_id,
            self.produced,
            self.filtered,
        )
        return {"groups": self.produced, "filtered": self.filtered}

    async def _heartbeat(self) -> None:
        """Keep this worker's lease alive while groups take long (admission calls renew it too)."""
        period = self.config.buffer.worker_lease_s / 3
        while True:
            await asyncio.sleep(period)
            await self.producer.heartbeat()

    async def _next_problem(self):
        """A prompt a dead worker left unfinished first, then a recycled one (its group went stale), else a
        fresh sample from the task."""
        if prompt_id := await self.producer.next_reissued():
            metrics.REISSUED.inc()
            log.info("generating prompt %s again: a dead worker left it unfinished", prompt_id)
            return self.task.get(prompt_id)
        if self.config.buffer.stale_policy == "recycle" and (
            prompt_id := await self.producer.next_recycled()
        ):
            metrics.RECYCLED.inc()
            return self.task.get(prompt_id)
        return self.task.sample(self.rng)

    async def _loop(self, caller: int) -> None:
        buf = self.config.buffer
        while not self._stop.is_set():
            admitted_at = await self.producer.admit(
                self.config.groups_per_step,
                buf.max_staleness,
                oldest=buf.admission == "oldest",
                caller=caller,
            )
            if admitted_at is None:
                metrics.ADMISSION_WAITS.inc()
                await self._idle(ADMISSION_POLL_S)
                continue
            problem = await self._next_problem()
            await self.producer.begin(problem.prompt_id)
            try:
                samples = await self._group(problem)
            except EngineError as e:
                await self.producer.release(problem.prompt_id, admitted_at, caller)
                self._given_up_in_a_row += 1
                wait_s = min(RETRY_BACKOFF_S * 2**self._given_up_in_a_row, GIVE_UP_BACKOFF_MAX_S)
                log.error("group for %s given up: %s; next group in %.1f s", problem.prompt_id, e, wait_s)
                await self._idle(wait_s)
                continue
            self._given_up_in_a_row = 0
            if reason := await self._filter(samples):
                await self.producer.release(problem.prompt_id, admitted_at, caller)
                metrics.GROUPS_FILTERED.labels(reason).inc()
                self.filtered += 1
                log.debug("group for %s filtered (%s): not put into the buffer", problem.prompt_id, reason)
                continue
            await self.producer.put(
                make_group(self.config.name, problem.prompt_id, samples), admitted_at, caller
            )
            self.produced += 1

    async def _idle(self, seconds: float) -> None:
        """Wait `seconds`, or less when the worker is stopped meanwhile."""
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except TimeoutError:
            pass

    async def _filter(self, samples: list[Sample]) -> str | None:
        """Why a finished group is not put into the buffer, or None to keep it. `overlong`: overlong
        filtering left no trainable token. `uniform` (dynamic sampling): every reward is equal, so GRPO's
        advantages are all 0; at most `max_filtered_per_step` per buffer version, then such groups are kept."""
        if self.config.rollout.overlong_filter and not any(s.view("loss_mask").any() for s in samples):
            return "overlong"
        ds = self.config.rollout.dynamic_sampling
        if not ds.enabled or any(s.reward != samples[0].reward for s in samples):
            return None
        version = await self.producer.version()
        if version != self._filter_version:
            self._filter_version, self._filtered_in_version = version, 0
        if self._filtered_in_version >= ds.max_filtered_per_step:
            if not self._cap_warned:
                self._cap_warned = True
                log.warning(
                    "dynamic sampling: %d groups filtered at version %d (max_filtered_per_step); keeping "
                    "uniform-reward groups until the next version (warned once)",
                    self._filtered_in_version,
                    version,
                )
            return None
        self._filtered_in_version += 1
        return "uniform"

    async def _generate(
        self, input_ids: list[list[int]], params: list[dict], home: list[str] | None = None
    ) -> list[GenerateResult]:
        """One batched /generate on the least-loaded engine, or on the group's `home` engine (its first
        call's: the engine whose prefix cache holds the group's prompt and earlier turns); an engine error
        retries the whole batch on another engine (up to MAX_ATTEMPTS) from the same token prefix, so a
        dying engine loses no sample, and the group's home moves there."""
        failed: set[str] = set()
        for attempt in range(1, MAX_ATTEMPTS + 1):
            url = self.engines.pick(exclude=failed, prefer=home[0] if home else None)
            if url in failed:  # every routable engine failed this batch already: give them a moment
                await asyncio.sleep(RETRY_BACKOFF_S * 2 ** (attempt - 2))
            self.engines.outstanding[url] += len(input_ids)
            try:
                out = await self.engines.clients[url].generate_batch(input_ids, params, return_logprob=True)
                if home is not None:
                    home[:] = [url]
                return out
            except EngineError as err:
                failed.add(url)
                metrics.ENGINE_ERRORS.inc()
                if attempt == MAX_ATTEMPTS:
                    raise
                log.warning("engine %s failed (%s); retrying elsewhere", url, err)
            finally:
                self.engines.outstanding[url] -= len(input_ids)
        raise AssertionError("unreachable")

    async def _follow_registry(self) -> None:
        """Route to the engines whose registry lease is live; without registrations, keep the static list."""
        while True:
            try:
                if live := await live_engines(self.redis, self.config.name):
                    self.engines.update(live)
            except Exception as e:  # a Redis hiccup must not stop generation; try again next round
                log.warning("engine registry refresh failed: %s", e)
            await asyncio.sleep(ENGINE_REFRESH_S)

    async def _group(self, problem) -> list[Sample]:
        t0 = time.monotonic()
        home: list[str] = []  # the engine the group's calls go to (see _generate)

        async def generate(input_ids: list[list[int]], params: list[dict]) -> list[GenerateResult]:
            return await self._generate(input_ids, params, home)

        samples = await self.workflow.run(problem, generate, self._stop.is_set)
        metrics.GROUP_SECONDS.observe(time.monotonic() - t0)
        return samples
