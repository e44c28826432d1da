"""What the runner works on and hands back: resolved sampling settings, one sequence being generated,
its finished Completion, and the counters the metrics read."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch

GREEDY_EPS = 1e-6
"""temperature below this means greedy, as in SGLang."""


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
    ) -> None:
        self.rid = rid
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
        self.listener: Callable[[], None] | None = None
        """Called from the generation thread after each new token and at finish (streaming)."""
        self.blocks: list[int] = []
        """KV pool blocks this request owns while running."""
        self.kv_len = 0
        """Tokens whose K/V are in the cache (all but the last sampled one while decoding)."""
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
        self.graph_captures_deferred_total = 0
        """Decode steps run eagerly because their bucket's graph capture had to wait for a weight operation."""
        self.gen_throughput = 0.0
        """Tokens/s of the last decode step; 0 while idle."""
