"""One weight update over the group that `Membership` keeps: pause the engines, announce and broadcast
every bucket (the next one packed while earlier ones are on the wire), recover from an engine lost
mid-update, continue the engines. The update's order and failure semantics are in weight_bus/bus.py."""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from weight_bus import lora as adapters
from weight_bus.engine_client import EngineClient
from weight_bus.errors import BusError, Refused, UpdateFailed, _error
from weight_bus.group import broadcast_async
from weight_bus.membership import IPC, MAX_REBUILDS, Member, Membership
from weight_bus.packing import Bucket, pack
from weight_bus.receiver import FLATTENED_BUCKET
from weight_bus.schema import UpdateWeightsFromDistributed, WeightLayout
from weight_bus.stats import PublishStats, record_publish
from weight_bus.stream import Plan, Recorder, Sent, arena_plan, named_plan, pack_arena, run_stream

log = logging.getLogger(__name__)

MAX_INFLIGHT = 2
"""Default for buckets announced and broadcast but not yet confirmed; the next one is packed meanwhile,
so the trainer holds at most max_inflight + 1 bucket buffers. More hides more per-bucket HTTP latency
(an engine hears of bucket k + max_inflight once bucket k is confirmed)."""
POLL_S = 1e-4
"""How often an unconfirmed bucket is checked (its broadcast and every engine's HTTP answer)."""


# Long: one update and its recovery share the members, the in-flight ring and the timeline; split by phase
#   into methods
class Transfer:
    """Publishes one version at a time to the engines of `members` (the caller serializes updates)."""

    def __init__(
        self,
        members: Membership,
        client: EngineClient,
        calls: ThreadPoolExecutor,
        bucket_bytes: int,
        pause_mode: str,
        device: torch.device,
        max_inflight: int,
        repair_in_stream: bool,
        lora=None,
        lora_dir: str | None = None,
        stream: bool = True,
        stage: bool = False,
    ) -> None:
        """`lora` (a models.config.LoraSpec): every update is adapter-only (weight_bus/lora.py);
        `lora_dir`: where the adapter's PEFT directories go for engines that load it from disk.
        `stream`: once the trainer's tensors are known (after the first update) and every engine is a
        built-in one, send each update as one call per engine (weight_bus/stream.py); `stage`: streamed
        engines receive into a staging arena while they generate and swap at the end."""
        self.members, self.client, self.calls = members, client, calls
        self.lora = lora
        self.lora_dir = lora_dir
        self.bucket_bytes = bucket_bytes
        self.pause_mode = pause_mode
        self.device = device
        self.max_inflight = max(1, max_inflight)
        self.repair_in_stream = repair_in_stream
        self.timeout_s = members.timeout_s
        self.grace = members.grace
        self.max_failures = MAX_REBUILDS
        """Failed buckets one update may recover from before it gives up with BusError."""
        self.healthy = False
        """The last update reached every engine in the group and dropped none."""
        self.streamed = False
        """The last update was streamed (one call per engine)."""
        self.handoff = ""
        """PublishStats.handoff of the update under way."""
        self.stream, self.stage = stream, stage
        self.sent: dict[bool, list[Sent]] = {}
        """What the trainer sent in the last whole update (names, shapes, dtypes), by whether it was an
        adapter-only one: what streamed updates of that kind are planned from."""
        self.layouts: dict[str, WeightLayout] = {}
        """Engine weight layouts fetched, by digest."""
        self._plan: tuple[tuple, Plan] | None = None
        self._engine_pause_ms = 0.0
        self._staged = False
        self._engine_marks_ms: list[float] = []

    def _on_all(self, engines: list[Member], fn, *args) -> dict[str, BaseException]:
        """Call fn(url, *args) for every engine in parallel; returns the failures by URL."""
        futures = {e.url: self.calls.submit(fn, e.url, *args) for e in engines}
        return {u: f.exception() for u, f in futures.items() if f.exception() is not None}

    # Long: one update in order (membership, bucket 0, pause, transfer, continue, stats); every failure path
    #   ends in the same clean-up
    def publish(
        self, it: Iterator[tuple[str, torch.Tensor]], version: int, persistent: bool = False
    ) -> PublishStats:
        """Membership first (nothing paused yet), bucket 0 packed, then pause, transfer, continue (the
        pause folded into the update when `folds_pause` says so). The caller drains `it` afterwards,
        whatever happened. `persistent`: see WeightBus.publish."""
        m = self.members
        if self.client.is_closed:
            raise BusError("publish after close()")
        generation0 = m.generation
        t_start = time.perf_counter()
        probe = self.probe_due()
        self.healthy = False
        joined, dropped = m.sync(probe=probe)
        t_sync = time.perf_counter()
        dtype = m.wire_dtype()
        files = self.adapter_files()
        plan = None if files else self.stream_plan(dtype)
        seen = Recorder(it)
        t_gather = time.perf_counter()
        if plan is not None and plan.kind == "arena":
            stream = pack_arena(plan, iter(seen), self.device, self.max_inflight)
        else:
            stream = self.pack(iter(seen), dtype, whole=files, persistent=persistent and self.lora is None)
        # an arena stream announces itself before bucket 0 is packed: the engines take the call up and post
        # their receives while the trainer packs (run_stream packs bucket 0 after the announcement)
        early = (
            plan is not None and plan.kind == "arena" and bool(m.engines) and self.pause_mode == "in_place"
        )
        first = None if early else next(stream, None)
        gather_s = time.perf_counter() - t_gather
        if first is None and not early:
            raise BusError("publish: no tensors")
        if not m.engines:
            log.warning("version %d: no engine to update (none registered or all dropped)", version)
            return PublishStats(
                version=version, bytes=0, buckets=0, pause_ms=0.0, transfer_ms=0.0,
                gather_ms=gather_s * 1e3, engines=[], joined=[], dropped=dropped,
            )  # fmt: skip
        if (
            plan is not None
            and plan.kind == "named"
            and first is not None
            and first.names != plan.buckets[0].names
        ):
            log.warning("the trainer's tensors changed since the last update: this one goes bucket by bucket")
            plan = None
        fold = self.pause_mode == "in_place" if plan is not None else self.folds_pause(first)
        paused = [] if fold else list(m.engines)
        t_pause = time.perf_counter()
        total = n_buckets = 0
        timeline: list[list[float]] = []
        try:
            failed = self._on_all(paused, self.client.pause_generation, self.pause_mode)
            refused = {u: e for u, e in failed.items() if isinstance(e, Refused)}
            if refused and all(not isinstance(r, BaseException) for r in m.probe(list(refused)).values()):
                raise BusError(f"pause refused: {refused}")
            if failed:
                dropped += m.drop(list(failed))
                m.rebuild()
            t_transfer = time.perf_counter()
            self._engine_pause_ms, self._engine_marks_ms = 0.0, []
            if plan is not None:
                move = functools.partial(run_stream, self, plan)
            else:
                move = self._transfer_files if files else self._transfer
            total, n_buckets, pack_s, more_dropped, timeline = move(first, stream, version)
            gather_s += pack_s
            dropped += more_dropped
            t_moved = time.perf_counter()
            transfer_s = t_moved - t_transfer
        finally:
            # Engines dropped meanwhile are continued too (one that timed out may still be alive), but not
            # waited for: they may not answer at all.
            for url in {e.url for e in paused} - set(m.urls) - m.parked:
                self.calls.submit(self.client.continue_generation, url)
            failed = self._on_all([] if fold else m.engines, self.client.continue_generation)
            for url, err in failed.items():
                log.warning("engine %s: continue failed: %s", url, err)
            dropped += m.drop(list(failed))
        t_end = time.perf_counter()
        pause_s = t_end - t_pause  # folded: the engines wait at a step boundary meanwhile
        if plan is not None and fold:  # the engines said how long their generation waited
            pause_s = self._engine_pause_ms / 1e3
        if seen.complete and seen.sent:
            self.sent[self.lora is not None] = seen.sent
        self.healthy = bool(m.engines) and not dropped
        self.streamed = plan is not None
        m.promote(joined)
        stats = PublishStats(
            version=version,
            bytes=total,
            buckets=n_buckets,
            pause_ms=pause_s * 1e3,
            transfer_ms=transfer_s * 1e3,
            gather_ms=gather_s * 1e3,
            engines=m.urls,
            joined=[u for u in joined if u in m.urls],
            dropped=dropped,
            rebuilds=m.generation - generation0,
            timeline=timeline,
            adapter=self.lora.name if self.lora is not None else None,
            path="files" if files else ("ipc" if m.backend == IPC else "group"),
            stream=plan.kind if plan is not None else "",
            staged=plan is not None and self.stage and self._staged,
            engine_marks=self._engine_marks_ms,
            phases_ms={
                k: round(v * 1e3, 3)
                for k, v in (
                    ("membership", t_sync - t_start),
                    ("plan", t_gather - t_sync),
                    ("bucket0", t_pause - t_gather),
                    ("transfer", transfer_s),
                    ("after", t_end - t_moved),
                )
            },
            handoff=self.handoff,
            paused=not fold,
            probed=probe,
        )
        record_publish(stats, m.backend, total, transfer_s, pause_s)
        log.info(
            "published version %d%s to %d engines: %.1f MB in %d buckets, transfer %.1f ms (%.2f GB/s), "
            "engines paused %.1f ms%s, gather %.1f ms%s%s",
            version,
            f" (adapter {self.lora.name!r} only, {stats.path})" if self.lora is not None else "",
            len(m.engines),
            total / 1e6,
            n_buckets,
            stats.transfer_ms,
            total / max(transfer_s, 1e-9) / 1e9,
            stats.pause_ms,
            f" ({self.handoff or f'{plan.kind} stream'}, pause folded into the call)"
            if fold and (self.handoff or plan)
            else "",
            stats.gather_ms,
            f", joined {stats.joined}" if stats.joined else "",
            f", dropped {dropped}" if dropped else "",
        )
        return stats

    def _transfer(self, first: Bucket, stream: Iterator[Bucket], version: int):
        """Announce and broadcast every bucket, packing the next while the previous is on the wire; on a
        failure, rebuild over the survivors and re-send what they have not confirmed.
        Returns (bytes, buckets, seconds spent packing, engines dropped, timeline: see PublishStats)."""
        m = self.members
        t0 = time.perf_counter()
        timeline: list[list[float]] = []
        pending: deque[Bucket] = deque()
        nxt: Bucket | None = first
        total = count = 0
        pack_s = 0.0
        dropped: list[str] = []
        rebuilds = 0
        while (nxt is not None or pending) and m.engines:
            if nxt is not None and len(pending) < self.max_inflight:
                self.launch(nxt, version)
                pending.append(nxt)
                if nxt.last:
                    nxt = None
                else:
                    t = time.perf_counter()
                    nxt = next(stream)  # gathered and packed while the buckets before it are on the wire
                    pack_s += time.perf_counter() - t
                continue
            try:
                done = self.confirm(pending[0])
            except UpdateFailed as failure:
                rebuilds += 1
                if rebuilds > self.max_failures:
                    m.leave_group()
                    raise BusError(f"update failed {rebuilds} times; last: {failure}") from failure
                dropped += self.recover(failure, pending, confirmed=count)
                if not m.engines:
                    log.warning("version %d: every engine was dropped", version)
                    return total, count, pack_s, dropped, timeline
                self.resend(pending, version)
                continue
            pending.popleft()
            total += done.nbytes
            count += 1
            timeline.append([done.index] + [round((t - t0) * 1e3, 3) for t in done.times])
            self.release(done)
        return total, count, pack_s, dropped, timeline

    def stream_plan(self, dtype: torch.dtype | None) -> Plan | None:
        """The plan of a streamed update (weight_bus/stream.py), or None for per-bucket calls: the first
        update (what the trainer sends is not known yet), an engine that is not a built-in one, or
        streaming turned off. Arena buckets where every engine reports the same weight layout and the
        trainer's tensors fill it; else named buckets. Planned once per change of either."""
        m = self.members
        sent = self.sent.get(self.lora is not None)
        if not self.stream or sent is None or not m.engines or any(not e.builtin for e in m.engines):
            return None
        digests = sorted({str(e.layout) for e in m.engines if e.layout}) if self.lora is None else []
        single = len(digests) == 1 and all(e.layout for e in m.engines)
        key = (tuple(sent), self.bucket_bytes, dtype, tuple(digests) if single else None)
        if self._plan is not None and self._plan[0] == key:
            return self._plan[1]
        plan: Plan | str | None = None
        layout = None
        if single:
            digest = digests[0]
            layout = self.layouts.get(digest)
            if layout is None:
                try:
                    layout = self.layouts[digest] = self.client.weight_layout(m.engines[0].url)
                except Exception as e:  # this update goes as named buckets; the next one asks again
                    log.warning("weight layout of %s: %s", m.engines[0].url, e)
            if layout is not None and layout.digest == digest:
                plan = arena_plan(layout, sent, self.bucket_bytes)
                if isinstance(plan, str):
                    log.info("streamed weight updates go as named buckets: %s", plan)
                    plan = None
        if plan is None:
            plan = named_plan(sent, self.bucket_bytes, dtype)
        if not single or layout is not None:  # a layout that could not be fetched is asked for again
            self._plan = (key, plan)
        log.info(
            "weight updates stream as one call per engine: %d %s buckets (%.1f MB)%s",
            len(plan.buckets),
            plan.kind,
            sum(b.nbytes for b in plan.buckets) / 1e6,
            ", staged beside the serving weights" if self.stage and plan.kind == "arena" else "",
        )
        return plan

    def pack(
        self,
        it: Iterator[tuple[str, torch.Tensor]],
        dtype: torch.dtype | None,
        whole: bool = False,
        persistent: bool = False,
    ) -> Iterator[Bucket]:
        """The buckets of one update, packed lazily (weight_bus.packing.pack); `whole`: one bucket with
        every tensor (an adapter written to a directory), on the CPU. `persistent` matters to IpcTransfer
        only."""
        if whole:
            return pack(it, 1 << 62, dtype, torch.device("cpu"))
        return pack(it, self.bucket_bytes, dtype, self.device)

    def probe_due(self) -> bool:
        """Whether this update probes the engines in the group first, to rebuild the group without the
        dead before anything is sent. Not after a streamed update that reached every engine (the next
        one streams too): an engine dead since fails the stream's own call at once and is dropped then
        (the others stay paused until the next update, which probes and resends the whole model); the
        probe's round trip would cost every update ~0.5 ms per engine to save that one. Joiners are
        always probed."""
        return not (self.healthy and self.streamed)

    def folds_pause(self, first: Bucket) -> bool:
        """Whether this update goes without /pause_generation and /continue_generation (see IpcTransfer)."""
        return False

    def adapter_files(self) -> bool:
        """An adapter-only update that goes through a PEFT directory: a group transport (gloo/NCCL) to
        engines without the built-in engine's adapter-over-the-group extension (SGLang)."""
        m = self.members
        return self.lora is not None and m.backend != IPC and any(not e.builtin for e in m.engines)

    def replace_adapter(self, e: Member, load, version: int) -> dict:
        """On one engine, in order: replace adapter `lora.name` with `load(url)` and tag `version`
        (/update_weight_version: the LoRA routes carry none). SGLang refuses to load a name that is
        loaded, so there the adapter is unloaded first (refused when it is not loaded yet: ignored); the
        built-in engine replaces it in place, atomically."""
        name = self.lora.name
        if not e.builtin:
            try:
                self.client.unload_lora_adapter(e.url, name)
            except Refused as err:
                log.debug("engine %s: unload of adapter %s before its load: %s", e.url, name, err)
        load(e.url)
        return self.client.update_weight_version(e.url, version)

    def _transfer_files(self, first: Bucket, stream: Iterator[Bucket], version: int):
        """Adapter-only update through a PEFT directory (weight_bus/lora.py): write `<lora_dir>/v<version>`,
        have every engine replace the adapter from it, prune older directories. An engine that fails
        (transport error, no answer in time) is dropped; one that is alive and refuses is BusError.
        Returns what `_transfer` does."""
        m = self.members
        if self.lora_dir is None:
            raise BusError("adapter update through files needs the bus's lora_dir")
        t0 = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        for b in [first, *stream]:
            tensors.update(adapters.unpack(b))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        path = adapters.write_adapter_dir(
            adapters.version_dir(self.lora_dir, version), tensors, self.lora.peft_config()
        )
        pack_s = time.perf_counter() - t0
        t_written = time.perf_counter()

        def load(url: str) -> dict:
            return self.client.load_lora_adapter(url, self.lora.name, str(path))

        calls = {e.url: self.calls.submit(self.replace_adapter, e, load, version) for e in m.engines}
        wait(calls.values(), timeout=3 * self.timeout_s + self.grace)
        errors = {u: (_error(f) if f.done() else TimeoutError("no answer in time")) for u, f in calls.items()}
        errors = {u: e for u, e in errors.items() if e is not None}
        refused = {u: e for u, e in errors.items() if isinstance(e, Refused)}
        lost = set(errors) - set(refused)
        if refused:
            infos = m.probe(list(refused))
            alive = [u for u in refused if not isinstance(infos[u], BaseException)]
            if alive:
                raise BusError("; ".join(str(refused[u]) for u in alive))
            lost |= set(refused)
        dropped = m.drop(sorted(lost))
        for url in dropped:
            log.warning("engine %s dropped from the adapter update: %s", url, errors.get(url))
        for gone in adapters.prune(self.lora_dir):
            log.debug("pruned adapter directory %s", gone)
        t_done = time.perf_counter()
        timeline = [[0, 0.0, round((t_written - t0) * 1e3, 3), round((t_done - t0) * 1e3, 3)]]
        return total, 1, pack_s, dropped, timeline

    def resend(self, pending: deque[Bucket], version: int) -> None:
        """After `recover`: launch the unconfirmed buckets again, over the rebuilt group."""
        for b in pending:
            self.launch(b, version)

    def release(self, b: Bucket) -> None:
        """Bucket b is confirmed by every engine: its buffer may go."""
        b.flat = b.work = None

    def launch(self, b: Bucket, version: int) -> None:
        """Announce bucket b to every engine (the last one tagged with the version), then start its
        broadcast: an engine's handler blocks inside the collective, so the request goes out first."""
        m = self.members
        body = UpdateWeightsFromDistributed(
            names=b.names,
            dtypes=b.dtypes,
            shapes=b.shapes,
            group_name=m.name,
            load_format=FLATTENED_BUCKET,
            weight_version=str(version) if b.last else None,
            flush_cache=b.last,
            lora_name=self.lora.name if self.lora is not None else None,
            lora_config=self.lora.peft_config() if self.lora is not None else None,
        )
        b.times[0] = time.perf_counter()
        b.calls = {e.url: e.announce(body) for e in m.engines}
        try:
            b.work = broadcast_async(m.group, b.flat)
        except Exception as e:  # the group is already broken: confirm reports it
            b.work = e

    def confirm(self, b: Bucket) -> Bucket:
        """Wait (bounded) until bucket b's broadcast is done and every engine answered 200."""
        deadline = time.monotonic() + self.timeout_s + self.grace
        work = b.work
        while True:
            errors = {u: err for u, f in b.calls.items() if (err := _error(f)) is not None}
            if isinstance(work, BaseException):
                raise UpdateFailed(b, errors, work)
            if errors:
                raise UpdateFailed(b, errors, None)
            sent = work.is_completed()
            answered = all(f.done() for f in b.calls.values())
            now = time.perf_counter()
            if sent and not b.times[1]:
                b.times[1] = now
            if answered and not b.times[2]:
                b.times[2] = now
            if sent and answered:
                break
            if time.monotonic() > deadline:
                late = {u: TimeoutError("no answer in time") for u, f in b.calls.items() if not f.done()}
                done = work.is_completed()
                raise UpdateFailed(b, late, None if done else TimeoutError("broadcast did not complete"))
            time.sleep(POLL_S)
        try:
            work.wait()
        except Exception as e:
            raise UpdateFailed(b, {}, e) from e
        return b

    def settle(self, calls: dict[str, list[Future]], errors: dict[str, BaseException]) -> None:
        """After leaving a broken group: wait (bounded, timeout_s + 2 grace) for each engine's answers to
        the failed update's calls, and add to `errors` each engine whose answer failed or never came.

        An engine already failed in `errors` (transport error, timeout) is not waited on. One still silent
        is probed first: if it does not answer the probe either (a stopped or hung process, a lost host),
        it is lost after PROBE_TIMEOUT_S instead of the whole bound; without this, a hung engine held the
        trainer for timeout_s + grace (the broadcast) plus timeout_s + 2 grace (this wait), 25 s with
        bus.timeout_s 5, and a driver replaced it sooner than that."""
        m = self.members
        deadline = time.monotonic() + self.timeout_s + 2 * self.grace
        silent = [u for u, fs in calls.items() if u not in errors and not all(f.done() for f in fs)]
        for url, info in (m.probe(silent) if silent else {}).items():
            if isinstance(info, BaseException) and not all(f.done() for f in calls[url]):
                errors[url] = info
        for e in m.engines:  # lost: stop waiting on them
            if e.url in errors and not isinstance(errors[e.url], Refused):
                e.channel.close()
        wait(
            [f for u, fs in calls.items() if u not in errors for f in fs],
            timeout=max(0.0, deadline - time.monotonic()),
        )
        for url, fs in calls.items():
            if url not in errors:
                for f in fs:
                    if (err := _error(f) if f.done() else TimeoutError("no answer in time")) is not None:
                        errors[url] = err
                        break

    def drop_lost(self, errors: dict[str, BaseException], failure: UpdateFailed) -> list[str]:
        """After a failed update, with every engine's error: drop the lost ones (a transport error or no
        answer in time, or no answer to a probe now) and return them. Everyone alive, nothing failed on
        the wire, yet an engine said no: a bug, not a failure (BusError)."""
        m = self.members
        lost = {u for u, e in errors.items() if not isinstance(e, Refused)}  # transport error, timeout
        infos = m.probe([u for u in m.urls if u not in lost])
        lost |= {u for u, r in infos.items() if isinstance(r, BaseException)}
        refused = {u: e for u, e in errors.items() if u not in lost}
        if refused and not lost and failure.collective is None:
            raise BusError("; ".join(str(e) for e in refused.values()))
        dropped = m.drop(sorted(lost))
        for url in dropped:
            log.warning("engine %s dropped from the update group: %s", url, errors.get(url, infos.get(url)))
        return dropped

    def recover(self, failure: UpdateFailed, pending: deque[Bucket], confirmed: int) -> list[str]:
        """Leave the broken group, find out who is dead, rebuild over the survivors (the caller re-sends
        the pending buckets). An engine that is alive but refused a bucket whose broadcast went through
        raises BusError instead.

        NCCL (repair_in_stream False), after `confirmed` > 0 buckets: an engine answers an announcement
        once its receive is queued, and rank 0's broadcast completes once the bytes left it, so neither
        proves that a bucket reached an engine downstream of the dead one; re-sending only the pending
        buckets could leave a survivor with a hole. The survivors are parked instead: out of the group (and of the
        registry's live set), still paused, their groups aborted, and rejoined with the whole model at
        the next update. (gloo receives block: an engine's answer means its bytes arrived.)"""
        m = self.members
        log.warning("weight update failed: %s", failure)
        m.leave_group()  # rank 0's unfinished broadcasts fail now
        # Let sent announcements finish (a survivor gives up a receive stuck on the dead peer after its
        # group timeout, and then fails the rest at once), so that each engine's answer tells what
        # happened to it. One that stays silent is lost.
        errors: dict[str, BaseException] = dict(failure.errors)
        calls: dict[str, list[Future]] = {}
        for b in pending:
            for url, f in b.calls.items():
                calls.setdefault(url, []).append(f)
        self.settle(calls, errors)
        dropped = self.drop_lost(errors, failure)
        if not self.repair_in_stream and confirmed > 0 and m.engines:
            survivors = list(m.engines)
            list(self.calls.map(m.leave_on_engine, survivors))  # abort their stuck receives
            parked = m.drop([e.url for e in survivors], park=True)
            log.warning("engines %s parked (paused) until the next update resends the whole model", parked)
            return dropped + parked
        m.rebuild()
        return dropped
