"""Prometheus metrics of the trainer."""

from prometheus_client import Counter, Gauge, Histogram

STEP_SECONDS = Histogram("slipstream_trainer_step_seconds", "Forward+backward+optimizer time per step")
WAIT_SECONDS = Histogram(
    "slipstream_trainer_data_wait_seconds", "Time waiting for a full batch from the buffer"
)
STEPS = Counter("slipstream_trainer_steps_total", "Optimizer steps committed")
TOKENS = Counter("slipstream_trainer_tokens_total", "Response tokens trained on")
LOSS = Gauge("slipstream_trainer_loss", "Policy loss of the last step")
REWARD = Gauge("slipstream_trainer_reward_mean", "Mean reward of the last batch")
VERSION = Gauge("slipstream_trainer_weight_version", "Policy version after the last published step")
CLIP = Gauge("slipstream_trainer_clip_fraction", "Fraction of tokens whose PPO ratio was clipped")
KL = Gauge("slipstream_trainer_behav_kl", "k3 KL between trainer and behaviour policy on the batch")


def observe_step(r: dict) -> None:
    STEP_SECONDS.observe(r["step_s"])
    WAIT_SECONDS.observe(r["wait_s"])
    STEPS.inc()
    TOKENS.inc(r["response_tokens"])
    LOSS.set(r["loss"])
    REWARD.set(r["reward_mean"])
    VERSION.set(r["version"])
    CLIP.set(r["clip_fraction"])
    KL.set(r["behav_kl"])
