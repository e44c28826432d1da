"""Generation core of the built-in engine: one thread batches queued requests and decodes them with the
HF KV cache; pause, abort and weight swaps take effect at decode-step boundaries.

Minimal version: a batch runs until its last request finishes (finished rows keep their slot) and requests
arriving meanwhile wait for the next batch. Paged KV and continuous batching replace `_run_batch` later;
the public surface (submit/abort/pause/resume/load_weights/snapshot) stays.
"""

from __future__ import annotations

import collections
import concurrent.futures
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import torch
from transformers import AutoModelForCausalLM

from slipstream.tokenizers import load_tokenizer

log = logging.getLogger(__name__)

GREEDY_EPS = 1e-6
"""temperature below this means greedy, as in SGLang."""

ABORT_QUEUED = "Abort before prefill"
"""SGLang's message for a request aborted before it ran; AReaL keys on this prefix (empty output)."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Resolved per-request sampling settings; defaults are SGLang's (shared/SGLANG_API.md §1)."""

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
    ) -> None:
        self.rid = rid
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
        self.gen_throughput = 0.0
        """Tokens/s of the last decode step; 0 while idle."""


class Runner:
    """Owns the model, the request queue and the generation thread."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 256,
        weight_version: str = "0",
        context_length: int | None = None,
    ) -> None:
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.tokenizer = load_tokenizer(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).to(self.device).eval()
        self.config = self.model.config
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.context_length = int(context_length or getattr(self.config, "max_position_embeddings", 4096))
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self.pad_token_id = next(
            (t for t in (self.tokenizer.pad_token_id, *sorted(self.eos_token_ids)) if t is not None), 0
        )
        # Live views of the parameters keyed by HF name (tied weights appear under both names), so a
        # weight update is an in-place copy_ and never re-allocates what the forward pass uses.
        self._named_tensors = self.model.state_dict()
        self._logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.stats = RunnerStats()

        # _cv guards everything below; the generation thread waits on it for work, for resume, and for
        # weight updates to finish; updaters wait on it for the step in flight to end.
        self._cv = threading.Condition()
        self._queue: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._weight_version = str(weight_version)
        self._paused = False
        self._pause_mode: str | None = None
        self._parked = False
        self._in_step = False
        self._updating = False
        self._stopping = False
        self._update_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine-generation", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Abort everything (their callers get finish_reason abort) and end the generation thread."""
        with self._cv:
            self._stopping = True
            self._abort_matching(lambda r: True, "Engine is shutting down")
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ---- requests --------------------------------------------------------------------------------

    def submit(self, req: Request) -> concurrent.futures.Future[Completion]:
        """Queue `req`; the future resolves when it finishes (stop, length or abort)."""
        if req.params.sampling_seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(req.params.sampling_seed)
        with self._cv:
            if self._stopping:
                self._finish(req, _abort_reason("Engine is shutting down"))
            else:
                self._queue.append(req)
                self._cv.notify_all()
        return req.future

    def abort(self, rid: str = "", abort_all: bool = False, message: str = "Aborted by abort_request") -> int:
        """Abort requests whose rid starts with `rid` (SGLang matches by prefix), or all; returns how many.
        Queued ones finish now; running ones at the next step boundary."""
        if not abort_all and not rid:
            return 0
        with self._cv:
            n = self._abort_matching(lambda r: abort_all or r.rid.startswith(rid), message)
            self._cv.notify_all()
        return n

    def abort_requests(self, reqs: Iterable[Request], message: str) -> None:
        ids = {id(r) for r in reqs}
        with self._cv:
            self._abort_matching(lambda r: id(r) in ids, message)
            self._cv.notify_all()

    # ---- pause / resume --------------------------------------------------------------------------

    def pause(self, mode: str = "abort") -> None:
        """Stop starting steps. "abort": abort everything in flight and return once all have returned;
        "in_place": running requests keep their KV cache and resume after `resume()`."""
        if mode not in ("abort", "in_place"):
            raise ValueError(f"pause mode {mode!r} is not supported by the built-in engine")
        with self._cv:
            self._paused = True
            self._pause_mode = mode
            if mode == "abort":
                self._abort_matching(lambda r: True, "Abort by pause_generation")
                self._cv.notify_all()
                while self._running:
                    self._cv.wait()

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._pause_mode = None
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    # ---- weights ---------------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self._weight_version

    def set_weight_version(self, version: str) -> None:
        with self._cv:
            self._weight_version = str(version)

    def at_step_boundary(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` while no forward pass is in flight and none can start (the writer side of SGLang's
        model_update_lock, but only for one step: running requests go on afterwards)."""
        with self._update_lock:
            with self._cv:
                self._updating = True
                while self._in_step:
                    self._cv.wait()
            try:
                return fn()
            finally:
                with self._cv:
                    self._updating = False
                    self._cv.notify_all()

    def load_weights(
        self, named_tensors: list[tuple[str, torch.Tensor]], weight_version: str | None = None
    ) -> None:
        """Copy tensors into the parameters of the same HF name at a step boundary; all names and shapes
        are checked first, so a bad request changes nothing."""
        unknown = [n for n, _ in named_tensors if n not in self._named_tensors]
        if unknown:
            raise ValueError(f"unknown parameter names: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        for name, t in named_tensors:
            if tuple(t.shape) != tuple(self._named_tensors[name].shape):
                raise ValueError(
                    f"shape mismatch for {name}: got {list(t.shape)}, expected {list(self._named_tensors[name].shape)}"
                )

        def apply() -> None:
            with torch.no_grad():
                for name, t in named_tensors:
                    self._named_tensors[name].copy_(t)
            if weight_version is not None:
                self._weight_version = str(weight_version)

        self.at_step_boundary(apply)

    def load_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        fresh = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        self.load_weights(list(fresh.state_dict().items()), weight_version)

    # ---- introspection ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Scheduler state for /server_info internal_states and the gauges of /metrics."""
        with self._cv:
            running = len(self._running)
            return {
                "num_running_reqs": running,
                "num_queue_reqs": len(self._queue),
                "num_paused_reqs": running if self._parked else 0,
                "paused": self._paused,
                "pause_mode": self._pause_mode,
                "weight_version": self._weight_version,
                "last_gen_throughput": self.stats.gen_throughput,
                "generation_tokens_total": self.stats.generation_tokens_total,
                "num_requests_total": self.stats.num_requests_total,
            }

    # ---- generation thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not self._stopping and (self._paused or self._updating or not self._queue):
                        self._cv.wait()
                    if self._stopping:
                        return
                    n = min(len(self._queue), self.max_batch_size)
                    self._running = [self._queue.popleft() for _ in range(n)]
                    batch = self._running
                try:
                    self._run_batch(batch)
                except Exception as exc:
                    log.exception("generation batch of %d failed", len(batch))
                    with self._cv:
                        for r in batch:
                            if not r.done:
                                r.done = True
                                r.future.set_exception(exc)
                finally:
                    with self._cv:
                        self._running = []
                        self._parked = False
                        self._in_step = False
                        self.stats.gen_throughput = 0.0
                        self._cv.notify_all()

    def _begin_step(self, live: list[Request]) -> str | None:
        """Wait at a step boundary while paused or a weight update runs, reaping aborts meanwhile.
        Returns the weight version the step runs under, or None when no live request is left."""
        with self._cv:
            while True:
                if self._stopping:
                    self._abort_matching(lambda r: True, "Engine is shutting down")
                if any(r.abort_message is not None for r in live):
                    for r in live:
                        if r.abort_message is not None:
                            self._finish(r, _abort_reason(r.abort_message))
                    live[:] = [r for r in live if not r.done]
                if not live:
                    return None
                if not self._paused and not self._updating:
                    break
                self._parked = self._paused
                self._cv.wait()
            self._parked = False
            self._in_step = True
            return self._weight_version

    def _end_step(self) -> None:
        with self._cv:
            self._in_step = False
            self._cv.notify_all()

    def _run_batch(self, live: list[Request]) -> None:
        version = self._begin_step(live)
        if version is None:
            return
        rows = list(live)  # row i of every tensor below is rows[i] for the whole batch
        try:
            ids, mask = self._left_pad([r.prompt_ids for r in rows])
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            want_input_lp = any(r.return_logprob and r.logprob_start_len >= 0 for r in rows)
            kw = {"logits_to_keep": 1} if self._logits_to_keep and not want_input_lp else {}
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **kw)
            if want_input_lp:
                self._input_logprobs(rows, out.logits, ids)
            logits = out.logits[:, -1].float()
            cache = out.past_key_values
            self.stats.prompt_tokens_total += sum(len(r.prompt_ids) for r in rows)
        finally:
            self._end_step()
        # max_new_tokens == 0 is prefill only
        for r in rows:
            if r.params.max_new_tokens == 0:
                self._finish(r, {"type": "length", "length": 0})
        next_pos = pos[:, -1:] + 1
        while True:
            t0 = time.monotonic()
            tokens = self._sample(rows, logits, version)
            with self._cv:
                live[:] = [r for r in live if not r.done]
            sample_s = time.monotonic() - t0
            version = self._begin_step(live)
            if version is None:
                return
            t0 = time.monotonic()  # the wait at the boundary (pause, update) is not decode time
            try:
                mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
                out = self.model(
                    input_ids=tokens[:, None],
                    attention_mask=mask,
                    position_ids=next_pos,
                    past_key_values=cache,
                    use_cache=True,
                )
                cache = out.past_key_values
                logits = out.logits[:, -1].float()
                next_pos = next_pos + 1
            finally:
                self._end_step()
            self.stats.gen_throughput = len(live) / max(time.monotonic() - t0 + sample_s, 1e-9)

    def _left_pad(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _input_logprobs(self, rows: list[Request], logits: torch.Tensor, ids: torch.Tensor) -> None:
        width = ids.shape[1]
        for i, r in enumerate(rows):
            if not (r.return_logprob and r.logprob_start_len >= 0):
                continue
            n, off = len(r.prompt_ids), width - len(r.prompt_ids)
            lp = torch.log_softmax(logits[i, off : width - 1].float(), dim=-1)
            got = lp.gather(1, ids[i, off + 1 : width, None]).squeeze(1).tolist()
            full: list[float | None] = [None, *got]
            r.input_logprobs = full[min(r.logprob_start_len, n) :]

    def _sample(self, rows: list[Request], logits: torch.Tensor, version: str) -> torch.Tensor:
        """Pick each live row's next token, record it with its logprob and version, finish rows that
        are done. Returns the next input token per row (pad for finished rows).

        The logprob is under the temperature-scaled logits (the distribution sampled from before top-p/
        top-k/min-p truncation), as SGLang reports by default; greedy rows use temperature 1. The trainer
        divides its logits by the same temperature, so behaviour and policy logprobs compare like with like.
        """
        temps = torch.tensor(
            [1.0 if r.params.greedy else r.params.temperature for r in rows],
            dtype=logits.dtype,
            device=logits.device,
        )
        logprobs = torch.log_softmax(logits / temps[:, None], dim=-1)
        argmax = logits.argmax(dim=-1).tolist()
        chosen = [self.pad_token_id] * len(rows)
        live_rows = []
        for i, r in enumerate(rows):
            if r.done:
                continue
            p = r.params
            if p.greedy and p.plain and len(r.output_ids) >= p.min_new_tokens:
                chosen[i] = argmax[i]
            else:
                chosen[i] = self._sample_one(r, logits[i])
            live_rows.append(i)
        tokens = torch.tensor(chosen, dtype=torch.long, device=logits.device)
        picked = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        now = time.monotonic()
        for i in live_rows:
            r = rows[i]
            if r.first_token_at is None:
                r.first_token_at = now
            r.output_logprobs.append(picked[i])
            r.versions.append(version)
            if r.top_logprobs_num > 0:
                top = torch.topk(logprobs[i], min(r.top_logprobs_num, logprobs.shape[-1]))
                r.output_top_logprobs.append(
                    list(zip(top.values.tolist(), top.indices.tolist(), strict=True))
                )
            r.output_ids.append(chosen[i])  # last: a concurrent progress() reads len(output_ids) first
            self.stats.generation_tokens_total += 1
            reason = self._check_finished(r)
            if reason is not None:
                self._finish(r, reason)
            elif r.listener:
                r.listener()
        return tokens

    def _sample_one(self, r: Request, logits: torch.Tensor) -> int:
        p = r.params
        x = logits.clone()
        if not p.plain:
            if p.logit_bias:
                for tok, bias in p.logit_bias.items():
                    if 0 <= tok < x.shape[0]:
                        x[tok] += bias
            if r.output_ids:
                out = torch.tensor(r.output_ids, device=x.device)
                counts = torch.bincount(out, minlength=x.shape[0]).to(x.dtype)
                seen = counts > 0
                if p.repetition_penalty != 1.0:
                    x = torch.where(seen & (x > 0), x / p.repetition_penalty, x)
                    x = torch.where(seen & (x <= 0), x * p.repetition_penalty, x)
                x = x - p.frequency_penalty * counts - p.presence_penalty * seen.to(x.dtype)
        if len(r.output_ids) < p.min_new_tokens:
            banned = [t for t in (*self.eos_token_ids, *p.stop_token_ids) if 0 <= t < x.shape[0]]
            x[banned] = float("-inf")
        if p.greedy:
            return int(x.argmax())
        x = x / p.temperature
        if 0 < p.top_k < x.shape[0]:
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            drop = (sorted_p.cumsum(-1) - sorted_p) > p.top_p  # keep the smallest prefix reaching top_p
            probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=r.generator))

    def _check_finished(self, r: Request) -> dict[str, Any] | None:
        """SGLang's order: length first, then EOS/stop tokens (skipped with ignore_eos), then stop strings."""
        p = r.params
        if len(r.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        last = r.output_ids[-1]
        if not p.ignore_eos and (last in self.eos_token_ids or last in p.stop_token_ids):
            return {"type": "stop", "matched": last}
        if p.stop:
            tail = self.tokenizer.decode(r.output_ids[-(r.stop_max_len + 1) :])
            for s in p.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        return None

    # ---- finishing (callers hold _cv or are the generation thread) -------------------------------

    def _abort_matching(self, pred: Callable[[Request], bool], message: str) -> int:
        n = 0
        kept: collections.deque[Request] = collections.deque()
        for r in self._queue:
            if pred(r):
                self._finish(r, _abort_reason(ABORT_QUEUED))
                n += 1
            else:
                kept.append(r)
        self._queue = kept
        for r in list(self._running):
            if not r.done and r.abort_message is None and pred(r):
                r.abort_message = message
                n += 1
        return n

    def _completion(self, r: Request, reason: dict[str, Any], n: int) -> Completion:
        spans = version_spans(r.versions[:n])
        return Completion(
            rid=r.rid,
            prompt_tokens=len(r.prompt_ids),
            output_ids=r.output_ids[:n],
            finish_reason=reason,
            weight_versions=spans,
            weight_version=spans[-1]["version"] if spans else self._weight_version,
            output_logprobs=r.output_logprobs[:n],
            output_top_logprobs=r.output_top_logprobs[:n] if r.top_logprobs_num > 0 else None,
            input_logprobs=r.input_logprobs,
            e2e_latency=time.monotonic() - r.created,
            time_to_first_token=None if r.first_token_at is None else r.first_token_at - r.created,
        )

    def progress(self, r: Request) -> Completion:
        """What a running request has produced so far (finish_reason {}), safe to call from another
        thread: the generation thread appends output_ids last, so its length bounds the other lists."""
        return self._completion(r, {}, len(r.output_ids))

    def _finish(self, r: Request, reason: dict[str, Any]) -> None:
        if r.done:
            return
        r.done = True
        completion = self._completion(r, reason, len(r.output_ids))
        with self._cv:
            self.stats.num_requests_total += 1
            if reason["type"] == "abort":
                self.stats.num_aborted_requests_total += 1
        r.future.set_result(completion)
        if r.listener:
            r.listener()


def _abort_reason(message: str) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def _eos_token_ids(model, tokenizer) -> set[int]:
    """EOS ids from the config, the generation config and the tokenizer (SGLang unions them too)."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for src in (model.config.eos_token_id, getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list | tuple):
            ids.update(int(t) for t in src)
    return ids
