"""A job's progress stream (`JobKeys.progress`): one JSON record per trainer step (`StepRecord`) and per
evaluation (`EvalRecord`), told apart by `kind`, and the run clock (`JobKeys.run`) both are stamped with.

A field that is `UNSET` is not in the record: the job does not measure it (no reference model: `kl_ref`;
not colocated: `release_s`), or an older writer did not write it. UNSET fields are left out of the JSON,
so a reader's dict (`as_dict`) holds exactly the keys the writer wrote; None is written (null) where a
value was due but there was none (`mfu` off GPU, `len_stale_mean` with nothing dropped). Records written
before the stream carried `kind` decode as steps, and keys no field names are ignored.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from replay_buffer.keys import JobKeys


class StepRecord(msgspec.Struct, tag="step", tag_field="kind"):
    """One trainer step (a batch, one or more optimizer steps), written by rank 0 after the step committed
    and its weights were published (trainer/trainer.py), read by the job driver, the control API, the CLI,
    tracking and the report (slipstream/job/progress.py ProgressReader)."""

    version: int
    """Policy version after this step (optimizer batches trained since the run began)."""
    elapsed_s: float = 0.0
    """The run's clock when the step was recorded, seconds (`RunClock`): every trainer pool and attempt of
    the run continues it."""
    step: int | UnsetType = UNSET
    """The step's number; equal to `version`."""
    run_id: str | None | UnsetType = UNSET
    """The run the step belongs to (ReplayBuffer.begin_run); None outside a run."""
    attempt: int | None | UnsetType = UNSET
    """The run's attempt that trained it (1, +1 per resume); None outside a run."""
    pool_id: str | UnsetType = UNSET
    """Id of the trainer pool that trained it: a new one after each rescale or restart."""
    ranks: int | UnsetType = UNSET
    """Trainer ranks in the pool."""
    samples: int = 0
    """Samples (responses) trained in the step."""
    response_tokens: int = 0
    """Response tokens of the step's samples (model and tool tokens)."""
    reward_mean: float | UnsetType = UNSET
    """Mean reward of the step's samples."""
    staleness_mean: float | UnsetType = UNSET
    """Mean over the step's groups of (versions behind): the trained version minus the group's oldest
    token's version."""
    staleness_max: int | UnsetType = UNSET
    """Largest staleness of the step's groups, versions."""

    # --- time ---------------------------------------------------------------------------------------
    wait_s: float | UnsetType = UNSET
    """Seconds the trainer waited for the batch (less a colocated engine's release)."""
    step_s: float | UnsetType = UNSET
    """Seconds of the optimizer steps (forward, backward, optimizer) on every rank."""
    train_tokens_per_s: float | UnsetType = UNSET
    """Prompt + response tokens of the batch ÷ step_s."""
    mfu: float | None | UnsetType = UNSET
    """Model FLOPs utilisation of the step (flops ÷ step_s ÷ bf16 peak of the ranks' GPUs), a fraction;
    None off GPU."""
    flops: float | UnsetType = UNSET
    """Model FLOPs of the step over every rank (trainer/flops.py)."""
    publish_s: float | UnsetType = UNSET
    """Seconds the weight transfer to the engines took; 0.0 when the step published nothing."""
    pause_s: float | UnsetType = UNSET
    """Seconds the engines were paused for the update; 0.0 when the step published nothing."""
    publish_call_s: float | UnsetType = UNSET
    """Seconds from the end of the step to the end of the publish as the trainer waits on it: buffer
    commit, gather, pause, transfer, continue."""
    commit_s: float | UnsetType = UNSET
    """Seconds of the replay buffer's commit of the step's entries."""
    publish_gather_s: float | UnsetType = UNSET
    """Seconds gathering and packing the weights for the publish."""
    release_s: float | UnsetType = UNSET
    """Colocated sync schedule: seconds the engines took to release their memory for the step."""
    resume_s: float | UnsetType = UNSET
    """Colocated sync schedule: seconds the engines took to take their memory back."""
    released_engines: int | UnsetType = UNSET
    """Colocated sync schedule: engines that released their memory for the step."""
    resumed_engines: int | UnsetType = UNSET
    """Colocated sync schedule: engines that took it back."""

    # --- the job's set-up ---------------------------------------------------------------------------
    placement: str | UnsetType = UNSET
    """Where the engines run: "colocated" (on the trainer's GPUs) or "disaggregated"."""
    schedule: str | None | UnsetType = UNSET
    """Colocated jobs' schedule ("sync" or "async"); None when disaggregated."""
    bus_backend: str | UnsetType = UNSET
    """The weight bus backend that published the step's weights."""
    fp32_lm_head: bool | UnsetType = UNSET
    """Whether the LM head's matmul ran in fp32."""
    micro_batch_tokens: int | UnsetType = UNSET
    """Token budget of one packed micro-batch (planned or set), tokens."""
    memory_peak_gib: float | UnsetType = UNSET
    """Peak device memory of the step on the highest rank, GiB (CUDA: allocated by PyTorch; CPU: the
    process's peak resident set)."""

    # --- response lengths and episodes ----------------------------------------------------------------
    len_trained_mean: float | None | UnsetType = UNSET
    """Mean response length of the trained samples, tokens."""
    len_trained_p50: float | None | UnsetType = UNSET
    """Median response length of the trained samples, tokens."""
    len_trained_p90: float | None | UnsetType = UNSET
    """90th percentile (nearest rank) response length of the trained samples, tokens."""
    len_stale_mean: float | None | UnsetType = UNSET
    """Mean response length of the samples dropped as stale since the last step, tokens; None if none
    were (a stale distribution longer than the trained one means long rollouts are being lost)."""
    len_stale_p50: float | None | UnsetType = UNSET
    """Median response length of the samples dropped as stale since the last step, tokens; None if none."""
    len_stale_p90: float | None | UnsetType = UNSET
    """90th percentile response length of the samples dropped as stale since the last step, tokens."""
    stale_samples: int | UnsetType = UNSET
    """Samples dropped (or recycled) as stale since the last step."""
    turns_mean: float | UnsetType = UNSET
    """Turns per sample, mean."""
    tool_calls_mean: float | UnsetType = UNSET
    """Tool calls per sample, mean."""
    tool_errors_mean: float | UnsetType = UNSET
    """Tool calls that failed per sample, mean."""
    finish_stop: float | UnsetType = UNSET
    """Fraction of samples that ended with the model's stop."""
    finish_length: float | UnsetType = UNSET
    """Fraction of samples cut at the token budget."""
    finish_tool_budget: float | UnsetType = UNSET
    """Fraction of samples ended by the tool-call budget."""
    finish_abort: float | UnsetType = UNSET
    """Fraction of samples aborted."""

    # --- the learner (trainer/learner.py train_step), over every rank -------------------------------
    loss: float | UnsetType = UNSET
    """The loss summed over an optimizer step, mean over the batch's optimizer steps."""
    pg_loss: float | UnsetType = UNSET
    """Its policy-gradient term, likewise."""
    kl_ref: float | UnsetType = UNSET
    """Its KL-to-reference term, likewise; only with a reference model."""
    value_loss: float | UnsetType = UNSET
    """The critic's value loss, likewise; only with a critic."""
    entropy: float | UnsetType = UNSET
    """Policy entropy per trained token, nats."""
    clip_fraction: float | UnsetType = UNSET
    """Fraction of trained tokens whose ratio was clipped, over every pass."""
    clip_fraction_last: float | UnsetType = UNSET
    """clip_fraction of the batch's last optimizer step."""
    dual_clip_fraction: float | UnsetType = UNSET
    """Fraction of trained tokens the dual clip bounded."""
    is_weight_mean: float | UnsetType = UNSET
    """Mean importance weight (pi_prox ÷ behaviour) per trained token."""
    is_weight_max: float | UnsetType = UNSET
    """Largest importance weight."""
    is_truncated_fraction: float | UnsetType = UNSET
    """Fraction of trained tokens whose importance weight was truncated."""
    is_masked_fraction: float | UnsetType = UNSET
    """Fraction of trained tokens masked out by the importance-weight rule."""
    behav_kl: float | UnsetType = UNSET
    """KL (k3 estimate) between the engines' sampling distribution and the trainer's, per token, nats."""
    logprob_diff_mean: float | UnsetType = UNSET
    """Mean |engine logprob - trainer logprob| per trained token, nats."""
    ratio_mean: float | UnsetType = UNSET
    """Mean policy ratio per trained token (1.0 with no tokens)."""
    ratio_min: float | UnsetType = UNSET
    """Smallest policy ratio (1.0 with no tokens)."""
    ratio_max: float | UnsetType = UNSET
    """Largest policy ratio (1.0 with no tokens)."""
    trained_tokens: float | UnsetType = UNSET
    """Tokens trained on per epoch (loss mask 1)."""
    optimizer_steps: int = 1
    """Optimizer steps in the batch (ppo_minibatches x ppo_epochs)."""
    grad_norm: float | UnsetType = UNSET
    """Gradient norm before clipping, mean over the batch's optimizer steps."""
    grad_norm_max: float | UnsetType = UNSET
    """Largest gradient norm of the batch's optimizer steps."""
    critic_grad_norm: float | UnsetType = UNSET
    """The critic's gradient norm, mean over the optimizer steps; only with a critic."""
    lr: float | UnsetType = UNSET
    """Learning rate of the batch's last optimizer step."""
    loss_first: float | UnsetType = UNSET
    """Loss of the batch's first optimizer step."""
    loss_last: float | UnsetType = UNSET
    """Loss of the batch's last optimizer step."""
    prox_source: str | UnsetType = UNSET
    """Where pi_prox came from: "current", each forward pass's own (one optimizer step); "engine", the
    engines' logprobs (the batch fully on-policy); "recompute", a forward pass before the first update.
    (Strings, not Literals: a reader never fails on a value a newer trainer writes.)"""

    # --- derived by the reader (slipstream/job/progress.py), never written ------------------------
    tokens_per_s: float | UnsetType = UNSET
    """Response tokens trained so far in the run ÷ elapsed_s: the run's generation rate, tokens/s."""
    samples_per_s: float | UnsetType = UNSET
    """Samples trained so far in the run ÷ elapsed_s, samples/s."""


class EvalRecord(msgspec.Struct, tag="eval", tag_field="kind"):
    """One evaluation of the policy at a weight version (generator_fleet/evaluation.py), in the stream
    beside the steps; it trails them (it starts once the version is published)."""

    version: int
    """Oldest weight version of the answers scored."""
    eval: dict[str, float]
    """The scores, a flat dict of scalars: `accuracy`, `greedy_reward`, `pass@<k>`, `problems`,
    `samples`, `redone`, `duration_s` (seconds), and an agent job's `tool_calls_mean`, `turns_mean`."""
    version_max: int | UnsetType = UNSET
    """Newest weight version of the answers scored."""
    elapsed_s: float = 0.0
    """The run's clock when the evaluation was recorded, seconds (`RunClock`)."""
    attempt: int | UnsetType = UNSET
    """The run's attempt it belongs to."""


ProgressRecord = StepRecord | EvalRecord

STEP_FIELDS = frozenset(StepRecord.__struct_fields__)
"""Every name a step record may hold: status, tracking, metrics and the status page read these."""


class _Kind(msgspec.Struct):
    kind: str = "step"  # records written before the stream carried `kind` are steps


# lax (strict=False): a whole float read into an int field is no reason to lose a step's record
_kind = msgspec.json.Decoder(_Kind)
_decoders = {
    kind: msgspec.json.Decoder(t, strict=False) for kind, t in (("step", StepRecord), ("eval", EvalRecord))
}
_encoder = msgspec.json.Encoder()


def encode_progress(rec: ProgressRecord) -> bytes:
    return _encoder.encode(rec)


def decode_progress(data: bytes | str) -> ProgressRecord:
    """A stream entry's record (its `j` field); msgspec.ValidationError when it is neither."""
    kind = _kind.decode(data).kind
    if kind not in _decoders:
        raise msgspec.ValidationError(f"progress record of unknown kind {kind!r}")
    return _decoders[kind].decode(data)


def entry_record(fields: dict) -> ProgressRecord:
    """The record of a stream entry's fields as redis-py returns them."""
    return decode_progress(fields[b"j"] if b"j" in fields else fields["j"])


def as_dict(rec: ProgressRecord) -> dict[str, Any]:
    """The record as plain data for readers that keep dicts (with `kind`; UNSET fields left out)."""
    return msgspec.to_builtins(rec)


def append_progress(r, keys: JobKeys, rec: ProgressRecord) -> None:
    """Add a record to the job's progress stream (sync Redis)."""
    r.xadd(keys.progress, {"j": encode_progress(rec)})


async def async_append_progress(r, keys: JobKeys, rec: ProgressRecord) -> None:
    """Add a record to the job's progress stream (asyncio Redis)."""
    await r.xadd(keys.progress, {"j": encode_progress(rec)})


# --- the run clock --------------------------------------------------------------------------------
class RunClock(msgspec.Struct, frozen=True):
    """The clock fields of the run hash (`JobKeys.run`): one clock for every trainer pool and attempt of
    the run, in Redis time so every process reads the same."""

    started_at: float | None = None
    """Redis time (seconds) of the clock's origin; None until this attempt's first trainer pool starts."""
    elapsed_before: float = 0.0
    """The clock's reading where the previous attempt's records ended, seconds (0.0 in a first attempt)."""
    attempt: int = 1
    """The run's attempt (1, +1 per resume)."""

    def reading(self, now: float) -> float | None:
        """Seconds on the run's clock at Redis time `now`; None before it started."""
        return None if self.started_at is None else now - self.started_at

    def elapsed_s(self, now: float) -> float:
        """The clock's reading, or where it stands before this attempt's trainer started it."""
        reading = self.reading(now)
        return self.elapsed_before if reading is None else reading


def run_clock(raw: dict) -> RunClock:
    """The run clock of the run hash as HGETALL returns it (bytes or str keys and values)."""
    h = {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}
    started = h.get("started_at")
    return RunClock(
        started_at=None if started is None else float(started),
        elapsed_before=float(h.get("elapsed_before") or 0.0),
        attempt=int(h.get("attempt") or 1),
    )


def redis_now(time_reply: tuple[int, int]) -> float:
    """Redis `TIME` (seconds, microseconds) as seconds."""
    sec, usec = time_reply
    return sec + usec / 1e6
