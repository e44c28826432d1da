"""The trainer's config: the RL algorithm (`AlgorithmSpec`: advantages, policy loss, KL, learning rate)
and the trainer processes (`TrainerSpec`: ranks, device, FSDP2, packing, checkpoints), with the choice
lists the trainer's own modules dispatch on. Free of torch: a job spec loads without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec

from common.config import NonNeg, Pool, Pos, RayResources, Spec, bad, check_resources
from models.config import ModelSpec
from replay_buffer.config import BufferSpec
from weight_bus.config import BusSpec

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
"""Advantage estimators computed per group from its rewards (trainer/advantages.py)."""
ADVANTAGES = (*GROUP_ESTIMATORS, "reinforce_pp", "gae")
"""Every advantage estimator (`algorithm.advantage`)."""
POLICY_LOSSES = ("decoupled_ppo", "ppo", "tis", "gspo", "cispo")
"""Policy losses (`algorithm.loss`, trainer/losses.py)."""
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""Loss aggregation modes (`algorithm.loss_agg`)."""
KL_ESTIMATORS = ("k1", "kl", "k2", "mse", "abs", "k3", "low_var_kl", "k3_unclamped")
"""Per-token KL estimators (`algorithm.kl`)."""
IS_MASK_MODES = ("token", "sequence", "geometric")
"""Masked importance-sampling modes (`algorithm.is_mask`)."""
SCHEDULES = ("constant", "cosine", "linear")
"""Learning-rate schedules after warmup (`algorithm.lr_schedule`, trainer/lr_schedule.py)."""


class AlgorithmSpec(Spec):
    advantage: Literal[ADVANTAGES] = "grpo"
    """`grpo`: (r - group mean) / group std; `dr_grpo`: r - group mean (pair it with `loss_agg:
    seq-mean-token-sum`); `rloo`: r - mean of the group's other samples; `reinforce_pp`: REINFORCE++,
    rewards whitened over every model token of the step; `gae`: GAE (`gamma`, `lam`) with a critic (a
    value head on a copy of `critic_model_path`, clipped value loss), whitened over the step."""
    loss: Literal[POLICY_LOSSES] = "decoupled_ppo"
    """`decoupled_ppo`: PPO-clip on pi/pi_prox times min(pi_prox/pi_behav, is_cap) (AReaL); `ppo`:
    PPO-clip on pi/pi_behav; `tis`: REINFORCE with the truncated weight min(pi/pi_behav, is_cap);
    `gspo`: PPO-clip on the sequence's length-normalised geometric-mean ratio to pi_behav, reduced
    seq-mean-token-mean whatever `loss_agg` says (verl `gspo`); `cispo`: REINFORCE weighted by the
    clipped, stop-gradient ratio pi/pi_behav (verl `cispo`). Every exponentiated log-ratio is clamped to
    +-20 first (verl), so with dual clip off a token is bounded by e^20 |A|, not inf."""
    clip_eps: Annotated[float, msgspec.Meta(gt=0.0)] = 0.2
    clip_eps_low: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] | None = None
    """Lower clip range: the ratio is clipped below at 1 - clip_eps_low (verl `clip_ratio_low`); null =
    clip_eps."""
    clip_eps_high: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    """Upper clip range: clipped above at 1 + clip_eps_high (verl `clip_ratio_high`; DAPO clip-higher
    uses 0.28 with low 0.2); null = clip_eps."""
    is_cap: Annotated[float, msgspec.Meta(ge=1.0)] = 2.0
    """Truncation C of the behaviour importance weight (verl `rollout_is_threshold`)."""
    is_level: Literal["token", "sequence"] = "token"
    """Truncated IS weight of `decoupled_ppo` / `tis` per token, or per sequence: min(product of the
    sequence's ratios, is_cap) on each of its tokens (verl `rollout_is: token | sequence`)."""
    is_mask: Literal[IS_MASK_MODES] | None = None
    """Masked IS: drop tokens whose behaviour ratio pi_prox/pi_behav leaves [is_mask_low, is_mask_high]
    (`token`), or whole sequences whose product (`sequence`) or geometric mean (`geometric`) of ratios
    does (verl `rollout_rs` token / sequence / geometric, now token_k1 / seq_sum_k1 / seq_mean_k1).
    Dropped tokens add 0 to the loss and stay in its denominator; the fraction is `is_masked_fraction`.
    null = off."""
    is_mask_low: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    """Lower bound of masked IS (verl `rollout_rs_threshold_lower`); null = 1 / is_mask_high."""
    is_mask_high: Annotated[float, msgspec.Meta(ge=1.0)] = 2.0
    """Upper bound of masked IS (verl `rollout_rs_threshold`)."""
    dual_clip_c: Annotated[float, msgspec.Meta(gt=1.0)] | None = None
    """Dual clip (ppo, decoupled_ppo): a negative-advantage token's loss is at most -A * c (verl
    `clip_ratio_c`, which verl applies by default at 3.0); null = off."""
    kl: Literal[KL_ESTIMATORS] = "low_var_kl"
    """Per-token estimator of KL(pi || ref) for the penalty, as verl's `kl_penalty` names them: `k1`/`kl`,
    `k2`/`mse`, `abs`; `k3` = `low_var_kl`: k3 with log(ref/pi) clamped to +-20 and the estimate to
    [-10, 10]; `k3_unclamped`: the plain k3 estimator (what `k3` meant before; overflows to inf in fp32
    past log(ref/pi) ~ 88)."""
    kl_coef: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    """Weight of the KL penalty to a frozen reference model; 0 = no reference model is loaded."""
    ref_model_path: str | None = None
    """Reference model (HF directory); null = `model.path`, the policy the job started from."""
    entropy_coef: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    """Weight of the entropy bonus (loss -= coef * token entropy); entropy is logged either way."""
    gamma: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0
    """GAE discount per token (`advantage: gae`)."""
    lam: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0
    """GAE lambda (`advantage: gae`)."""
    critic_model_path: str | None = None
    """Critic backbone (HF directory; its LM head is dropped, a zero-initialised value head added);
    null = `model.path`."""
    critic_lr: Annotated[float, msgspec.Meta(gt=0.0)] = 1e-4
    value_clip_eps: Annotated[float, msgspec.Meta(gt=0.0)] | None = 0.2
    """Clip of the critic's move from its batch-time values in the value loss; null = unclipped."""
    loss_agg: Literal[AGG_MODES] = "token-mean"
    """verl `loss_agg_mode`. `seq-mean-token-sum-norm` (Dr.GRPO): every token's loss summed, divided by
    the step's sequences times `loss_scale_factor`."""
    loss_scale_factor: Pos | None = None
    """Constant denominator of `seq-mean-token-sum-norm` (verl `loss_scale_factor`); null = the
    response budget: agent.max_total_tokens with an agent, else rollout.sampling.max_new_tokens."""
    lr: Annotated[float, msgspec.Meta(gt=0.0)] = 1e-4
    """Peak learning rate of the policy (and `critic_lr` of the critic), scaled per optimizer step by the
    schedule below (total_steps x ppo_minibatches x ppo_epochs optimizer steps in all)."""
    lr_schedule: Literal[SCHEDULES] = "constant"
    """After warmup: constant, or cosine / linear decay to lr * min_lr_ratio at the last optimizer step,
    total_steps x ppo_minibatches x ppo_epochs (verl
    `lr_scheduler_type` / AReaL `lr_scheduler_type`). The step count is in every checkpoint: a resumed
    job continues the schedule."""
    lr_warmup_steps: NonNeg = 0
    """Optimizer steps of linear warmup: step i (from 0) uses lr * (i + 1) / lr_warmup_steps (verl
    `lr_warmup_steps`)."""
    min_lr_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    """Floor of the decay as a fraction of lr (verl / AReaL `min_lr_ratio`)."""
    weight_decay: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    max_grad_norm: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    groups_per_step: Pos = 16
    """Groups (prompts) consumed per step (one batch, one weight version)."""
    total_steps: Pos = 50
    """Steps (batches, weight versions); the job ends after the last one is published. Each step takes
    ppo_minibatches x ppo_epochs optimizer steps. Like every count in a spec, at most MAX_COUNT (10**9)."""
    ppo_minibatches: Pos = 1
    """Optimizer steps per pass over a batch: the batch is split into this many mini-batches balanced by
    tokens, each its own optimizer step with its loss aggregated over its own tokens / sequences (verl
    `ppo_mini_batch_size` = train_batch_size / ppo_minibatches; AReaL `ppo_n_minibatches`). Past the
    first, the policy has moved from pi_prox (the policy at batch time), so the PPO clip acts. At most
    the samples per trainer rank (groups_per_step x rollout.group_size / trainer.num_trainers)."""
    ppo_epochs: Pos = 1
    """Passes over the batch's mini-batches (verl `ppo_epochs`); advantages and pi_prox are computed
    once per batch."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.is_level == "sequence" and self.loss not in ("decoupled_ppo", "tis"):
            raise bad(
                "is_level", f"the truncated IS weight is decoupled_ppo's and tis's (loss is `{self.loss}`)"
            )
        if self.is_mask_low is not None and self.is_mask is None:
            raise bad("is_mask_low", "only with `is_mask`")


class TrainerSpec(Spec):
    num_trainers: Pool = 1
    """Trainer ranks (at most MAX_POOL = 4096, as in a scale request): one process each (one GPU each on cuda), one FSDP2 group (NCCL on cuda, gloo on
    cpu). Rank 0 reads the buffer and publishes weights; a step's samples are split across ranks by
    tokens."""
    device: Literal["cpu", "cuda"] = "cpu"
    torch_threads: Pos = 1
    resources: RayResources = msgspec.field(default_factory=dict)
    """Ray custom resources each trainer rank requests, so that the ranks run only on nodes that have
    them (`{"node:10.0.0.1": 0.01}`: the node with that address; `generators.resources` says more).
    Empty: anywhere Ray finds room. The job fails at start, naming this key, if no node has them."""
    fsdp: bool = True
    """Shard the policy (and reference, critic) with FSDP2, per decoder layer and at the root; false =
    one plain process-local model (then num_trainers must be 1)."""
    mixed_precision: Literal["bf16", "fp32"] = "bf16"
    """Compute dtype on cuda; master weights, optimizer state and gradient reduction stay fp32. CPU
    runs are fp32 whatever this says."""
    fp32_lm_head: bool | None = None
    """The LM head's matmul in fp32 on bf16 compute: the final norm's output and the head's weight (the
    bf16 compute copy, the tied embedding's when tied) are cast to fp32 for the logits, so the logprobs
    behind every ratio come from fp32 logits like the engines' with their fp32 head (TRL
    `cast_lm_head_to_fp32`, the trainer half of SGLang's `--enable-fp32-lm-head`). null = as the engines:
    on with `generators.fp32_lm_head` (builtin) or `generators.sglang.enable_fp32_lm_head` (sglang), off
    with external engines (set it to match how they run) and with mixed_precision fp32. No effect on fp32
    compute (a CPU trainer)."""
    activation_checkpointing: bool | None = None
    """Recompute each decoder layer's activations in backward (less memory, about 1/3 more compute).
    null = planned (trainer/memory.py): on CUDA, on only when the longest sample's activations would not
    fit without it; off on CPU."""
    offload_optimizer: bool | None = None
    """FSDP2 CPU offload: parameters, gradients and optimizer state live in host memory and the
    optimizer step runs on the CPU (needs fsdp). null = planned: on CUDA, on only when the weights,
    gradients and optimizer state alone would take more than 3/4 of the GPU; off on CPU."""
    micro_batch_tokens: Pos | None = None
    """Token budget of one packed micro-batch (samples are packed without padding; one longer sample
    gets a micro-batch of its own); gradients accumulate over a step's micro-batches. null = planned: on
    CUDA as many tokens as fit in the memory the static state leaves (measured activations per token, at
    most 32768); 8192 on CPU. A value that cannot fit on the GPU is lowered, with a warning."""
    compile: bool = False
    """torch.compile each decoder layer and the fused LM head's per-chunk kernels."""
    logprob_chunk_tokens: NonNeg = 2048
    """The LM head, log-softmax and entropy at the trained positions run fused over chunks of this many
    positions (no [positions, vocab] fp32 tensor is ever whole; backward recomputes each chunk's
    logits); 0 = one unchunked log-softmax over all of them."""
    checkpoint_every: NonNeg = 0
    """Write a checkpoint (torch.distributed.checkpoint: weights, optimizer, version) every this many
    steps (weight versions) and after the last; 0 = never."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; null = <output_dir>/checkpoints, a relative path is under output_dir (for
    a submitted job it must stay inside the job's directory)."""
    keep_checkpoints: Pos = 2
    """Newest checkpoints kept; older ones are deleted."""
    resume_from: str | None = None
    """Checkpoint directory, or `latest` (the newest under checkpoint_dir), to resume: weights, optimizer
    state and weight version are restored, with any number of ranks (resharded), and engines get the
    restored weights before rollouts start."""
    export_hf: bool = True
    """Write the final policy as an HF directory (config + safetensors + tokenizer) to
    <output_dir>/final_model, loadable by transformers and SGLang. With model.lora: the frozen base there
    and the trained adapter as a PEFT directory in final_model/adapter."""
    export_merged: bool = False
    """With model.lora: also write the adapter merged into the base weights (W + alpha / rank * B @ A,
    PEFT's `merge_and_unload`) as a plain transformers directory in final_model/merged, for servers
    without LoRA support (verl: `python -m verl.model_merger merge` on a checkpoint; PEFT:
    `merge_and_unload()` then `save_pretrained`). Needs export_hf."""

    def __post_init__(self) -> None:
        check_resources("resources", self.resources)
        if self.num_trainers > 1 and not self.fsdp:
            raise bad("num_trainers", "more than one trainer rank needs fsdp: true")
        if self.offload_optimizer and not self.fsdp:
            raise bad("offload_optimizer", "CPU offload is FSDP2's: needs fsdp: true")
        if self.export_merged and not self.export_hf:
            raise bad("export_merged", "the merged model is part of the HF export: needs export_hf: true")
        if self.fp32_lm_head and self.mixed_precision == "fp32":
            raise bad("fp32_lm_head", "mixed_precision fp32 computes the LM head in fp32 already")


def checkpoint_dir(output_dir: str | Path, configured: str | None = None) -> Path:
    """Where a job's checkpoints go: `trainer.checkpoint_dir` (`configured`) if set, else
    <output_dir>/checkpoints. The one place that derives it: the trainer writes there, and the job driver
    and the control plane look there (slipstream/job/store.py job_checkpoint_dir)."""
    return Path(configured or Path(output_dir) / "checkpoints")


class TrainerConfig(msgspec.Struct, kw_only=True):
    """What one trainer rank is configured by: its sections of the job spec and the job facts it needs
    (`JobSpec.trainer_config()` builds it)."""

    name: str
    """Job id; namespaces every Redis key."""
    output_dir: str
    """Where the final model, checkpoints (by default), samples.txt and logs go."""
    model: ModelSpec
    algorithm: AlgorithmSpec
    trainer: TrainerSpec
    buffer: BufferSpec
    bus: BusSpec
    response_budget: int
    """Most response tokens of one sample (agent.max_total_tokens with an agent, else
    rollout.sampling.max_new_tokens): `seq-mean-token-sum-norm`'s constant when
    `algorithm.loss_scale_factor` is null."""
    schedule: str | None = None
    """A colocated job's schedule (`sync`: rank 0 has the engines release their memory for each optimizer
    step and resume it for the publish; `async`: both stay resident); None when disaggregated."""
