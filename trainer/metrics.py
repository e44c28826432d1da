"""Prometheus metrics of the trainer."""

from prometheus_client import Counter, Gauge, Histogram

from replay_buffer.progress import StepRecord

STEP_SECONDS = Histogram("slipstream_trainer_step_seconds", "Forward+backward+optimizer time per step")
WAIT_SECONDS = Histogram(
    "slipstream_trainer_data_wait_seconds", "Time waiting for a full batch from the buffer"
)
IDLE_PUBLISHES = Counter(
    "slipstream_trainer_idle_publishes_total",
    "Publishes of the current weights without a step, to admit engines waiting to join (bus.idle_sync_s)",
)
STEPS = Counter("slipstream_trainer_steps_total", "Steps (batches, weight versions) committed")
OPTIMIZER_STEPS = Counter(
    "slipstream_trainer_optimizer_steps_total",
    "Optimizer steps taken (algorithm.ppo_minibatches x ppo_epochs per committed step)",
)
TOKENS = Counter("slipstream_trainer_tokens_total", "Response tokens trained on")
CACHE_RETURNED = Counter(
    "slipstream_trainer_cached_memory_returned_bytes_total",
    "Colocated sync: bytes of cached, unused allocator blocks the trainer gave back to the device after "
    "each step, for the engine sharing it to take its KV cache back",
)
LOSS = Gauge("slipstream_trainer_loss", "Policy loss of the last step")
REWARD = Gauge("slipstream_trainer_reward_mean", "Mean reward of the last batch")
VERSION = Gauge("slipstream_trainer_weight_version", "Policy version after the last published step")
CLIP = Gauge(
    "slipstream_trainer_clip_fraction",
    "Fraction of tokens whose PPO ratio was clipped, over every optimizer step of the last batch",
)
RATIO = Gauge(
    "slipstream_trainer_ratio",
    "pi_theta / pi_prox on the last batch's tokens over its optimizer steps (stat: mean, min, max); "
    "1 with one optimizer step per batch",
    ["stat"],
)
KL = Gauge(
    "slipstream_trainer_behav_kl",
    "KL(pi_behav || pi_trainer) on the batch's tokens (k3 with r = pi_trainer/pi_behav: unbiased, >= 0)",
)
FP32_HEAD = Gauge(
    "slipstream_trainer_fp32_lm_head",
    "1 when the trainer's LM head matmul runs in fp32 on bf16 compute (trainer.fp32_lm_head)",
)
LOGPROB_DIFF = Gauge(
    "slipstream_trainer_logprob_abs_diff", "Mean |trainer - rollout| logprob of the trained tokens"
)
IS_WEIGHT_MEAN = Gauge("slipstream_trainer_is_weight_mean", "Mean behaviour importance weight (truncated)")
IS_WEIGHT_MAX = Gauge("slipstream_trainer_is_weight_max", "Largest behaviour importance weight (truncated)")
IS_TRUNCATED = Gauge(
    "slipstream_trainer_is_truncated_fraction", "Fraction of tokens whose importance weight was truncated"
)
IS_MASKED = Gauge(
    "slipstream_trainer_is_masked_fraction",
    "Fraction of tokens masked IS dropped (their ratio, or their sequence's, left [is_mask_low, is_mask_high])",
)
LR = Gauge("slipstream_trainer_lr", "Policy learning rate of the last optimizer step (after warmup/decay)")
ENTROPY = Gauge("slipstream_trainer_entropy", "Mean token entropy of the policy on the batch (nats)")
KL_REF = Gauge("slipstream_trainer_kl_ref", "KL penalty to the reference model (aggregated like the loss)")
GRAD_NORM = Gauge("slipstream_trainer_grad_norm", "Gradient norm before clipping")
TRAIN_TOKENS_PER_S = Gauge(
    "slipstream_trainer_train_tokens_per_second", "Sequence tokens (prompt + response) per second of step"
)
LORA_PARAMS = Gauge(
    "slipstream_trainer_lora_trainable_params", "Trainable LoRA adapter parameters (0: full fine-tuning)"
)
LORA_BYTES = Gauge(
    "slipstream_trainer_lora_adapter_bytes", "Bytes of the LoRA adapter's parameters (what a publish sends)"
)
CHECKPOINT_SECONDS = Histogram(
    "slipstream_trainer_checkpoint_seconds",
    "Time to write a checkpoint (every rank's shards, then the state)",
)
CHECKPOINT_BYTES = Gauge(
    "slipstream_trainer_checkpoint_bytes",
    "Bytes on disk of the last checkpoint written (a LoRA job's: the adapter and its optimizer state only)",
)
MFU = Gauge("slipstream_trainer_mfu", "Model FLOPs utilisation of the last step (bf16 peak; GPU only)")


def observe_step(r: StepRecord) -> None:
    """The metrics of a step, from its progress record (a field the record lacks is an AttributeError)."""
    STEP_SECONDS.observe(r.step_s)
    WAIT_SECONDS.observe(r.wait_s)
    STEPS.inc()
    OPTIMIZER_STEPS.inc(r.optimizer_steps)
    RATIO.labels("mean").set(r.ratio_mean)
    RATIO.labels("min").set(r.ratio_min)
    RATIO.labels("max").set(r.ratio_max)
    TOKENS.inc(r.response_tokens)
    LOSS.set(r.loss)
    REWARD.set(r.reward_mean)
    VERSION.set(r.version)
    CLIP.set(r.clip_fraction)
    KL.set(r.behav_kl)
    LOGPROB_DIFF.set(r.logprob_diff_mean)
    IS_WEIGHT_MEAN.set(r.is_weight_mean)
    IS_WEIGHT_MAX.set(r.is_weight_max)
    IS_TRUNCATED.set(r.is_truncated_fraction)
    IS_MASKED.set(r.is_masked_fraction)
    LR.set(r.lr)
    ENTROPY.set(r.entropy)
    GRAD_NORM.set(r.grad_norm)
    TRAIN_TOKENS_PER_S.set(r.train_tokens_per_s)
    MEMORY_PEAK.set(r.memory_peak_gib * (1 << 30))
    if isinstance(r.kl_ref, float):  # only with a reference model
        KL_REF.set(r.kl_ref)
    if isinstance(r.mfu, float):  # GPU only
        MFU.set(r.mfu)


MEMORY_PEAK = Gauge(
    "slipstream_trainer_memory_peak_bytes",
    "Peak device memory of the last step (CUDA: allocated by PyTorch, highest rank; CPU: the process's "
    "peak resident set)",
)
MEMORY_PLAN = Gauge(
    "slipstream_trainer_memory_plan_bytes",
    "The trainer's memory plan per rank (part: capacity usable, static weights/gradients/optimizer state, "
    "per_token activations of one micro-batch token); 0 on CPU (not planned)",
    ["part"],
)
MICRO_BATCH_TOKENS = Gauge(
    "slipstream_trainer_micro_batch_tokens",
    "Token budget of one packed micro-batch, as planned (or as set by trainer.micro_batch_tokens)",
)
