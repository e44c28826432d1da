"""The sync schedule of colocated placement (verl's hybrid engine): the engines give their device memory
to the trainer for each optimizer step and take it back for the publish, through SGLang's own routes
(POST /release_memory_occupation, /resume_memory_occupation), so real SGLang engines work alike.

One step, driven by trainer rank 0 (trainer/trainer.py):
  1. release — once the trainer has its batch, before any rank trains: every engine in the update group
     releases its KV cache, weights and CUDA graphs (all tags);
  2. the optimizer step runs with the device to itself;
  3. resume weights — the engines get their weight memory back (contents undefined until 4);
  4. publish — the weights handed over in place (bus.backend ipc);
  5. resume kv_cache + cuda_graph — the engines take rollout requests again.

An engine that fails a call (it died, or timed out) is left out of the rest of the step and logged; the
job's generator pool replaces a dead one, and its replacement joins through the bus as usual.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from prometheus_client import Counter, Gauge, Histogram

from weight_bus.engine_client import EngineClient
from weight_bus.errors import Refused

log = logging.getLogger(__name__)

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
RELEASE_SECONDS = Histogram(
    "slipstream_colocated_release_seconds",
    "Sync schedule: engines releasing their memory (kv_cache, weights, cuda_graph) before a step",
    buckets=_BUCKETS,
)
RESUME_SECONDS = Histogram(
    "slipstream_colocated_resume_seconds",
    "Sync schedule: engines resuming their memory around the publish (weights, then kv_cache and "
    "cuda_graph), the publish itself not counted",
    buckets=_BUCKETS,
)
RELEASES = Counter("slipstream_colocated_releases_total", "Engine memory releases (one per engine per step)")
HANDOFF_FAILURES = Counter(
    "slipstream_colocated_handoff_failures_total",
    "Release or resume calls an engine failed (dead, timed out)",
)
RELEASED = Gauge("slipstream_colocated_engines_released", "Engines whose memory is released now")

WEIGHTS = ["weights"]
"""Tags resumed before the publish: the weights must be resident to be written."""
REST = ["kv_cache", "cuda_graph"]
"""Tags resumed after the publish; resuming them lets generation go on."""


class MemoryHandoff:
    """Releases and resumes the memory of a colocated job's engines, in parallel, and remembers which
    engines are released (only those are resumed). The seconds of the last release and of the last
    resume (weights and the rest together) are kept for the step's progress record."""

    def __init__(self, client: EngineClient, calls: ThreadPoolExecutor) -> None:
        self.client, self.calls = client, calls
        self.released: list[str] = []
        """Engines released and not yet fully resumed."""
        self.weights_back = False
        """The released engines have their weight memory again (step 3 done)."""
        self.release_s = 0.0
        self.resume_s = 0.0
        self.released_count = 0
        self.resumed_count = 0
        """Engines the last release reached, and engines the last resume gave all their memory back."""
        self.failures: dict[str, Exception] = {}
        """The engines whose last call failed, with why."""

    def _each(self, urls: list[str], call, what: str) -> list[str]:
        """`call(url)` on every engine at once; the engines where it succeeded (failures logged)."""
        futures = {url: self.calls.submit(call, url) for url in urls}
        ok = []
        self.failures = {}
        for url, fut in futures.items():
            try:
                fut.result()
                ok.append(url)
            except (Refused, httpx.HTTPError) as e:
                HANDOFF_FAILURES.inc()
                self.failures[url] = e
                log.warning("engine %s: %s failed (%s); it sits out this step", url, what, e)
        return ok

    def release(self, urls: list[str]) -> float:
        """Step 1 on `urls`; returns its seconds."""
        t = time.monotonic()
        self.released = self._each(urls, lambda u: self.client.release_memory_occupation(u), "release")
        self.weights_back, self.resume_s = False, 0.0
        self.released_count, self.resumed_count = len(self.released), 0
        self.release_s = time.monotonic() - t
        RELEASE_SECONDS.observe(self.release_s)
        RELEASES.inc(len(self.released))
        RELEASED.set(len(self.released))
        log.info(
            "engines released their memory (kv_cache, weights, cuda_graph) for the optimizer step: "
            "%d of %d in %.3f s",
            len(self.released),
            len(urls),
            self.release_s,
        )
        return self.release_s

    def resume_weights(self) -> None:
        """Step 3 on the released engines."""
        t = time.monotonic()
        self.released = self._each(
            self.released, lambda u: self.client.resume_memory_occupation(u, tags=WEIGHTS), "resume weights"
        )
        self.weights_back = True
        took = time.monotonic() - t
        self.resume_s += took
        log.info(
            "engines resumed their weight memory for the publish: %d in %.3f s", len(self.released), took
        )

    def finish(self) -> None:
        """Step 5 on the released engines: they generate again. Weights first if step 3 did not run (the
        step failed before its publish). Nothing to do when no engine is released."""
        if not self.released:
            return
        if not self.weights_back:
            self.resume_weights()
        t = time.monotonic()
        done = self._each(
            self.released, lambda u: self.client.resume_memory_occupation(u, tags=REST), "resume kv_cache"
        )
        took = time.monotonic() - t
        self.resume_s += took
        refused = {u: e for u, e in self.failures.items() if isinstance(e, Refused)}
        self.released, self.resumed_count = [], len(done)
        RESUME_SECONDS.observe(self.resume_s)
        RELEASED.set(0)
        log.info("engines resumed kv_cache and cuda_graph and generate again: %d in %.3f s", len(done), took)
        if not done and refused:  # alive, yet none can generate: the job would wait for rollouts forever
            url, err = next(iter(refused.items()))
            raise NoRoomToResume(
                f"no colocated engine could take its KV cache back after the optimizer step ({url}: {err}); "
                "the trainer's and the engines' memory do not fit on one device together: lower "
                "generators.mem_fraction_static (the engine's share) or trainer.micro_batch_tokens"
            )


class NoRoomToResume(RuntimeError):
    """Every released engine refused to take its KV cache back (out of memory, mostly): nothing would
    generate again, so the step fails with the cause (a repeat ends the job: the trainer's restart budget)."""


def resume_engines(urls: list[str], api_key: str | None, timeout_s: float = 10.0) -> dict[str, Exception]:
    """Resume all the memory of each engine in turn (engines a colocated trainer left released when it
    died mid-step); returns the failures by URL (an engine that was not released may refuse)."""
    failed: dict[str, Exception] = {}
    with EngineClient(api_key, timeout_s) as client:
        for url in urls:
            try:
                client.resume_memory_occupation(url)
            except (Refused, httpx.HTTPError) as e:
                failed[url] = e
    return failed
