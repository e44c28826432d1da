"""The trainer loop: take a staleness-bounded batch, one importance-corrected policy step, commit, publish.

Each step, in order (the order is the durability contract, docs/design.md §3):
  1. take_batch   — groups read from the stream, still pending (unacked)            (rank 0)
  2. optimizer steps (ppo_minibatches x ppo_epochs) over packed micro-batches, split
     across the trainer ranks                                                         (every rank)
  3. commit       — MULTI{mark group_ids trained, XACK, count}: a crash before this redelivers the batch
  4. publish      — full weights gathered from the FSDP shards (a LoRA job: the adapter only), sent
                    over the bus to every engine; only when all acknowledged:
  5. version      — bump `version` in Redis; rollout admission and staleness follow it

Every rank runs `Trainer.run`; rank 0 owns the buffer and the bus and tells the others, once per step,
whether there is a step (the group leaves the loop together), then sends each rank its micro-batches.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from pathlib import Path

import torch
from msgspec import UNSET

from replay_buffer import ReplayBuffer
from replay_buffer.client import connect
from replay_buffer.progress import StepRecord, append_progress
from trainer import checkpoint, metrics
from trainer.batch import build_samples, loss_aggregation
from trainer.config import TrainerConfig, checkpoint_dir
from trainer.distributed import DistInfo, RankGroup, host_store
from trainer.faults import Faults
from trainer.flops import peak_flops
from trainer.learner import Learner
from trainer.memory import return_cached_memory
from trainer.result import TrainerResult
from weight_bus import BusError, WeightBus, update_due
from weight_bus.colocation import MemoryHandoff
from weight_bus.group import master_address_for
from weight_bus.registry import EngineRegistry

log = logging.getLogger(__name__)

IDLE_SYNC = "idle-sync"
"""`_take`'s answer when the trainer should publish its current weights to engines waiting to join."""
SYNC_CHECK_S = 1.0
"""How often a trainer waiting for a batch (past bus.idle_sync_s) asks the bus for engines waiting to join."""


def render_sample(tokenizer, sample) -> str:
    """Prompt, then response segments labelled [model] (loss_mask 1, trained on) or [context] (0)."""
    out = ["[prompt] " + tokenizer.decode(sample.view("prompt_ids").tolist(), skip_special_tokens=False)]
    ids, mask = sample.view("response_ids").tolist(), sample.view("loss_mask").tolist()
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            label = "[model]" if mask[start] else "[context]"
            out.append(f"{label} {tokenizer.decode(ids[start:i], skip_special_tokens=False)}")
            start = i
    return "\n".join(out)


def episode_stats(groups) -> dict[str, float]:
    """Per-sample means of turns / tool calls / tool errors, and the finish-reason mix of a batch."""
    samples = [s for g in groups for s in g.samples]
    n = len(samples)
    out = {
        "turns_mean": sum(s.num_turns for s in samples) / n,
        "tool_calls_mean": sum(s.tool_calls for s in samples) / n,
        "tool_errors_mean": sum(s.tool_errors for s in samples) / n,
    }
    for reason in ("stop", "length", "tool_budget", "abort"):
        out[f"finish_{reason}"] = sum(s.finish_reason == reason for s in samples) / n
    return out


def length_stats(prefix: str, lengths: list[int]) -> dict[str, float | None]:
    """Mean, median and 90th percentile (nearest rank) of response lengths, as `<prefix>_{mean,p50,p90}`
    (None when there are none)."""
    if not lengths:
        return {f"{prefix}_mean": None, f"{prefix}_p50": None, f"{prefix}_p90": None}
    xs = sorted(lengths)

    def q(p: float) -> float:
        return float(xs[max(0, min(len(xs) - 1, int(p * len(xs) + 0.999999) - 1))])

    return {f"{prefix}_mean": sum(xs) / len(xs), f"{prefix}_p50": q(0.5), f"{prefix}_p90": q(0.9)}


# Long: the step loop and what it owns (buffer, bus, checkpoints, records); one step's parts are methods of a
#   screen each
class Trainer:
    """One trainer rank. Rank 0 also holds the replay buffer consumer and the weight bus."""

    def __init__(
        self,
        config: TrainerConfig,
        redis_url: str,
        engine_urls: list[str],
        api_key: str | None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.config = cfg = config
        self.rank, self.world_size = rank, world_size
        self.buffer = self.bus = None
        ipc = cfg.bus.backend == "ipc"
        device = "cuda:0" if cfg.trainer.device == "cuda" else "cpu"  # Ray gives each rank its GPU as 0
        self.per_rank = ipc and world_size > 1
        """Colocated with several ranks: every rank hands the weights to the engines on its device, through
        its own bus (rank 0's knows the engines, pauses and continues them: weight_bus.rank_handoff)."""
        if rank != 0 and self.per_rank:
            self.bus = WeightBus.from_config(cfg.bus, [], api_key, backend="ipc", stage=False, device=device)
        if rank == 0:
            self.buffer = ReplayBuffer(
                connect(redis_url),
                cfg.name,
                reclaim_idle_ms=cfg.buffer.reclaim_idle_ms,
                stale_policy=cfg.buffer.stale_policy,
                ledger=cfg.buffer.ledger,
            )
            self.bus = WeightBus.from_config(
                cfg.bus,
                engine_urls,
                api_key,
                registry=EngineRegistry(connect(redis_url), cfg.name),
                master_address=cfg.bus.master_address or master_address_for(engine_urls),
                device=device if ipc else None,  # ipc: buckets are packed where the trainer's weights are
                lora=cfg.model.lora,
                lora_dir=str(Path(cfg.output_dir) / "lora"),
            )
        self.handoff: MemoryHandoff | None = None
        """Rank 0 of a colocated job on the sync schedule: the engines' memory released for each step."""
        if rank == 0 and cfg.schedule == "sync":
            self.handoff = MemoryHandoff(self.bus.client, self.bus.calls)
        self.learner: Learner | None = None
        self.tokenizer = None
        self._stop = False
        self._restart = False
        """stop(restart=True): checkpoint where it stopped, skip the final export (the pool comes back)."""
        self._stop_checkpoint = False
        """stop(checkpoint=True): write a checkpoint where it stopped, whatever checkpoint_every says."""
        self._resumed: tuple[int, Path] | None = None
        """(version, path) of the checkpoint this pool resumed from: a stop before any step needs no other."""
        self._checkpoint_requested = False
        self._batch: list = []
        """Rank 0: entries taken for the next batch before an idle publish interrupted the wait."""
        self._next_sync_check = 0.0
        self.run_info: dict = {}
        """Rank 0: the job's run (run_id, attempt: ReplayBuffer.begin_run), stamped on records and checkpoints."""
        self.checkpoint_dir = checkpoint_dir(cfg.output_dir, cfg.trainer.checkpoint_dir)
        self.faults = Faults.from_env()
        """The fault tests' injected failures (trainer/faults.py); none in production."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def setup(self, master: tuple[str, int] | None = None, store=None) -> None:
        """Join the trainer group (rank 0's `master` = (host, port); None with one rank; `store`: rank 0's
        rendezvous store when it hosts it already, `distributed.host_store`), load and shard the models,
        connect the bus, and resume from a checkpoint if trainer.resume_from says so."""
        from models.tokenizers import load_tokenizer

        tr = self.config.trainer
        torch.manual_seed(self.config.algorithm.seed)
        torch.set_num_threads(tr.torch_threads)
        if tr.device == "cuda":
            # Packed micro-batches of varying length fragment fixed-size segments (gigabytes reserved but
            # unusable); expandable segments grow and shrink instead. Read at the first allocation.
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
            torch.cuda.set_device(0)  # Ray gives each rank its own GPU as device 0
            self.device = torch.device("cuda", 0)
        else:
            self.device = torch.device("cpu")
        if master is None and tr.fsdp:  # one rank: a private group, FSDP still shards (over one)
            store = host_store("127.0.0.1", 1)
            master = ("127.0.0.1", store.port)
        addr, port = master or ("127.0.0.1", 0)
        self.ranks = RankGroup(DistInfo(self.rank, self.world_size, addr, port), self.device, store)
        self.learner = Learner(
            self.config.model,
            self.config.algorithm,
            tr,
            self.ranks,
            response_budget=self.config.response_budget,
        )
        self.learner.setup(plan_memory=self.config.schedule is None)  # a colocated engine shares the GPU
        self.peak_flops = (
            peak_flops(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
        )
        if self.is_main:
            self.tokenizer = load_tokenizer(self.config.model.path)
            self.buffer.ensure_group()
            self.run_info = self.buffer.run_info()
            self.bus.connect()
        if tr.resume_from:
            self._resume(checkpoint.resolve(tr.resume_from, self.checkpoint_dir))
        elif self.config.schedule == "sync" or self.config.model.lora is not None:
            # colocated sync: engines a previous pool left released hold undefined weights; this pool's
            # own go to them before any rollout (a handover in place costs little). A LoRA job: the
            # engines serve a placeholder of the untrained adapter (or an earlier pool's); this pool's
            # adapter replaces it (megabytes).
            self.publish(self.buffer.version() if self.is_main else 0)
        if self.is_main:
            log.info(
                "trainer ready: %s, %d ranks, %d params, version %d",
                self.config.model.path,
                self.world_size,
                sum(p.numel() for p in self.learner.model.parameters()),  # DTensor numel: global
                self.buffer.version(),
            )

    def _resume(self, path: Path) -> None:
        state = checkpoint.load(self.learner, path)
        version = int(state["version"])
        self._resumed = (version, path)
        if self.is_main:
            current = self.buffer.version()
            if current != version:
                log.warning("resuming at version %d from %s (Redis had version %d)", version, path, current)
        # Engines started from model.path: give them the restored weights before any rollout starts.
        self.publish(version)
        if self.is_main:
            # after a crash Redis may be ahead (steps after the checkpoint were lost): give their slots back
            self.buffer.rewind(version, self.config.algorithm.groups_per_step)
            # the lost steps' progress records go too: readers never see a version twice
            self.buffer.truncate_progress(version)

    def stop(self, restart: bool = False, checkpoint: bool = True) -> None:
        """End `run` after the step in progress. restart: the pool is being restarted (e.g. with another
        number of ranks): write a checkpoint there, whatever checkpoint_every says, and export nothing.
        checkpoint: write a checkpoint where it stopped, whatever checkpoint_every says (a stop loses no
        step unless told so: checkpoint=False)."""
        self._restart = self._restart or restart
        self._stop_checkpoint = self._stop_checkpoint or checkpoint or restart
        self._stop = True

    def request_checkpoint(self) -> None:
        """Rank 0: write a checkpoint after the step in progress (every rank takes part)."""
        self._checkpoint_requested = True

    def _take(self, version: int):
        """Rank 0: the next batch's entries; None when the job is done or stopping; IDLE_SYNC when it
        has waited bus.idle_sync_s while engines wait to join (the entries taken so far are kept for
        the next call)."""
        alg, buf = self.config.algorithm, self.config.buffer
        if version >= alg.total_steps or self._stop:
            return None
        since = time.monotonic()
        self._batch = self.buffer.take_batch(
            alg.groups_per_step,
            version,
            buf.max_staleness,
            buf.read_block_ms,
            should_stop=lambda: self._stop or self._sync_due(since),
            batch=self._batch,
        )
        if len(self._batch) == alg.groups_per_step:
            entries, self._batch = self._batch, []
            return entries
        return None if self._stop else IDLE_SYNC

    def _sync_due(self, since: float) -> bool:
        """Rank 0, while waiting for a batch: waited bus.idle_sync_s and engines wait to join."""
        now = time.monotonic()
        if now - since < self.config.bus.idle_sync_s or now < self._next_sync_check:
            return False
        self._next_sync_check = now + SYNC_CHECK_S
        return bool(self.bus.joiners_waiting())

    def _idle_publish(self, version: int) -> None:
        """Every rank, no step: publish the current weights again so that engines waiting to join are
        admitted (and their rollouts can fill the batch the trainer waits for)."""
        try:
            pub = self.publish(version)
        except BusError as e:  # no version is at stake: the next step's update tries again
            log.warning("idle publish of version %d for engines waiting to join failed: %s", version, e)
            return
        if self.is_main:
            metrics.IDLE_PUBLISHES.inc()
            log.info(
                "no batch for %.0f s and engines waiting to join: published version %d again; joined %s, "
                "%d engines in the update group",
                self.config.bus.idle_sync_s,
                version,
                pub.joined,
                len(pub.engines),
            )

    def _release(self) -> None:
        """Rank 0, sync schedule: the engines in the update group release their memory for the step."""
        self.handoff.release(self.bus.urls)

    def publish(self, version: int):
        """Gather full weights (every rank: each gather is a collective) and send them to the engines
        (rank 0); a LoRA job's publish gathers and sends the adapter only (the engines keep the base).
        The gather is lazy: the bus packs and sends bucket k while later tensors are gathered, and casts
        to the engines' dtype."""
        lora = self.config.model.lora is not None
        named = self.learner.adapter_tensors() if lora else self.learner.full_parameters()
        persistent = not lora and self.learner.parameters_unsharded()
        if self.per_rank:  # every rank to the engines on its device; stats on rank 0
            return self.bus.publish(named, version, persistent=persistent, ranks=self.ranks)
        if self.is_main:  # drains the iterator even when it fails
            return self.bus.publish(named, version, persistent=persistent)
        for _ in named:
            pass
        return None

    def run(self) -> TrainerResult:
        """Train until version reaches algorithm.total_steps (or stop()); every rank calls it.
        Ends with a checkpoint (if checkpoint_every, or stopped by `stop(checkpoint=True)`) and the HF
        export (if export_hf). `checkpoint`/`checkpoint_version` name the newest checkpoint of this pool
        (written or resumed from), "" / None if there is none."""
        tr = self.config.trainer
        version = self.buffer.version() if self.is_main else 0
        # elapsed_s is the run's clock: a pool after a rescale or restart continues it
        t_start = time.monotonic() - (self.buffer.start_clock() if self.is_main else 0.0)
        last_checkpoint = self._resumed  # (version, path)
        # this pool's id in its progress records (elapsed_s continues across pools, so readers that care
        # about pool changes, such as a rescale's measurement, compare this)
        self.pool_id = uuid.uuid4().hex[:8]
        while True:
            t0 = time.monotonic()
            header, entries = self._next_batch(version)
            if header is None:
                break
            version = self._step(header, entries, t0, t_start)
            if (tr.checkpoint_every and version % tr.checkpoint_every == 0) or header["checkpoint"]:
                last_checkpoint = (version, self.checkpoint(version))
        return self._finish(version, last_checkpoint, t_start)

    def _next_batch(self, version: int) -> tuple[dict | None, list | None]:
        """Rank 0 decides, every rank learns: the next step's header (version, checkpoint asked,
        on-policy) and, on rank 0, its entries; idle publishes on the way; (None, None) at the end."""
        while True:
            entries = self._take(version) if self.is_main else None
            sync = entries is IDLE_SYNC
            ckpt = False
            if not sync:
                ckpt, self._checkpoint_requested = self._checkpoint_requested, False
            # fully on-policy: every token was sampled with the weights about to be trained
            on_policy = not sync and bool(entries) and all(e.group.min_version == version for e in entries)
            if entries and not sync and self.handoff is not None:
                self._release()  # before any rank trains: the device is the trainer's for the step
            header = self.ranks.broadcast(
                {"version": version, "sync": sync, "checkpoint": ckpt, "on_policy": on_policy}
                if entries
                else None
            )
            if header is None:
                return None, None
            if not header["sync"]:
                return header, entries
            self._idle_publish(header["version"])

    @contextlib.contextmanager
    def _engines_back(self):
        """Around a colocated sync step: whatever happens in it, the engines get their KV cache and CUDA
        graphs back at its end and generate again (a no-op without the handoff)."""
        try:
            yield
        finally:
            if self.handoff is not None:
                self.handoff.finish()

    def _step(self, header: dict, entries: list | None, t0: float, t_start: float) -> int:
        """One step on every rank: train, commit (rank 0), publish when due, record; the new version."""
        cfg, alg = self.config, self.config.algorithm
        version = header["version"]
        t_data = time.monotonic()
        groups = [e.group for e in entries] if self.is_main else None
        samples = (
            build_samples(groups, alg.advantage, *loss_aggregation(alg, cfg.response_budget))
            if self.is_main
            else None
        )
        with self._engines_back():
            if self.is_main:
                self.faults.step(version + 1)
            stats = self.learner.train_step(self.learner.distribute(samples), on_policy=header["on_policy"])
            if self.device.type == "cuda":
                torch.cuda.synchronize()
                if cfg.schedule == "sync":  # the engine on this device takes its memory back next
                    return_cached_memory(self.device)
            t_step = time.monotonic()
            if self.is_main:
                self.buffer.commit(entries, version, cfg.buffer.max_staleness)
            t_commit = time.monotonic()
            # every bus.update_every versions, and the last one, so engines end on the final policy
            due = update_due(version + 1, cfg.bus.update_every, alg.total_steps)
            if due and self.handoff is not None:
                self.handoff.resume_weights()  # resident again before they are written
            pub = self.publish(version + 1) if due else None
        t_pub = time.monotonic()
        version += 1
        if self.is_main:
            self.buffer.set_version(version)
            self._record(version, groups, stats, pub, t0, t_data, t_step, t_start, t_pub, t_commit)
        return version

    def _finish(
        self, version: int, last_checkpoint: tuple[int, Path] | None, t_start: float
    ) -> TrainerResult:
        """The pool's end on every rank: the final checkpoint (when due), the buffer trimmed, the export."""
        tr = self.config.trainer
        # ranks that ran no step learn where rank 0 is, whether the pool restarts, and whether a stop
        # asked for a checkpoint (each rank writes its shards)
        stop_ckpt = self._stop and self._stop_checkpoint
        version, restart, stop_ckpt = self.ranks.broadcast((version, self._restart, stop_ckpt))
        due = tr.checkpoint_every or restart or stop_ckpt
        if due and version > 0 and (last_checkpoint is None or last_checkpoint[0] != version):
            last_checkpoint = (version, self.checkpoint(version))
        if self.is_main:
            self.buffer.trim()
        export = tr.export_hf and not restart
        final_model = self.save(Path(self.config.output_dir) / "final_model") if export else None
        return TrainerResult(
            version=version,
            elapsed_s=time.monotonic() - t_start,
            final_model=str(final_model or ""),
            checkpoint=str(last_checkpoint[1]) if last_checkpoint else "",
            checkpoint_version=last_checkpoint[0] if last_checkpoint else None,
            restart=restart,
        )

    def _record(self, version, groups, stats, pub, t0, t_data, t_step, t_start, t_pub, t_commit) -> None:
        cfg = self.config
        samples = [s for g in groups for s in g.samples]
        stale = [version - 1 - g.min_version for g in groups]
        step_s = t_step - t_data
        seq_tokens = sum(len(s) + s.num_prompt_tokens for s in samples)
        stale_lengths = self.buffer.pop_stale_lengths()
        ho = self.handoff
        # every name is a StepRecord field (replay_buffer/progress.py): one the record lacks is a TypeError
        record = StepRecord(
            step=version,
            version=version,
            run_id=self.run_info.get("run_id"),
            attempt=self.run_info.get("attempt"),
            pool_id=self.pool_id,
            ranks=self.world_size,
            samples=len(samples),
            reward_mean=sum(s.reward for s in samples) / len(samples),
            staleness_mean=sum(stale) / len(stale),
            staleness_max=max(stale),
            response_tokens=sum(len(s) for s in samples),
            wait_s=t_data - t0 - (ho.release_s if ho else 0.0),
            step_s=step_s,
            train_tokens_per_s=seq_tokens / max(step_s, 1e-9),
            mfu=stats["flops"] / step_s / (self.peak_flops * self.world_size) if self.peak_flops else None,
            publish_s=pub.transfer_s if pub else 0.0,
            pause_s=pub.pause_s if pub else 0.0,
            publish_call_s=t_pub - t_step,
            commit_s=t_commit - t_step,
            publish_gather_s=pub.gather_ms / 1e3 if pub else 0.0,
            elapsed_s=time.monotonic() - t_start,
            placement="colocated" if cfg.schedule else "disaggregated",
            schedule=cfg.schedule,
            bus_backend=cfg.bus.backend,
            fp32_lm_head=self.learner.fp32_head,
            micro_batch_tokens=self.learner.memory_plan.micro_batch_tokens,
            release_s=ho.release_s if ho else UNSET,
            resume_s=ho.resume_s if ho else UNSET,
            released_engines=ho.released_count if ho else UNSET,
            resumed_engines=ho.resumed_count if ho else UNSET,
            **length_stats("len_trained", [len(s) for s in samples]),
            **length_stats("len_stale", stale_lengths),
            stale_samples=len(stale_lengths),
            **episode_stats(groups),
            **stats,
        )
        append_progress(self.buffer.r, self.buffer.keys, record)
        self._log_sample(version, groups[0].samples[0])
        metrics.observe_step(record)

    def checkpoint(self, version: int) -> Path:
        """Write a checkpoint at `version` (every rank); its path."""
        state = {"step": version, "version": version}
        if self.run_info:
            state["run_id"] = self.run_info["run_id"]
        if self.is_main:
            stats = self.buffer.stats()
            state["buffer"] = {k: v for k, v in stats.items() if isinstance(v, int)}
        return checkpoint.save(
            self.learner,
            checkpoint.step_dir(self.checkpoint_dir, version),
            state,
            keep=self.config.trainer.keep_checkpoints,
            before_complete=lambda: self.faults.checkpoint(version),
        )

    def _log_sample(self, version: int, sample) -> None:
        """Append one rendered trajectory per step to <output_dir>/samples.txt: what the model wrote and
        what it was shown, told apart, so users can see what training is looking at."""
        path = Path(self.config.output_dir) / "samples.txt"
        with path.open("a") as f:
            f.write(
                f"=== version {version} reward {sample.reward:.3f} finish {sample.finish_reason} "
                f"turns {sample.num_turns} tool_calls {sample.tool_calls}\n"
            )
            f.write(render_sample(self.tokenizer, sample) + "\n")

    def save(self, path: str | Path) -> str | None:
        """Export the policy as an HF directory with the tokenizer (every rank; rank 0 writes)."""
        dtype = torch.bfloat16 if self.learner.bf16 else torch.float32
        merged = self.config.trainer.export_merged
        out = checkpoint.export_hf(self.learner, path, self.tokenizer, dtype, merged=merged)
        if out is not None:
            log.info("saved final model to %s", out)
        return str(out) if out is not None else None

    def close(self) -> None:
        if self.bus is not None:
            self.bus.close()
        if self.learner is not None:
            self.ranks.close()
