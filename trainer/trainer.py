"""The trainer loop: take a staleness-bounded batch, one importance-corrected policy step, commit, publish.

Each step, in order (the order is the durability contract, DESIGN.md §3):
  1. take_batch   — groups read from the stream, still pending (unacked)
  2. optimizer step
  3. commit       — MULTI{mark group_ids trained, XACK, count}: a crash before this redelivers the batch
  4. publish      — weights over the bus to every engine; only when all acknowledged:
  5. version      — bump `version` in Redis; rollout admission and staleness follow it
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import redis
import torch

from replay_buffer import ReplayBuffer
from slipstream.jobspec import JobSpec
from trainer import metrics
from trainer.batch import TrainBatch, build_batch
from trainer.logprobs import token_logprobs
from trainer.losses import approx_kl, policy_loss
from weight_bus import WeightBus

log = logging.getLogger(__name__)


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


class Trainer:
    def __init__(self, spec: JobSpec, redis_url: str, engine_urls: list[str], api_key: str | None) -> None:
        self.spec = spec
        self.buffer = ReplayBuffer(
            redis.Redis.from_url(redis_url),
            spec.name,
            reclaim_idle_ms=spec.buffer.reclaim_idle_ms,
            stale_policy=spec.buffer.stale_policy,
        )
        self.bus = WeightBus(
            engine_urls,
            api_key=api_key,
            backend=spec.bus.backend,
            bucket_bytes=spec.bus.bucket_bytes,
            pause_mode=spec.bus.pause_mode,
        )
        self.model = None
        self.tokenizer = None
        self._stop = False

    def setup(self) -> None:
        from transformers import AutoModelForCausalLM

        from slipstream.tokenizers import load_tokenizer

        torch.manual_seed(self.spec.algorithm.seed)
        torch.set_num_threads(self.spec.trainer.torch_threads)
        self.device = torch.device(self.spec.trainer.device)
        self.tokenizer = load_tokenizer(self.spec.model.path)
        self.model = AutoModelForCausalLM.from_pretrained(self.spec.model.path, dtype=torch.float32).to(
            self.device
        )
        self.model.train()
        alg = self.spec.algorithm
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=alg.lr, weight_decay=alg.weight_decay)
        self.buffer.ensure_group()
        self.bus.connect()
        log.info(
            "trainer ready: %s, %d params, version %d",
            self.spec.model.path,
            sum(p.numel() for p in self.model.parameters()),
            self.buffer.version(),
        )

    def stop(self) -> None:
        self._stop = True

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        alg = self.spec.algorithm
        dev = self.device
        temperature = self.spec.rollout.sampling.temperature or 1.0  # greedy rollouts: plain logits
        logp = token_logprobs(self.model, batch.input_ids.to(dev), batch.attention_mask.to(dev), temperature)
        # One optimizer step per batch: pi_prox is the policy at batch time, i.e. these logprobs detached.
        prox = logp.detach()
        mask = batch.loss_mask.to(dev)
        behav = batch.behav_logprobs.to(dev)
        loss, stats = policy_loss(
            logp,
            prox,
            behav,
            batch.advantages.to(dev),
            mask,
            kind=alg.loss,
            clip_eps=alg.clip_eps,
            is_cap=alg.is_cap,
            agg=alg.loss_agg,
        )
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), alg.max_grad_norm)
        self.opt.step()
        return {
            "loss": float(loss),
            "grad_norm": float(grad_norm),
            "behav_kl": approx_kl(prox, behav, mask),
            **stats,
        }

    def publish(self, version: int):
        # Engines run fp32 on CPU here; the bus casts nothing. (FSDP2 full_tensor gathering: later issue.)
        named = [(n, p.detach()) for n, p in self.model.named_parameters()]
        return self.bus.publish(named, version)

    def run(self) -> dict:
        """Train spec.algorithm.total_steps steps; returns the final summary."""
        spec, alg = self.spec, self.spec.algorithm
        version = self.buffer.version()
        t_start = time.monotonic()
        while version < alg.total_steps and not self._stop:
            t0 = time.monotonic()
            entries = self.buffer.take_batch(
                alg.groups_per_step,
                version,
                spec.buffer.max_staleness,
                spec.buffer.read_block_ms,
                should_stop=lambda: self._stop,
            )
            if len(entries) < alg.groups_per_step:
                break  # stopping
            t_data = time.monotonic()
            groups = [e.group for e in entries]
            batch = build_batch(groups, self.tokenizer.pad_token_id)
            stats = self.train_step(batch)
            t_step = time.monotonic()
            self.buffer.commit(entries, version, spec.buffer.max_staleness)
            pub = self.publish(version + 1)
            version += 1
            self.buffer.set_version(version)
            stale = [version - 1 - g.min_version for g in groups]
            record = {
                "step": version,
                "version": version,
                "reward_mean": float(batch.rewards.mean()),
                "staleness_mean": sum(stale) / len(stale),
                "staleness_max": max(stale),
                "response_tokens": batch.num_response_tokens,
                "wait_s": t_data - t0,
                "step_s": t_step - t_data,
                "publish_s": pub.transfer_s,
                "pause_s": pub.pause_s,
                "elapsed_s": time.monotonic() - t_start,
                **episode_stats(groups),
                **stats,
            }
            self.buffer.r.xadd(self.buffer.keys.progress, {"j": json.dumps(record)})
            self._log_sample(version, groups[0].samples[0])
            metrics.observe_step(record)
        self.buffer.trim()
        return {"version": version, "elapsed_s": time.monotonic() - t_start}

    def _log_sample(self, version: int, sample) -> None:
        """Append one rendered trajectory per step to <output_dir>/samples.txt: what the model wrote and
        what it was shown, told apart, so users can see what training is looking at."""
        path = Path(self.spec.output_dir) / "samples.txt"
        with path.open("a") as f:
            f.write(
                f"=== version {version} reward {sample.reward:.3f} finish {sample.finish_reason} "
                f"turns {sample.num_turns} tool_calls {sample.tool_calls}\n"
            )
            f.write(render_sample(self.tokenizer, sample) + "\n")

    def save(self, path: str | Path) -> str:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        log.info("saved final model to %s", path)
        return str(path)

    def close(self) -> None:
        self.bus.close()
