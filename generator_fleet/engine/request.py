"""What the runner works on and hands back: resolved sampling settings, one sequence being generated,
its finished Completion, and the counters the metrics read."""

from __future__ import annotations

import concurrent.futures
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import torch

if TYPE_CHECKING:
    from generator_fleet.engine.grammar import Constraint

GREEDY_EPS = 1e-6
"""temperature below this means greedy, as in SGLang."""
MAX_STOP_REGEX_COUNT = 32
MAX_STOP_REGEX_LEN = 256
"""SGLang's limits on stop_regex: patterns per request, UTF-8 bytes per pattern."""
UNBOUNDED = 1 << 30


def regex_max_len(pattern: str) -> int:
    """Most characters a match of `pattern` can span (UNBOUNDED for `*`, `+`, `{n,}`), as SGLang bounds
    the decoded tail it searches for a stop_regex."""
    import re._parser as sre_parse  # noqa: PLC0415 - the stdlib's regex parser, only for this bound

    def walk(sub) -> int:
        total = 0
        for op, value in sub:
            if op in (sre_parse.LITERAL, sre_parse.IN, sre_parse.ANY, sre_parse.NOT_LITERAL):
                total += 1
            elif op == sre_parse.SUBPATTERN:
                total += walk(value[3])
            elif op == sre_parse.BRANCH:
                total += max(walk(b) for b in value[1])
            elif op in (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT):
                hi, inner = value[1], value[2]
                total += UNBOUNDED if hi == sre_parse.MAXREPEAT else hi * walk(inner)
            elif op == sre_parse.GROUPREF:
                return UNBOUNDED
        return min(total, UNBOUNDED)

    return walk(sre_parse.parse(pattern))


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Resolved per-request sampling settings; defaults are SGLang's (docs/sglang_api.md §1)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 = whole vocabulary."""
    min_p: float = 0.0
    min_new_tokens: int = 0
    """EOS and stop tokens are masked out until this many tokens exist."""
    stop: tuple[str, ...] = ()
    stop_regex: tuple[str, ...] = ()
    """A match (re.search) in the decoded output tail stops the request; the text keeps the match."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    """Also disables stop_token_ids, as in SGLang's Req.check_finished."""
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    sampling_seed: int | None = None
    """Seeds a per-request torch.Generator: the same request gives the same tokens."""

    def verify(self) -> None:
        """Raise ValueError on out-of-range values (SGLang's SamplingParams.verify)."""
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], got {self.min_new_tokens}."
            )
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.")
        if len(self.stop_regex) > MAX_STOP_REGEX_COUNT:
            raise ValueError(
                f"at most {MAX_STOP_REGEX_COUNT} stop_regex patterns are allowed, got {len(self.stop_regex)}"
            )
        for pattern in self.stop_regex:
            n = len(pattern.encode("utf-8"))
            if n > MAX_STOP_REGEX_LEN:
                raise ValueError(f"stop_regex is {n} bytes, over the {MAX_STOP_REGEX_LEN}-byte limit")
            try:
                re.compile(pattern)
            except (re.error, RecursionError) as e:
                raise ValueError(f"invalid stop_regex {pattern!r}: {e}") from None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def plain(self) -> bool:
        """No logit processing besides temperature/top-k/top-p/min-p (the vectorised fast path)."""
        return (
            self.frequency_penalty == 0.0
            and self.presence_penalty == 0.0
            and self.repetition_penalty == 1.0
            and not self.logit_bias
        )


class Completion(msgspec.Struct, kw_only=True):
    """A finished request, as the runner hands it back; the server renders SGLang's JSON from it."""

    rid: str
    prompt_tokens: int
    output_ids: list[int]
    finish_reason: dict[str, Any]
    """SGLang shape: {"type": "stop", "matched": id|str} | {"type": "length", "length": n} | {"type": "abort", ...}."""
    weight_versions: list[dict[str, Any]]
    """Output-token spans [{"version", "start", "end"}], one per weight version the tokens came from."""
    weight_version: str
    """Version of the last token (the server's version at finish when there are no tokens)."""
    output_logprobs: list[float]
    """logprob of each output token under the temperature-scaled fp32 logits, incl. a final EOS."""
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    input_logprobs: list[float | None] | None = None
    """Prompt tokens from logprob_start_len on; the first prompt token has None."""
    e2e_latency: float = 0.0
    time_to_first_token: float | None = None
    num_retractions: int = 0
    """Times the request was retracted (KV freed, re-prefilled later)."""
    cached_tokens: int = 0
    """Prompt tokens taken from the prefix cache instead of computed."""


class Request:
    """One sequence being generated; a batch or `n` > 1 HTTP call becomes several. Mutated only by the
    generation thread once running (abort sets `abort_message`, which that thread reaps)."""

    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        priority: int = 0,
        lora_name: str | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        self.rid = rid
        self.constraint = constraint
        """The request's grammar (regex / json_schema / ebnf) matcher; None = unconstrained. Each of n
        samples has its own; it is advanced by every token the request accepts."""
        self.lora_name = lora_name
        """The LoRA adapter this request runs with (its /generate lora_path); None = the base model."""
        self.priority = priority
        """Queue order: a larger value is admitted before a smaller one, FIFO among equals (SGLang's
        `priority` with its default order). Evaluation requests take a lower one than rollouts."""
        self.prompt_ids = prompt_ids
        self.params = params
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num if return_logprob else 0
        self.future: concurrent.futures.Future[Completion] = concurrent.futures.Future()
        self.created = time.monotonic()
        self.first_token_at: float | None = None
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.input_logprobs: list[float | None] | None = None
        self.versions: list[str] = []
        self.abort_message: str | None = None
        self.done = False
        self.generator: torch.Generator | None = None
        self.stop_max_len = max((len(s) for s in params.stop), default=0)
        self.stop_regex = [(p, re.compile(p)) for p in params.stop_regex]
        self.stop_regex_max_len = max((regex_max_len(p) for p in params.stop_regex), default=0)
        self.listener: Callable[[], None] | None = None
        """Called from the generation thread after each new token and at finish (streaming)."""
        self.blocks: list[int] = []
        """KV pool blocks this request holds while running (the first len(prefix) shared with the prefix
        cache, the rest its own)."""
        self.kv_len = 0
        """Tokens whose K/V are in the cache (all but the last sampled one while decoding)."""
        self.prefix: list = []
        """The prefix cache's nodes (engine/prefix_cache.py) whose blocks start `blocks`, referenced."""
        self.prefix_epoch = -1
        """The prefix cache's epoch at admission: the K/V goes back into the cache only if still current."""
        self.cached_tokens = 0
        """Prompt tokens its first prefill took from the prefix cache (SGLang's meta_info.cached_tokens)."""
        self.num_retractions = 0


def version_spans(versions: list[str]) -> list[dict[str, Any]]:
    """Run-length encode per-token versions into SGLang's weight_versions spans."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


class RunnerStats:
    """Counters read by /metrics and /server_info (written by the generation thread, read racily)."""

    def __init__(self) -> None:
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_requests_total = 0
        self.num_aborted_requests_total = 0
        self.num_retractions_total = 0
        self.num_decode_steps_total = 0
        self.num_prefill_steps_total = 0
        self.decode_rows_total = 0
        """Rows of all decode steps (/ num_decode_steps_total: the mean decode batch)."""
        self.prefill_rows_total = 0
        """Requests of all prefill steps (/ num_prefill_steps_total: requests per prefill)."""
        self.prefix_cached_tokens_total = 0
        """Tokens whose K/V a prefill took from the prefix cache (an earlier request's) instead of computing
        them."""
        self.prefill_shared_tokens_total = 0
        """Prompt tokens whose K/V a prefill copied from an identical prompt of the same step (a group's
        samples) instead of computing them."""
        self.prefill_seconds_total = 0.0
        self.decode_seconds_total = 0.0
        """Host time in each kind of step, including the GPU time the step waits on for its sampled tokens."""
        self.graph_captures_deferred_total = 0
        """Decode steps run eagerly because their bucket's graph capture had to wait for a weight operation."""
        self.gen_throughput = 0.0
        """Tokens/s of the last decode step; 0 while idle."""
