"""The generator fleet's config: prompts (`DatasetSpec`), rewards (`RewardSpec`), tools and agent
episodes (`ToolSpec`, `AgentSpec`), sampling and rollout workers (`SamplingSpec`, `RolloutSpec`),
the engines (`GeneratorsSpec`, with `SGLangSpec` for launched SGLang servers), and evaluation on a held-out
set during training (`EvalSpec`)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from common.config import (
    MAX_COUNT,
    NewTokens,
    NonNeg,
    Pool,
    Pos,
    Prob,
    RayResources,
    Seconds,
    Spec,
    bad,
    check_resources,
)
from generator_fleet.engine.options import BatchSize, EngineOptions, PrefillWaitSteps, engine_default
from generator_fleet.launch_options import SGLangOptions
from generator_fleet.tasks import REWARDS, TASKS, check_name
from generator_fleet.tools.spec import ToolSpec
from models.config import ModelSpec
from replay_buffer.config import BufferSpec

ENGINES = ("builtin", "sglang", "external")
"""Engine kinds of a fleet (`generators.engine`)."""


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
            raise bad("name", why)


class RewardSpec(Spec):
    name: str | None = None
    """What scores each response, single-turn and agent alike. null: the task's own reward (`arith` for
    `arith`, `qa` for `jsonl` and `word_problems`); `arith`: the exact sum of the arith task; `qa`: the
    final answer checked with the math-verify package, 0 for a response cut off; `math_verify`: the same,
    also for a response cut off; `number`: the stated final answer must be the right plain number (an
    expression such as `1+12` is wrong even where math-verify would accept it); `tool`: the reward a tool set during the episode (check_answer), 0 if
    none; or `package.module:attr`, a function `(problem, response, format_weight) -> float`."""
    format_weight: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.1
    """Share of the reward paid for a well-formed answer; the rest for correctness."""
    overlong_buffer_len: NonNeg = 0
    """DAPO's soft overlong punishment (verl `reward_model.overlong_buffer.len`), in response tokens;
    0 = off. With Lmax the response budget (`rollout.sampling.max_new_tokens`, or `agent.max_total_tokens`)
    and B this length, a response of L tokens gets `overlong_penalty_factor` times 0 if L <= Lmax - B,
    ((Lmax - B) - L) / B if Lmax - B < L <= Lmax, -1 beyond, added to its reward. At most Lmax."""
    overlong_penalty_factor: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] = 1.0
    """Scale of the overlong penalty (verl `overlong_buffer.penalty_factor`): the most a response loses."""

    def __post_init__(self) -> None:
        if self.name is not None and (why := check_name("reward", self.name, REWARDS)):
            raise bad("name", why)


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
    constrain_tool_calls: bool = False
    """Generate each tool call under a grammar built from the tools' argument schemas: a turn runs free
    until it writes `<tool_call>`, then the call's body is constrained (the engine's `ebnf` param) to
    `{"name": <a tool>, "arguments": <its parameters schema>}` and `</tool_call>`, then the turn ends.
    Every call then parses and fits a tool's schema; one call per turn. Logprobs are the engine's (masked)."""


class SamplingSpec(Spec):
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    top_p: Prob = 1.0
    max_new_tokens: NewTokens = 8
    """Most tokens one response may have (at most common.config.MAX_NEW_TOKENS)."""
    ignore_eos: bool = False
    """Generate exactly max_new_tokens, past EOS (SGLang's `ignore_eos`): fixed response lengths for
    benchmarks and throughput comparisons. Single-turn rollouts only (an agent's turns end at EOS)."""


class DynamicSamplingSpec(Spec):
    """DAPO's dynamic sampling (verl `algorithm.filter_groups`): a finished group whose rewards are all
    equal has zero GRPO advantage everywhere, so it is not put into the buffer; its admission slot is
    given back and the worker generates another group in its place, so batches stay full."""

    enabled: bool = False
    max_filtered_per_step: Pos = 64
    """Most groups one rollout worker filters per trainer step (buffer version); beyond it uniform groups
    are kept (and a warning logged once), so a task whose groups are all uniform still makes progress
    (verl's `filter_groups.max_num_gen_batches` bounds the same over-generation, per batch)."""


class RolloutSpec(Spec):
    group_size: Annotated[int, msgspec.Meta(ge=2, le=MAX_COUNT)] = 8
    """Samples per prompt (G); GRPO needs at least 2."""
    concurrency: Pos = 16
    """Groups each rollout worker keeps in flight."""
    sampling: SamplingSpec = msgspec.field(default_factory=SamplingSpec)
    dynamic_sampling: DynamicSamplingSpec = msgspec.field(default_factory=DynamicSamplingSpec)
    overlong_filter: bool = False
    """DAPO's overlong filtering (the paper's; verl has no key for it): a response
    cut off by the token budget (finish_reason `length`) keeps its reward but gets loss_mask all zeros, so
    it does not train. A group with no trainable token left is dropped (its slot given back)."""


class SGLangSpec(SGLangOptions, Spec):
    """How the fleet launches real SGLang servers (`generators.engine: sglang`): the launch options
    (generator_fleet/launch_options.py's SGLangOptions, one `python -m sglang.launch_server` flag each) and the
    GPUs Ray reserves for each server."""

    gpus_per_engine: NonNeg | None = None
    """GPUs Ray reserves per engine (they become its CUDA_VISIBLE_DEVICES); null = tp_size, 0 = none
    (a CPU build of SGLang)."""


class GeneratorsSpec(Spec):
    engine: Literal[ENGINES] = "builtin"
    """`builtin`: `num_engines` of Slipstream's SGLang-compatible engines; `sglang`: the fleet launches
    `num_engines` real SGLang servers (section `sglang`); `external`: attach to engines someone else
    runs (`urls`, or the workers of `router_url`)."""
    num_engines: Pool = 1
    """Engines the fleet starts (`builtin`, `sglang`; at most MAX_POOL = 4096, as in a scale request);
    `external` engines are the `urls`."""
    num_workers: Pool = 1
    """Rollout worker processes (asyncio); each drives every engine (at most 4096)."""
    max_batch_size: BatchSize = engine_default("max_batch_size")
    """Most requests an engine decodes together."""
    prefill_wait_steps: PrefillWaitSteps = engine_default("prefill_wait_steps")
    """`builtin`: with a nearly full batch, decode steps a queued request may wait so that prefills take
    several requests at once (the engine's --prefill-wait-steps); 0 = prefill whenever a slot is free."""
    prefix_cache: bool = True
    """`builtin`: keep finished requests' K/V for requests that start with the same tokens (the next turn
    of an episode prefills only its new tokens); false = the engine's --disable-radix-cache."""
    gpus_per_engine: NonNeg = 0
    """`builtin`: GPUs Ray reserves for each engine (0: CPU, or whatever devices the process sees);
    `sglang` engines take `sglang.gpus_per_engine`."""
    cpus_per_engine: NonNeg = 0
    """CPUs Ray reserves for each engine (and each rollout worker takes none: they wait on I/O)."""
    resources: RayResources = msgspec.field(default_factory=dict)
    """Ray custom resources each engine, rollout worker and evaluator requests, so that they run only on
    nodes that have them: `{node_b: 0.01}` puts them on a node started with
    `ray start --resources '{"node_b": 1}'` (each actor takes the amount given: leave room for all of
    them), `{"node:10.0.0.2": 0.01}` on the node with that address (Ray gives every node a `node:<IP>`).
    Empty: anywhere Ray finds room. The job fails at start, naming this key, if no node has them."""
    torch_threads: Pos = 1
    mem_fraction_static: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] | None = None
    """`builtin` on CUDA: share of the GPU's total memory for the engine's weights and KV pool (SGLang's
    --mem-fraction-static; `sglang` engines take `sglang.mem_fraction_static`), so a colocated trainer
    keeps the rest; null = the pool takes half the memory free after loading the model."""
    fp32_lm_head: bool = engine_default("fp32_lm_head")
    """`builtin`: logits and their log-softmax in fp32 on a bf16 model (SGLang's --enable-fp32-lm-head;
    `sglang` engines take `sglang.enable_fp32_lm_head`): engine logprobs closer to the trainer's. The
    trainer's own fp32 head follows it unless `trainer.fp32_lm_head` is set."""
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
        check_resources("resources", self.resources)
        if self.engine == "external" and not self.urls and self.router_url is None:
            raise bad("urls", "engine `external` needs `urls` (or `router_url` to take its workers from)")
        if self.engine != "external":
            for key in ("urls", "api_key_env"):
                if getattr(self, key):
                    raise bad(key, f"only for engine `external` (engine is `{self.engine}`)")
        elif self.num_engines != 1:
            raise bad("num_engines", "engine `external`: the engines are the `urls`")
        if self.engine != "builtin" and self.mem_fraction_static is not None:
            raise bad(
                "mem_fraction_static",
                f"only for engine `builtin` (engine is `{self.engine}`; SGLang servers take "
                "`sglang.mem_fraction_static`)",
            )
        if self.engine != "builtin" and self.fp32_lm_head:
            raise bad(
                "fp32_lm_head",
                f"only for engine `builtin` (engine is `{self.engine}`; SGLang servers take "
                "`sglang.enable_fp32_lm_head`)",
            )
        if self.sglang.enable_weights_cpu_backup and not self.sglang.enable_memory_saver:
            raise bad(
                "sglang.enable_weights_cpu_backup",
                "backs up the weights on a memory release: needs `sglang.enable_memory_saver`",
            )
        if self.engine != "sglang" and self.sglang != SGLangSpec():
            raise bad("sglang", f"only for engine `sglang` (engine is `{self.engine}`)")
        if self.router_url is not None and self.engine == "builtin":
            raise bad("router_url", "a router fronts `sglang` or `external` engines")
        for i, url in enumerate(self.urls):
            if not url.startswith(("http://", "https://")):
                raise bad(f"urls[{i}]", f"expected an http(s):// base URL, got {url!r}")
            if url.rstrip("/") in (u.rstrip("/") for u in self.urls[:i]):
                raise bad(f"urls[{i}]", f"{url!r} is listed twice")
        if self.router_url is not None and not self.router_url.startswith(("http://", "https://")):
            raise bad("router_url", f"expected an http(s):// base URL, got {self.router_url!r}")


class EvalSpec(Spec):
    """Evaluation during training (verl `trainer.test_freq` / `val_before_train`, AReaL `evaluator`, TRL
    `eval_strategy`): the job's engines answer a held-out set at the weight versions due, scored by the
    job's reward; results are per version and never enter the replay buffer. In a job with `agent`, each
    answer is a whole episode of the job's agent loop (its tools, parser, system prompt and budgets)."""

    every: Pos = 10
    """Versions between evaluations (verl `trainer.test_freq`, AReaL `evaluator.freq_steps`). Version 0
    (before the first step) and the job's last version are always evaluated."""
    heldout: NonNeg = 64
    """Problems split off the job's `dataset` for evaluation (a seeded, deterministic split): rollouts never
    see them. 0 with `dataset` set: the eval set is that section's problems instead."""
    dataset: DatasetSpec | None = None
    """An eval set of its own (verl `data.val_files`, AReaL `valid_dataset`); null = the held-out split."""
    greedy: bool = True
    """Score one greedy (temperature 0) answer per problem: `accuracy`, the mean reward."""
    k: NonNeg = 0
    """pass@k: at least one of k samples correct (reward >= `correct_reward`); 0 = off."""
    samples_per_problem: Pos | None = None
    """n samples per problem for the unbiased pass@k estimator (n >= k); null = k."""
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    """Sampling temperature of the pass@k samples (verl `val_kwargs.temperature`)."""
    top_p: Prob = 1.0
    max_new_tokens: NewTokens | None = None
    """Response budget of an eval answer (with `agent`: of each model turn; an episode's whole budget stays
    `agent.max_total_tokens`); null = `rollout.sampling.max_new_tokens`."""
    correct_reward: Annotated[float, msgspec.Meta(ge=-1e6, le=1e6)] = 1.0
    """A sample counts as correct for pass@k when its reward is at least this (the `arith` and `qa`
    rewards pay 1.0 for a right, well-formed answer)."""
    max_samples: Pos = 512
    """Most samples one evaluation generates: it takes the first max_samples // (greedy + n) problems of
    the eval set."""
    max_version_spread: NonNeg | None = None
    """Weight versions one evaluation's answers may span (each answer comes from one version). null: an
    evaluation that starts at version v keeps every answer made at v or later, so evaluations finish while
    a fast trainer publishes every few seconds; its record is at v and says the newest version in it
    (`version_max`). 0: every answer of a record comes from one version (answers of an older version are
    asked again when the weights change: a job that publishes faster than an evaluation runs gets none)."""
    seed: int = 0
    """Seed of the held-out split."""
    timeout_s: Seconds = 600.0
    """How long one evaluation may take; the evaluations before the first step and after the last are
    waited for at most this long (then logged as failed; the job goes on)."""

    @property
    def n(self) -> int:
        """Samples per problem for pass@k (0 when pass@k is off)."""
        if self.k == 0:
            return 0
        return self.samples_per_problem if self.samples_per_problem is not None else self.k

    @property
    def per_problem(self) -> int:
        """Samples one problem costs per evaluation."""
        return int(self.greedy) + self.n

    def __post_init__(self) -> None:
        if not self.greedy and self.k == 0:
            raise bad("greedy", "nothing to evaluate: set `greedy: true` or pass@k's `k`")
        if self.k > 0 and self.temperature < 1e-6:
            raise bad("temperature", f"pass@{self.k} needs samples that differ: a temperature > 0")
        if self.samples_per_problem is not None and self.samples_per_problem < self.k:
            raise bad("samples_per_problem", f"{self.samples_per_problem} < k = {self.k}: need n >= k")
        if self.samples_per_problem is not None and self.k == 0:
            raise bad("samples_per_problem", "only with pass@k (`k` > 0)")
        if self.per_problem > self.max_samples:
            raise bad(
                "max_samples",
                f"{self.max_samples} is less than one problem's {self.per_problem} samples (greedy + n)",
            )
        if self.dataset is None and self.heldout == 0:
            raise bad("heldout", "0 problems held out and no eval `dataset`: nothing to evaluate on")
        if self.dataset is not None and self.heldout != 0:
            raise bad("heldout", "the eval set is `eval.dataset`: set heldout to 0 (nothing split off)")


class RolloutConfig(msgspec.Struct, kw_only=True):
    """What one rollout worker is configured by: its sections of the job spec and the job facts it
    needs (`JobSpec.rollout_config()` builds it)."""

    name: str
    """Job id; namespaces every Redis key."""
    output_dir: str
    """Where the worker's log goes."""
    model: ModelSpec
    dataset: DatasetSpec
    reward: RewardSpec
    agent: AgentSpec | None = None
    tools: list[ToolSpec] = msgspec.field(default_factory=list)
    rollout: RolloutSpec
    buffer: BufferSpec
    """Admission (`max_staleness`), recycling (`stale_policy`) and the worker lease."""
    groups_per_step: int
    """Groups the trainer consumes per optimizer step (algorithm.groups_per_step): admission control
    lets workers run at most max_staleness steps' worth of groups ahead."""
    response_budget: int = 0
    """Response tokens a sample may have (sampling.max_new_tokens, or agent.max_total_tokens): the Lmax of
    the overlong penalty; 0 = the rollout section's max_new_tokens."""
    eval: EvalSpec | None = None
    """The job's evaluation: its held-out problems are kept out of rollouts."""


class EvalConfig(msgspec.Struct, kw_only=True):
    """What the evaluator is configured by (`JobSpec.eval_config()` builds it)."""

    name: str
    output_dir: str
    model: ModelSpec
    dataset: DatasetSpec
    """The job's dataset (the held-out split's source)."""
    reward: RewardSpec
    eval: EvalSpec
    max_new_tokens: int
    """Response budget of an eval answer, per model turn in agent episodes (eval.max_new_tokens, else the
    rollout's)."""
    agent: AgentSpec | None = None
    """The job's agent episodes: each eval answer is one episode of the same agent loop; None = one turn."""
    tools: list[ToolSpec] = msgspec.field(default_factory=list)
    """The tools the agent's episodes offer."""
    total_steps: int
    """The job's last version: always evaluated."""


def engine_options(model: ModelSpec, generators: GeneratorsSpec) -> EngineOptions:
    """What each of the job's built-in engines runs with: the job's model and its generators section,
    on CUDA when Ray reserves the engine GPUs (it then sees only its own)."""
    return EngineOptions(
        model_path=model.path,
        max_batch_size=generators.max_batch_size,
        prefill_wait_steps=generators.prefill_wait_steps,
        disable_radix_cache=not generators.prefix_cache,
        torch_threads=generators.torch_threads,
        mem_fraction_static=generators.mem_fraction_static,
        fp32_lm_head=generators.fp32_lm_head,
        device="cuda" if generators.gpus_per_engine > 0 else "cpu",
        lora=model.lora,
    )
