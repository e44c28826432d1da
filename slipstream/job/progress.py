"""A job's trainer progress: the stream's reader (one reader serves the driver's status, the control API
and the UI) and the one-line rendering `slipstream run` prints per step (and per evaluation)."""

from __future__ import annotations

import redis

from replay_buffer import JobKeys
from replay_buffer.progress import EvalRecord, as_dict, entry_record

STATUS_FIELDS = (
    "reward_mean",
    "staleness_mean",
    "staleness_max",
    "tokens_per_s",
    "train_tokens_per_s",
    "step_s",
    "loss",
    "mfu",
    "lr",
    "behav_kl",
    "logprob_diff_mean",
    "is_masked_fraction",
    "clip_fraction",
    "optimizer_steps",
    "ratio_min",
    "ratio_max",
    "prox_source",
    "schedule",
    "release_s",
    "resume_s",
    "memory_peak_gib",
    "micro_batch_tokens",
)
"""The last step record's fields the job driver copies into the job's status (`slipstream status`, the
control API, the status page); each a StepRecord field (replay_buffer/progress.py)."""


def format_progress(r: dict, total_steps: int, agent: bool = False) -> str:
    if is_eval(r):
        return format_eval(r)
    line = (
        f"step {r['step']:>4}/{total_steps}  version {r['version']:>4}  reward {r['reward_mean']:.3f}  "
        f"staleness {r['staleness_mean']:.2f} (max {r['staleness_max']})  "
        f"loss {r['loss']:+.4f}  tok/s {r['tokens_per_s']:.0f}  step {r['step_s'] * 1e3:.0f} ms  "
        f"wait {r['wait_s'] * 1e3:.0f} ms  swap {r['pause_s'] * 1e3:.0f} ms"
    )
    if r.get("optimizer_steps", 1) > 1:  # mini-batch PPO: the clip acts from the batch's second step on
        line += f"  clip {r['clip_fraction']:.3f} ({r['optimizer_steps']} optimizer steps)"
    if r.get("stale_samples"):  # groups dropped as stale since the last step, and how long they were
        line += (
            f"  stale-dropped {r['stale_samples']} samples (len {r['len_stale_mean']:.0f} vs trained "
            f"{r['len_trained_mean']:.0f})"
        )
    if agent:  # multi-turn jobs: how the episodes went
        line += (
            f"  turns {r['turns_mean']:.2f}  tool calls {r['tool_calls_mean']:.2f} (errors "
            f"{r['tool_errors_mean']:.2f})  budget-out {r['finish_tool_budget']:.2f}"
        )
    return line


def format_eval(r: dict) -> str:
    """`eval  version 10  accuracy 0.625  pass@4 0.810  (3.2 s)` of an eval record."""
    from generator_fleet.evaluation import format_scores

    res = r["eval"]
    return f"eval  version {r['version']:>4}  {format_scores(res)}  ({res.get('duration_s', 0.0):.1f} s)"


def is_eval(rec: dict) -> bool:
    """An evaluation's record (generator_fleet/evaluation.py), not a trainer step's."""
    return rec.get("kind") == "eval"


class ProgressReader:
    """Follows a job's trainer progress stream: the records of its current run (one StepRecord per step,
    a batch, as a dict: replay_buffer/progress.py `as_dict`; a new run of the name starts with an empty
    stream). `elapsed_s` is the run's clock,
    which every trainer pool of the run continues (ReplayBuffer.start_clock). Each record gains
    `tokens_per_s` and `samples_per_s`: response tokens and samples trained so far in the run ÷ its
    elapsed_s. A record whose version is not past the previous one's (the pool restarted from an older
    checkpoint: the steps after it were lost and the trainer dropped their records) supersedes the records
    it repeats: they leave `records` and the sums.

    `attempt` (set once the run's attempt is known) is the attempt of the run the reader serves: a
    resumed attempt first reads the records of the earlier ones, up to where they got, before its trainer
    drops those after the checkpoint it resumes from; `this_attempt` tells them apart.

    The stream also holds the evaluator's records (`kind: "eval"`, one per evaluated version, whose scores
    are in `eval`, a flat dict of scalars): they go to `evals` (an evaluation repeated at or before a
    version supersedes the later ones, as steps do) and `new_evals`, never into `records` or `read()`'s
    answer."""

    def __init__(self, r: redis.Redis, job: str, attempt: int | None = None) -> None:
        self.r, self.key = r, JobKeys(job).progress
        self.attempt = attempt
        self.last_id = "0"
        self.records: list[dict] = []
        """Every record of the run so far, superseded ones removed."""
        self.tokens = 0
        self.samples = 0
        self.evals: list[dict] = []
        """Every eval record of the run so far, superseded ones removed."""
        self.new_evals: list[dict] = []
        """Eval records read since the caller last emptied this list."""

    def this_attempt(self, rec: dict) -> bool:
        """A record of the reader's attempt of the run (or one that names no attempt)."""
        return rec.get("attempt") in (None, self.attempt)

    def read(self, block_ms: int = 500) -> list[dict]:
        """The new records (waiting up to block_ms for one), of every attempt."""
        out = []
        block = block_ms if block_ms > 0 else None  # BLOCK 0 would wait forever
        for _, entries in self.r.xread({self.key: self.last_id}, block=block, count=100) or []:
            for entry_id, fields in entries:
                self.last_id = entry_id
                typed = entry_record(fields)
                if isinstance(typed, EvalRecord):
                    rec = as_dict(typed)
                    while self.evals and self.evals[-1]["version"] >= rec["version"]:
                        self.evals.pop()
                    self.evals.append(rec)
                    self.new_evals.append(rec)
                    continue
                while self.records and self.records[-1]["version"] >= typed.version:
                    gone = self.records.pop()
                    self.tokens -= gone["response_tokens"]
                    self.samples -= gone["samples"]
                self.tokens += typed.response_tokens
                self.samples += typed.samples
                elapsed = max(typed.elapsed_s, 1e-9)
                typed.tokens_per_s = self.tokens / elapsed
                typed.samples_per_s = self.samples / elapsed
                rec = as_dict(typed)
                self.records.append(rec)
                out.append(rec)
        return out

    def read_all(self) -> list[dict]:
        """Every record of the run so far (reads the stream to its end without waiting)."""
        while self.read(block_ms=0):
            pass
        return self.records
