"""One trainer rank's models and optimizer steps: the compute half of the trainer, free of Redis and HTTP.

Every rank of the pool holds a `Learner`. Per optimizer step each rank gets its share of the mini-batch's
samples as packed micro-batches (trainer/packing.py), runs forward/backward on each, and the gradients
accumulate; then one clipped optimizer step. Loss normalisation is global: each token's loss is scaled by
its sample's aggregation weight computed over the whole mini-batch (losses.agg_weights; the whole step
with one mini-batch), so the per-micro-batch losses of all ranks add up to the loss of the whole
mini-batch on one rank. FSDP averages gradients over
ranks; the backward pass therefore scales by world_size to turn that average into the sum.

A step's batch takes algorithm.ppo_minibatches x ppo_epochs optimizer steps: the batch is split into
mini-batches balanced by tokens (the same split on any number of ranks), each mini-batch across the ranks
and into micro-batches, and every pass over the batch steps the optimizer once per mini-batch. Each
mini-batch's loss is aggregated over that mini-batch (batch.reweight).

pi_prox (decoupled PPO's proximal policy, the anchor of its clip) is the policy at batch time, fixed
before the first optimizer step (`prox_source` in the step's stats):
  current    one optimizer step per batch: the logprobs of that step's own forward pass, detached, are
             exactly pi_prox, so no extra pass is needed;
  engine     several optimizer steps on a fully on-policy batch (every token sampled with the weights
             being trained): the engines' logprobs are pi_prox, no extra pass (AReaL);
  recompute  otherwise: one forward pass without grad over the batch before the first update.
Later mini-batches see ratios pi_theta / pi_prox != 1, so the clip acts and clip_fraction counts it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import torch
from torch import nn

from models.config import ModelSpec
from trainer import attention, flops, memory, metrics
from trainer.advantages import whiten
from trainer.batch import loss_aggregation, reweight
from trainer.config import AlgorithmSpec, TrainerSpec
from trainer.critic import Critic, gae_targets
from trainer.distributed import RankGroup, full_tensor, gathered_by_unit, grad_norm_clip, shard
from trainer.fingerprint import base_fingerprint
from trainer.logprobs import packed_logprobs
from trainer.lora import peft_name, wrap_lora
from trainer.losses import (
    LOG_RATIO_CLAMP,
    behav_kl,
    effective_agg,
    kl_penalty,
    policy_loss_terms,
    value_loss,
)
from trainer.lr_schedule import lr_factor
from trainer.packing import MicroBatch, TrainSample, pack, plan_step, split_minibatches

log = logging.getLogger(__name__)

SUM_STATS = tuple(
    "loss pg_loss kl_ref value_loss tokens entropy_sum clip_sum dual_clip_sum is_weight_sum truncated_sum"
    " masked_sum behav_k3_sum behav_absdiff_sum ratio_sum".split()
)
MAX_STATS = ("is_weight_max", "ratio_max", "ratio_neg_min")


# Long: one rank's models and optimizer steps; the loss terms, packing and sharding live in their own modules
class Learner:
    """The policy (and reference, critic) of one rank and their optimizers, configured by the job's
    `model`, `algorithm` and `trainer` sections."""

    def __init__(
        self,
        model: ModelSpec,
        algorithm: AlgorithmSpec,
        trainer: TrainerSpec,
        ranks: RankGroup,
        response_budget: int | None = None,
    ) -> None:
        """response_budget: TrainerConfig.response_budget, seq-mean-token-sum-norm's constant when
        algorithm.loss_scale_factor is null (needed to re-aggregate mini-batches of that mode)."""
        self.model_spec, self.algorithm, self.trainer = model, algorithm, trainer
        self.loss_agg = loss_aggregation(algorithm, response_budget) if response_budget else None
        self.response_budget = response_budget or 0
        self.ranks = ranks
        self.device = ranks.device
        tr = trainer
        self.fsdp = tr.fsdp and ranks.enabled
        self.bf16 = self.device.type == "cuda" and tr.mixed_precision == "bf16"
        self.fp32_head = bool(tr.fp32_lm_head) and self.bf16
        """trainer.fp32_lm_head on bf16 compute: the LM head's matmul in fp32 (trainer/logprobs.py)."""
        self.model: nn.Module | None = None
        self.offload = bool(tr.offload_optimizer)
        """FSDP2 CPU offload of the policy (trainer.offload_optimizer; planned at setup when null)."""
        self.memory_plan = memory.unplanned(tr.micro_batch_tokens, tr.activation_checkpointing, self.offload)
        """The micro-batch budget and memory settings in force (trainer/memory.py; planned at setup)."""
        self.adapter_bytes = 0
        """Bytes of the LoRA adapter's parameters (0 without model.lora)."""
        self.base_fingerprint: dict[str, str] | None = None
        """With model.lora: the frozen base's `base_fingerprint`, stored in checkpoints and checked at
        resume."""
        self.ref: nn.Module | None = None
        self.critic: Critic | None = None
        self.critic_opt = None
        self.lr_step = 0
        """Optimizer steps taken: the LR schedule's position (checkpointed as trainer_state `lr_step`)."""
        self.updates = algorithm.ppo_minibatches * algorithm.ppo_epochs
        """Optimizer steps per batch."""
        self._prox_source = ""
        """The last step's prox_source (a log line when it changes)."""
        self.update_stats: list[dict[str, float]] = []
        """Per optimizer step of the last train_step (all ranks): loss, clip_fraction, grad_norm, lr."""

    # --- building -----------------------------------------------------------------------------------
    def _prepare(self, model: nn.Module, layers: nn.ModuleList, *, trainable: bool) -> nn.Module:
        tr = self.trainer
        if trainable and tr.activation_checkpointing:  # null: planned after sharding (plan_learner)
            memory.set_checkpointing(model, True)
        if tr.compile:
            for block in layers:
                block.compile()  # in place: parameter names stay the HF ones
        if self.fsdp:
            shard(
                model,
                mixed_precision=self.bf16,
                cpu_offload=self.offload and trainable,
                layers=layers,
                # One rank has nothing to free by resharding; with CPU offload the gathered copy is
                # what offloading avoids keeping.
                reshard_after_forward=self.ranks.world_size > 1 or self.offload,
            )
        else:
            model.to(self.device)
        if not trainable:
            model.requires_grad_(False)
            model.eval()
        else:
            model.train()
        return model

    # Long: the models in load order (policy, adapter, optimizer, reference, critic, memory plan) and the one
    #   log line that says what was built
    def setup(self, plan_memory: bool = True) -> None:
        """plan_memory False (a colocated trainer, whose engine shares the GPU): the memory settings as given,
        nulls at their CPU defaults, instead of planned against the device's free memory."""
        from transformers import AutoModelForCausalLM

        alg, tr = self.algorithm, self.trainer
        attn = attention.register()
        torch.manual_seed(alg.seed)

        def load(path: str) -> nn.Module:
            return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)

        model = load(self.model_spec.path)
        self.config = model.config
        layers = model.model.layers
        lora = self.model_spec.lora
        if lora is not None:
            self.base_fingerprint = base_fingerprint(model)
            model = wrap_lora(model, lora)  # before sharding: the adapter's params are sharded with the base
        world = self.ranks.world_size if self.fsdp else 1
        extra = (alg.kl_coef > 0) * 0.25 + (alg.advantage == "gae")  # a reference's fp32 weights, a critic
        static = memory.static_bytes(model, world) * (1 + extra)
        given = tr.offload_optimizer if plan_memory else bool(tr.offload_optimizer)
        self.offload = memory.decide_offload(given, int(static), self.device, self.fsdp)
        self.model = self._prepare(model, layers, trainable=True)
        if lora is not None:
            trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            self.adapter_bytes = sum(
                p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad
            )
            metrics.LORA_PARAMS.set(trainable)
            metrics.LORA_BYTES.set(self.adapter_bytes)
            log.info(
                "LoRA adapter %r: rank %d, alpha %g, dropout %g, targets %s: %d trainable params (%d bytes)",
                lora.name,
                lora.rank,
                lora.alpha,
                lora.dropout,
                lora.target_modules,
                trainable,
                self.adapter_bytes,
            )
        self.opt = self._optimizer(self.model, alg.lr)
        if alg.kl_coef > 0:
            ref = load(alg.ref_model_path or self.model_spec.path)
            self.ref = self._prepare(ref, ref.model.layers, trainable=False)
        if alg.advantage == "gae":
            critic = Critic.from_pretrained(alg.critic_model_path or self.model_spec.path, attn)
            self.critic = self._prepare(critic, critic.backbone.layers, trainable=True)
            self.critic_opt = self._optimizer(self.critic, alg.critic_lr)
        self.memory_plan = memory.plan_learner(self, capacity=None if plan_memory else 0)
        metrics.FP32_HEAD.set(int(self.fp32_head))
        log.info(
            "learner rank %d/%d on %s: fsdp %s, bf16 %s, fp32 LM head %s, activation checkpointing %s, "
            "cpu offload %s, ref %s, critic %s",
            self.ranks.rank,
            self.ranks.world_size,
            self.device,
            self.fsdp,
            self.bf16,
            self.fp32_head if self.bf16 else f"{bool(tr.fp32_lm_head)} (fp32 compute: no effect)",
            self.memory_plan.activation_checkpointing,
            self.offload,
            self.ref is not None,
            self.critic is not None,
        )
        if self.ranks.is_main:
            log.info(
                "policy loss %s (clip [1-%g, 1+%g], dual clip %s, aggregation %s), truncated IS %s-level cap %g, "
                "masked IS %s, KL %s x %g; lr %g %s schedule, %d warmup steps, floor %g x lr; "
                "%d mini-batches x %d epochs = %d optimizer steps per batch",
                alg.loss,
                alg.clip_eps if alg.clip_eps_low is None else alg.clip_eps_low,
                alg.clip_eps if alg.clip_eps_high is None else alg.clip_eps_high,
                alg.dual_clip_c,
                effective_agg(alg.loss, alg.loss_agg),
                alg.is_level,
                alg.is_cap,
                f"{alg.is_mask} in [{alg.is_mask_low or 1 / alg.is_mask_high:g}, {alg.is_mask_high:g}]"
                if alg.is_mask
                else "off",
                alg.kl,
                alg.kl_coef,
                alg.lr,
                alg.lr_schedule,
                alg.lr_warmup_steps,
                alg.min_lr_ratio,
                alg.ppo_minibatches,
                alg.ppo_epochs,
                self.updates,
            )

    def _optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        wd = self.algorithm.weight_decay
        params = [p for p in model.parameters() if p.requires_grad]  # a LoRA policy: the adapter only
        # Fused AdamW: one kernel per parameter group instead of foreach's ~10 passes over every state,
        # when the parameters live on the GPU (with CPU offload the step runs on the host).
        fused = all(p.device.type == "cuda" for p in params)
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd, fused=fused or None)

    def _autocast(self):
        # FSDP's MixedPrecisionPolicy casts per module; without FSDP bf16 comes from autocast.
        on = self.bf16 and not self.fsdp
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=on)

    # --- one step: the batch's optimizer steps -------------------------------------------------------
    def distribute(self, samples: list[TrainSample] | None) -> list[MicroBatch]:
        """Rank 0 passes the step's samples, the others None; every rank gets its packed micro-batches,
        in mini-batch order (MicroBatch.minibatch): the batch split into algorithm.ppo_minibatches
        mini-batches balanced by tokens (split_minibatches: the same split on any number of ranks; with
        more than one, each re-aggregated over its own samples, batch.reweight), then each mini-batch's
        samples split across ranks balanced by tokens, each share packed into the same number of
        micro-batches of at most trainer.micro_batch_tokens tokens (plan_step), so every rank runs the
        same passes and optimizer steps. A micro-batch holds samples of one sampling temperature: samples
        generated at different temperatures are planned apart (each temperature's micro-batches after
        the previous one's, on every rank)."""
        per_rank = None
        if self.ranks.is_main:
            per_rank = [[] for _ in range(self.ranks.world_size)]
            count = self.algorithm.ppo_minibatches
            for k, part in enumerate(split_minibatches([len(s) for s in samples], count)):
                mini = [samples[i] for i in part]
                if count > 1:
                    if self.loss_agg is None:
                        raise ValueError("mini-batches need the learner's response_budget to re-aggregate")
                    mini = reweight(mini, *self.loss_agg)
                for temperature in dict.fromkeys(s.temperature for s in mini):  # first-seen order
                    idx = [i for i, s in enumerate(mini) if s.temperature == temperature]
                    plan = plan_step(
                        [len(mini[i]) for i in idx],
                        self.ranks.world_size,
                        self.memory_plan.micro_batch_tokens,
                    )
                    for rank, mbs in zip(per_rank, plan, strict=True):
                        for mb in mbs:
                            packed = pack([mini[idx[j]] for j in mb])
                            packed.minibatch = k
                            rank.append(packed)
        return self.ranks.scatter(per_rank)

    def _prox(self, mbs: list[MicroBatch], on_policy: bool, head) -> tuple[str, list[torch.Tensor] | None]:
        """(prox_source, pi_prox logprobs per micro-batch; None = each forward pass's own, detached)."""
        if self.updates == 1:
            return "current", None
        if on_policy:
            return "engine", [mb.behav_logprobs for mb in mbs]
        out = []
        self.model.eval()  # a logprob-only pass: no LoRA dropout
        try:
            with torch.no_grad(), self._autocast():
                for mb in mbs:
                    lp, _ = packed_logprobs(self.model, mb, mb.temperature or 1.0, "none", *head)
                    out.append(lp.detach())
        finally:
            self.model.train()
        return "recompute", out

    # Long: a batch's optimizer steps in order (advantages, pi_prox, epochs x mini-batches x micro-batches,
    #   stats)
    def train_step(self, micro_batches: list[MicroBatch], on_policy: bool = False) -> dict[str, float]:
        """Every optimizer step of one batch over this rank's micro-batches (a collective: every rank
        calls it with micro-batches of the same mini-batches, from `distribute`): advantages (GAE) and
        pi_prox once, then ppo_epochs passes, each one forward/backward per micro-batch and one clipped
        optimizer step per mini-batch. on_policy: every sample was generated by the weights being
        trained (its engine logprobs can serve as pi_prox). Returns batch-wide stats (all ranks): sums
        per optimizer step (loss, pg_loss, kl_ref, value_loss) as their mean over the batch's optimizer
        steps, token fractions over every pass; per-step values in `update_stats`."""
        alg = self.algorithm
        world = self.ranks.world_size if self.fsdp else 1
        mbs = [mb.to(self.device) for mb in micro_batches]
        returns = self._gae(mbs) if self.critic is not None else None
        acc = {k: torch.zeros((), device=self.device, dtype=torch.float64) for k in SUM_STATS + MAX_STATS}
        acc["ratio_neg_min"] = torch.full((), -math.inf, device=self.device, dtype=torch.float64)
        # per optimizer step: loss, clipped tokens, tokens (reduced once, with the step's other sums)
        per_update = torch.zeros(3, self.updates, device=self.device, dtype=torch.float64)
        entropy_mode = "grad" if alg.entropy_coef > 0 else "no_grad"
        # fused LM head; fp32 head matmul (bf16 compute only: fp32 compute is fp32 already)
        head = (self.trainer.logprob_chunk_tokens, self.trainer.compile, self.fp32_head)
        seq_terms = (
            alg.loss == "gspo" or alg.is_level == "sequence" or alg.is_mask in ("sequence", "geometric")
        )
        prox_source, prox = self._prox(mbs, on_policy, head)
        minibatches = [
            [i for i, mb in enumerate(mbs) if mb.minibatch == k] for k in range(alg.ppo_minibatches)
        ]
        total_updates = alg.total_steps * self.updates
        grad_norms, critic_norms, lrs = [], [], []
        u = 0
        for _epoch in range(alg.ppo_epochs):
            for members in minibatches:
                # One FSDP rank: accumulate the micro-batches' gradients unsharded (in fp32, FSDP's reduce
                # dtype) and "reduce" once after the last, instead of a copy-in + fp32 add per micro-batch.
                # With more ranks that would hold a whole fp32 gradient per rank, so they reduce-scatter
                # every micro-batch.
                defer_sync = self.fsdp and self.ranks.world_size == 1 and len(members) > 1
                for pos, i in enumerate(members):
                    mb = mbs[i]
                    if defer_sync:
                        for m in (self.model, self.critic):
                            if m is not None:
                                m.set_requires_gradient_sync(pos == len(members) - 1)
                    self._micro_step(
                        mb, i, micro_batches, prox, returns, acc, per_update[:, u], world, entropy_mode, head,
                        seq_terms,
                    )  # fmt: skip
                factor = lr_factor(
                    self.lr_step, total_updates, alg.lr_schedule, alg.lr_warmup_steps, alg.min_lr_ratio
                )
                self._set_lr(self.opt, alg.lr * factor)
                grad_norms.append(grad_norm_clip(self.model.parameters(), alg.max_grad_norm))
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
                if self.critic is not None:
                    self._set_lr(self.critic_opt, alg.critic_lr * factor)
                    critic_norms.append(grad_norm_clip(self.critic.parameters(), alg.max_grad_norm))
                    self.critic_opt.step()
                    self.critic_opt.zero_grad(set_to_none=True)
                lrs.append(alg.lr * factor)
                self.lr_step += 1
                u += 1
        stats = self._reduce(acc, per_update, grad_norms, lrs)
        stats["prox_source"] = prox_source
        if prox_source != self._prox_source and self.ranks.is_main:  # rank 0 logs, every rank remembers
            log.info(
                "pi_prox from %s (%d optimizer steps per batch%s)",
                {"current": "each step's own forward pass", "engine": "the engines' logprobs"}.get(
                    prox_source, "a forward pass before the first update"
                ),
                self.updates,
                ", the batch fully on-policy" if prox_source == "engine" else "",
            )
        self._prox_source = prox_source
        if self.critic is not None:
            stats["critic_grad_norm"] = sum(critic_norms) / len(critic_norms)
        stats["flops"] = self._flops(micro_batches, prox_source == "recompute")
        peak = torch.tensor([float(memory.peak_bytes(self.device))], dtype=torch.float64, device=self.device)
        stats["memory_peak_gib"] = (
            float(self.ranks.all_reduce(peak, torch.distributed.ReduceOp.MAX)[0]) / memory.GIB
        )
        if self.updates > 1 and self.ranks.is_main:
            log.debug(
                "%d optimizer steps (pi_prox %s): loss %s, clip fraction %s",
                self.updates,
                prox_source,
                " ".join(f"{x['loss']:+.4g}" for x in self.update_stats),
                " ".join(f"{x['clip_fraction']:.3f}" for x in self.update_stats),
            )
        return stats

    def _micro_step(
        self, mb, i, micro_batches, prox, returns, acc, upd, world, entropy_mode, head, seq_terms
    ) -> None:
        """Forward/backward of micro-batch i (gradients accumulate); its sums into `acc` and `upd`
        (this optimizer step's loss, clipped tokens, tokens)."""
        alg = self.algorithm
        # the sampling temperature the micro-batch's samples were generated with (0, greedy: plain logits)
        temperature = mb.temperature or 1.0
        with self._autocast():
            logp, ent = packed_logprobs(self.model, mb, temperature, entropy_mode, *head)
        mask, w = mb.loss_mask, mb.token_weights
        prox_lp = logp.detach() if prox is None else prox[i]
        seq_ids = num_seqs = None
        if seq_terms:  # each packed position's sample index, built on the host (no device sync)
            lens = micro_batches[i].cu_seqlens.diff().long()
            num_seqs = len(lens)
            seq_ids = torch.repeat_interleave(torch.arange(num_seqs), lens).to(self.device)
        terms = policy_loss_terms(
            logp,
            prox_lp,
            mb.behav_logprobs,
            mb.advantages,
            alg.loss,
            alg.clip_eps,
            alg.is_cap,
            alg.dual_clip_c,
            clip_eps_low=alg.clip_eps_low,
            clip_eps_high=alg.clip_eps_high,
            is_level=alg.is_level,
            is_mask=alg.is_mask,
            is_mask_low=alg.is_mask_low,
            is_mask_high=alg.is_mask_high,
            mask=mask,
            seq_ids=seq_ids,
            num_seqs=num_seqs,
        )
        per_token = terms.loss
        pg = (terms.loss * w).sum()
        if self.ref is not None:
            with torch.no_grad(), self._autocast():
                ref_lp, _ = packed_logprobs(self.ref, mb, temperature, "none", *head)
            kl = kl_penalty(logp, ref_lp, alg.kl)
            per_token = per_token + alg.kl_coef * kl
            acc["kl_ref"] += (kl.detach() * w).sum()
        if alg.entropy_coef > 0:
            per_token = per_token - alg.entropy_coef * ent
        loss = (per_token * w).sum()
        total = loss
        if self.critic is not None:
            with self._autocast():
                v = self.critic.values(mb)
            vl = (value_loss(v, returns[i][0], returns[i][1], alg.value_clip_eps) * w).sum()
            acc["value_loss"] += vl.detach()
            total = loss + vl  # separate models and optimizers: one backward serves both
        (total * world).backward()
        with torch.no_grad():
            lp = logp.detach()
            clipped = (terms.clipped * mask).sum()
            acc["loss"] += loss.detach()
            acc["pg_loss"] += pg.detach()
            acc["tokens"] += mask.sum()
            acc["entropy_sum"] += (ent * mask).sum()
            acc["clip_sum"] += clipped
            acc["dual_clip_sum"] += (terms.dual_clipped * mask).sum()
            acc["is_weight_sum"] += (terms.is_weight * mask).sum()
            acc["truncated_sum"] += (terms.truncated * mask).sum()
            acc["masked_sum"] += (terms.masked * mask).sum()
            acc["is_weight_max"] = torch.maximum(acc["is_weight_max"], (terms.is_weight * mask).max())
            # rollout (engine) vs trainer logprobs of the same tokens: KL(pi_behav || pi_theta), unbiased
            acc["behav_k3_sum"] += (behav_kl(lp, mb.behav_logprobs) * mask).sum()
            acc["behav_absdiff_sum"] += ((mb.behav_logprobs - lp).abs() * mask).sum()
            # how far the policy has moved from pi_prox on these tokens (1 on the batch's first step)
            ratio = torch.exp((lp - prox_lp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            acc["ratio_sum"] += (ratio * mask).sum()
            acc["ratio_max"] = torch.maximum(acc["ratio_max"], (ratio * mask).max())
            neg = torch.where(mask > 0, -ratio, torch.full_like(ratio, -math.inf)).max()
            acc["ratio_neg_min"] = torch.maximum(acc["ratio_neg_min"], neg.double())
            upd += torch.stack([loss.detach().double(), clipped.double(), mask.sum().double()])

    @staticmethod
    def _set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
        for group in opt.param_groups:
            group["lr"] = lr

    def _gae(self, mbs: list[MicroBatch]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Old values (critic at batch time), GAE advantages whitened over the whole step (all ranks),
        written into each micro-batch's `advantages`; returns [(old_values, returns)] per micro-batch."""
        alg = self.algorithm
        out, advs = [], []
        with torch.no_grad(), self._autocast():
            old = [self.critic.values(mb).float() for mb in mbs]
        sums = torch.zeros(3, dtype=torch.float64)
        for mb, v in zip(mbs, old, strict=True):
            adv, ret = gae_targets(v, mb, alg.gamma, alg.lam)
            m = mb.loss_mask.cpu() > 0
            sums += torch.tensor([adv[m].sum(), adv[m].square().sum(), m.sum()], dtype=torch.float64)
            advs.append(adv)
            out.append((v, ret.to(self.device)))
        sums = self.ranks.all_reduce(sums.to(self.device)).cpu()
        for mb, adv in zip(mbs, advs, strict=True):
            white = whiten(adv, float(sums[0]), float(sums[1]), float(sums[2]))
            mb.advantages = (white * (mb.loss_mask.cpu() > 0)).to(self.device)
        return out

    def _reduce(
        self,
        acc: dict[str, torch.Tensor],
        per_update: torch.Tensor,
        grad_norms: list[float],
        lrs: list[float],
    ) -> dict[str, float]:
        """Batch-wide stats of all ranks (one SUM and one MAX collective); fills `update_stats`."""
        n_sum = len(SUM_STATS)
        sums = torch.cat([torch.stack([acc[k] for k in SUM_STATS]), per_update.reshape(-1)])
        maxes = torch.stack([acc[k] for k in MAX_STATS])
        self.ranks.all_reduce(sums)
        self.ranks.all_reduce(maxes, torch.distributed.ReduceOp.MAX)
        s = dict(zip(SUM_STATS, sums[:n_sum].tolist(), strict=True))
        upd = sums[n_sum:].reshape(3, self.updates).tolist()
        mx = dict(zip(MAX_STATS, maxes.tolist(), strict=True))
        n = max(s["tokens"], 1.0)
        k = self.updates
        self.update_stats = [
            {"loss": upd[0][u], "clip_fraction": upd[1][u] / max(upd[2][u], 1.0), "grad_norm": g, "lr": lr}
            for u, (g, lr) in enumerate(zip(grad_norms, lrs, strict=True))
        ]
        out = {
            # sums of one optimizer step's loss: their mean over the batch's optimizer steps
            "loss": s["loss"] / k,
            "pg_loss": s["pg_loss"] / k,
            "entropy": s["entropy_sum"] / n,
            "clip_fraction": s["clip_sum"] / n,
            "dual_clip_fraction": s["dual_clip_sum"] / n,
            "is_weight_mean": s["is_weight_sum"] / n,
            "is_weight_max": mx["is_weight_max"],
            "is_truncated_fraction": s["truncated_sum"] / n,
            "is_masked_fraction": s["masked_sum"] / n,
            "behav_kl": s["behav_k3_sum"] / n,
            "logprob_diff_mean": s["behav_absdiff_sum"] / n,
            "trained_tokens": s["tokens"] / self.algorithm.ppo_epochs,
            "optimizer_steps": k,
            "grad_norm": sum(grad_norms) / k,
            "grad_norm_max": max(grad_norms),
            "lr": lrs[-1],
            "loss_first": upd[0][0],
            "loss_last": upd[0][-1],
            "clip_fraction_last": self.update_stats[-1]["clip_fraction"],
            "ratio_mean": s["ratio_sum"] / n if s["tokens"] else 1.0,
            "ratio_max": mx["ratio_max"] if s["tokens"] else 1.0,
            "ratio_min": -mx["ratio_neg_min"] if s["tokens"] else 1.0,
        }
        if self.ref is not None:
            out["kl_ref"] = s["kl_ref"] / k
        if self.critic is not None:
            out["value_loss"] = s["value_loss"] / k
        return out

    def _flops(self, micro_batches: list[MicroBatch], prox_pass: bool) -> float:
        """Model FLOPs of this step over all ranks (trainer/flops.py): per optimizer pass policy fwd+bwd,
        reference fwd and critic fwd+bwd; once per batch the pi_prox forward (prox_pass) and critic fwd
        (old values)."""
        seq_lens = [n for mb in micro_batches for n in mb.seq_lens]
        logit_tokens = sum(mb.logit_index.numel() for mb in micro_batches)
        epochs = self.algorithm.ppo_epochs
        total = flops.step_flops(self.config, seq_lens, logit_tokens, passes=3 * epochs + int(prox_pass))
        if self.ref is not None:
            total += flops.step_flops(self.config, seq_lens, logit_tokens, passes=epochs)
        if self.critic is not None:
            total += flops.step_flops(self.critic.config, seq_lens, 0, passes=1 + 3 * epochs)
        return float(self.ranks.all_reduce(torch.tensor([total], dtype=torch.float64, device=self.device))[0])

    # --- weights out ---------------------------------------------------------------------------------
    def parameters_unsharded(self) -> bool:
        """Whether the parameters are plain tensors (nothing sharded, so nothing is gathered):
        `full_parameters` then yields their own storages, which the weight bus may share as they are
        (WeightBus.publish `persistent`). On a mesh of one rank `full_parameters` yields the DTensors' own
        local storages too (distributed.full_tensor), but they count as sharded here: the bus packs them
        into its own buffers (a one-GPU trainer's fp32 parameters need the cast to the wire dtype anyway)."""
        from torch.distributed.tensor import DTensor

        return not any(isinstance(p, DTensor) for p in self.model.parameters())

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every policy parameter, gathered from the shards: a collective, so
        every rank must drain the iterator; only rank 0 needs the tensors. Tied weights appear once. On
        several ranks, one all-gather per FSDP unit (distributed.gathered_by_unit), in the compute dtype
        under mixed precision (the bf16 weights the trainer's forward uses, which the engines get)."""
        from torch.distributed.fsdp import FSDPModule

        if self.ranks.world_size > 1 and isinstance(self.model, FSDPModule):
            yield from gathered_by_unit(self.model)
            return
        for name, p in self.model.named_parameters():
            yield name, full_tensor(p.detach())

    def adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(PEFT saved name, full tensor) of every LoRA adapter parameter, gathered from the shards: the
        names `peft.get_peft_model_state_dict` writes (`base_model.model.model.layers.{i}.self_attn.q_proj.
        lora_A.weight` [r, in], `...lora_B.weight` [out, r]). A collective: every rank drains it."""
        if self.model_spec.lora is None:
            raise ValueError("adapter_tensors needs model.lora")
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                yield peft_name(name), full_tensor(p.detach())
