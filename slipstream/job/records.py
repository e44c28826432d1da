"""The job store's records (slipstream/job/store.py), typed: what the user wants of a job (`Desired`, the
job's `desired` hash) and what its status says (`Status`, the job's `status` key: the control API's JSON
and `slipstream status` show it). Every writer and reader goes through these, and through the one
encoder and decoder below.

Records written by older versions still decode: keys no field names are ignored, a field an older writer
did not write is `UNSET` (left out of the JSON, so a reader's dict holds exactly the keys the writer
wrote; the `stop` flags of `Desired` default to what their absence meant), and numbers are read laxly.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType


class Desired(msgspec.Struct):
    """What the user wants of a running job (the control API writes it, the job driver acts on it):
    stored as the Redis hash `JobKeys.desired`, its values strings."""

    generators: int | UnsetType = UNSET
    """Engines the generator pool should run (`slipstream scale --generators`); the spec's count at
    submit."""
    trainers: int | UnsetType = UNSET
    """Trainer ranks the trainer pool should run (`slipstream scale --trainers`); the spec's at submit."""
    stop: bool = False
    """A stop was requested: the trainer ends after its current step (stored "1")."""
    stop_checkpoint: bool = True
    """With `stop`: write a checkpoint where the trainer stops (stored "0" when not)."""
    stop_reason: str | UnsetType = UNSET
    """Why the stop was requested (e.g. "cluster down"), for the driver's log and the final status."""

    def to_hash(self) -> dict[str, str | int]:
        """The fields set, as the Redis hash holds them."""
        out: dict[str, str | int] = {}
        for k in ("generators", "trainers"):
            if (v := getattr(self, k)) is not UNSET:
                out[k] = v
        if self.stop:
            out["stop"] = "1"
            out["stop_checkpoint"] = "1" if self.stop_checkpoint else "0"
        if self.stop_reason:
            out["stop_reason"] = self.stop_reason
        return out

    @classmethod
    def from_hash(cls, raw: dict) -> Desired:
        """The record of the hash as HGETALL returns it (bytes or str); other keys are ignored."""
        h = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in raw.items()}  # fmt: skip
        return cls(
            **{k: int(h[k]) for k in ("generators", "trainers") if k in h},
            stop=h.get("stop") == "1",
            stop_checkpoint=h.get("stop_checkpoint") != "0",
            **({"stop_reason": h["stop_reason"]} if "stop_reason" in h else {}),
        )


class Status(msgspec.Struct):
    """A job's status: the control plane writes it at submit and when the driver is gone
    (slipstream/cluster/control.py, reconcile.py), the job's driver while it runs (slipstream/job/driver.py
    `report`) and at its end (`final_status`). The last few fields are the control API's additions to
    the status it answers with; they are never stored."""

    # --- the job's life ---------------------------------------------------------------------------------
    state: str | UnsetType = UNSET
    """submitted, starting, running, scaling, stopping (store.ACTIVE_STATES), or succeeded, failed,
    stopped, interrupted (store.ENDED_STATES)."""
    phase: str | None | UnsetType = UNSET
    """What a job that is not running yet (or is stopping, or evaluating at its end) is doing, in words;
    None once it runs."""
    scaling: str | None | UnsetType = UNSET
    """The pool rescale under way (`generators 2 -> 3`), or why a scale request was refused; None after."""
    error: str | None | UnsetType = UNSET
    """Why the job failed or was interrupted, one line (the cause and the setting to change)."""
    submitted_at: float | UnsetType = UNSET
    """Unix time of the submission, seconds."""
    updated_at: float | UnsetType = UNSET
    """Unix time of the last write, seconds."""
    ray_job_id: str | UnsetType = UNSET
    """The Ray submission id the job runs as (store.submission_id); absent in records from before ids."""
    driver: dict[str, Any] | UnsetType = UNSET
    """The driver holding the job's run lease (slipstream/job/lease.py): submission, pid, host, since
    (Unix time), token."""
    output_dir: str | UnsetType = UNSET
    """The job's output directory (logs, final model, checkpoints by default)."""

    # --- the run and its progress (the driver's report) -------------------------------------------------
    run_id: str | UnsetType = UNSET
    """The job's run (ReplayBuffer.begin_run)."""
    attempt: int | UnsetType = UNSET
    """The run's attempt (1, +1 per resume)."""
    trims: int | UnsetType = UNSET
    """Times progress records of lost steps were dropped from the run's stream (ReplayBuffer.run_info)."""
    version: int | UnsetType = UNSET
    """Policy version: the trainer's last step's, the version resumed from while it starts, 0 at first."""
    total_steps: int | UnsetType = UNSET
    """The spec's `algorithm.total_steps`."""
    pools: dict[str, int] | UnsetType = UNSET
    """Processes running: `generators` (engines), `rollout_workers`, `trainers` (ranks training); all 0
    once the job ended (store.NO_POOLS)."""
    restarts: dict[str, int] | UnsetType = UNSET
    """Replacements so far, by kind: `rollout_workers`, `engines`, `trainer_pool`."""
    failure: dict[str, Any] | UnsetType = UNSET
    """The newest failure supervision handled (slipstream/job/supervise.py Failure, as plain data)."""
    waiting: dict[str, str] | UnsetType = UNSET
    """Lost engine's URL, or `engine-N` for an engine a scale up added -> what the replacement or the new
    engine waits for (a node with room), while it waits."""
    elapsed_s: float | UnsetType = UNSET
    """The run's clock, seconds (replay_buffer/progress.py RunClock)."""
    samples_per_s: float | UnsetType = UNSET
    """Samples trained in the run ÷ its elapsed_s, samples/s."""
    tracking: dict[str, Any] | UnsetType = UNSET
    """Where TensorBoard / W&B write, the version written up to, writes and errors by backend
    (slipstream/job/tracking.py Tracker.status)."""
    eval: dict[str, Any] | UnsetType = UNSET
    """The newest evaluation of this attempt: its `version` and scores (replay_buffer/progress.py
    EvalRecord)."""
    buffer: dict[str, Any] | UnsetType = UNSET
    """The replay buffer's statistics (ReplayBuffer.stats): depth, dropped_stale, staleness, ..."""

    # --- the last step's record (slipstream/job/progress.py STATUS_FIELDS; units as StepRecord's; None
    # where the step had no value) ----------------------------------------------------------------------
    reward_mean: float | None | UnsetType = UNSET
    """Mean reward of the step's samples."""
    staleness_mean: float | None | UnsetType = UNSET
    """Mean staleness of the step's groups, versions."""
    staleness_max: int | None | UnsetType = UNSET
    """Largest staleness of the step's groups, versions."""
    tokens_per_s: float | None | UnsetType = UNSET
    """Response tokens trained in the run ÷ its elapsed_s, tokens/s."""
    train_tokens_per_s: float | None | UnsetType = UNSET
    """Prompt + response tokens of the step ÷ step_s, tokens/s."""
    step_s: float | None | UnsetType = UNSET
    """Seconds of the step's optimizer steps."""
    loss: float | None | UnsetType = UNSET
    """The step's loss."""
    mfu: float | None | UnsetType = UNSET
    """Model FLOPs utilisation of the step, a fraction; None off GPU."""
    lr: float | None | UnsetType = UNSET
    """Learning rate of the step's last optimizer step."""
    behav_kl: float | None | UnsetType = UNSET
    """KL between the engines' sampling distribution and the trainer's, per token, nats."""
    logprob_diff_mean: float | None | UnsetType = UNSET
    """Mean |engine logprob - trainer logprob| per trained token, nats."""
    is_masked_fraction: float | None | UnsetType = UNSET
    """Fraction of trained tokens masked out by the importance-weight rule."""
    clip_fraction: float | None | UnsetType = UNSET
    """Fraction of trained tokens whose ratio was clipped."""
    optimizer_steps: int | None | UnsetType = UNSET
    """Optimizer steps in the step's batch."""
    ratio_min: float | None | UnsetType = UNSET
    """Smallest policy ratio of the step."""
    ratio_max: float | None | UnsetType = UNSET
    """Largest policy ratio of the step."""
    prox_source: str | UnsetType = UNSET
    """Where pi_prox came from: current, engine or recompute."""
    schedule: str | None | UnsetType = UNSET
    """A colocated job's schedule (sync or async); None when disaggregated."""
    release_s: float | None | UnsetType = UNSET
    """Colocated sync schedule: seconds the engines took to release their memory for the step."""
    resume_s: float | None | UnsetType = UNSET
    """Colocated sync schedule: seconds the engines took to take it back."""
    memory_peak_gib: float | None | UnsetType = UNSET
    """Peak device memory of the step on the highest rank, GiB."""
    micro_batch_tokens: int | None | UnsetType = UNSET
    """Token budget of one packed micro-batch, tokens."""

    # --- the end: what a resumption starts from ------------------------------------------------------
    final_model: str | UnsetType = UNSET
    """The exported HF directory of the final policy ("" when none was exported)."""
    checkpoint: str | UnsetType = UNSET
    """The checkpoint a resumption starts from ("" when there is none)."""
    checkpoint_version: int | None | UnsetType = UNSET
    """Its version; None when there is none."""
    note: str | UnsetType = UNSET
    """One line on that checkpoint and how to resume from it."""

    # --- added by the control API to the status it answers with; never stored ------------------------
    name: str | UnsetType = UNSET
    """The job's name."""
    desired: Desired | UnsetType = UNSET
    """What the user wants of the job."""
    ray_status: str | UnsetType = UNSET
    """Ray's word on the job's submission (RUNNING, SUCCEEDED, GONE, `unknown (...)`, submitting)."""
    stale_s: float | UnsetType = UNSET
    """While Redis does not answer: the age of the status answered, seconds."""
    stale_reason: str | UnsetType = UNSET
    """While Redis does not answer: why, in words."""


STATUS_KEYS = frozenset(Status.__struct_fields__)
"""Every key a job's status may hold."""
API_ONLY = ("name", "desired", "ray_status", "stale_s", "stale_reason")
"""Status fields the control API adds to its answer; never stored."""

_decoder = msgspec.json.Decoder(Status, strict=False)


def encode_status(st: Status) -> str:
    """The stored form, JSON (API_ONLY fields left out). Written by the standard library, as before: a
    NaN (a diverged loss) stays NaN, as `slipstream status` has always shown it."""
    return json.dumps(status_dict(msgspec.structs.replace(st, **dict.fromkeys(API_ONLY, UNSET))))


def decode_status(raw: bytes | str | None) -> Status:
    """The stored status (an empty one when there is none). Older writers' JSON may hold NaN, which
    only the standard library reads."""
    if not raw:
        return Status()
    try:
        return _decoder.decode(raw)
    except msgspec.MsgspecError:
        return status_from_dict(json.loads(raw))


_BAD_KEY = re.compile(r".* - at `\$\.(\w+)")


def status_from_dict(data: dict[str, Any]) -> Status:
    """A status from plain data (the control API's JSON as the CLI reads it, an older record); a value
    of a type its field does not take is dropped, not the whole status."""
    data = dict(data)
    while True:
        try:
            return msgspec.convert(data, Status, strict=False)
        except msgspec.ValidationError as e:
            m = _BAD_KEY.match(str(e))
            if m is None or m[1] not in data:
                raise
            del data[m[1]]


def status_dict(st: Status) -> dict[str, Any]:
    """The status as plain data (the control API's JSON): exactly the fields set."""
    return msgspec.to_builtins(st)


def known(value: Any, default: Any = None) -> Any:
    """A record field's value, `default` where the record does not hold it (UNSET): what `.get(key,
    default)` was on the record's dict."""
    return default if value is UNSET else value


def merged(st: Status, **fields: Any) -> Status:
    """`st` with `fields` replaced (TypeError on a name that is no Status field)."""
    return msgspec.structs.replace(st, **fields)
