"""Generation core of the built-in engine: continuous batching over a paged KV cache.

One thread runs the scheduler. Every step it either prefills newly admitted requests (batched, up to a
token budget) or decodes one token for every running request; requests join after any step and leave the
moment they finish, freeing their KV blocks. When the pool runs out of blocks the newest request is
retracted (its blocks freed, it goes back to the front of the queue and is re-prefilled from its prompt
and the tokens it already has). Pause, abort, weight swaps and memory release take effect at step
boundaries; a token carries the weight version of the step that produced it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from generator_fleet.engine.arena import lay_out_weights
from generator_fleet.engine.faults import FAULT_ENV, EngineUnhealthy, is_fatal_cuda_error, step_delay_s
from generator_fleet.engine.grammar import GrammarBackend
from generator_fleet.engine.kv_cache import PagedKVCache, blocks_for
from generator_fleet.engine.lora import LoraBank
from generator_fleet.engine.memory import (
    WeightsBackup,
)
from generator_fleet.engine.model import DecodeGraphs, PagedForward, check_supported
from generator_fleet.engine.multi_copy import MultiCopy
from generator_fleet.engine.options import EngineOptions
from generator_fleet.engine.prefix_cache import PrefixCache
from generator_fleet.engine.profiling import StepProfiler
from generator_fleet.engine.request import Completion, Request, RunnerStats, version_spans
from generator_fleet.engine.runner_steps import RunnerSteps, abort_reason
from generator_fleet.engine.runner_weights import RunnerWeights
from models.config import LoraSpec
from models.tokenizers import load_tokenizer

log = logging.getLogger(__name__)

ABORT_QUEUED = "Abort before prefill"
"""SGLang's message for a request aborted before it ran; AReaL keys on this prefix (empty output)."""


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(path: str, device: torch.device, dtype: torch.dtype, load_format: str | None) -> nn.Module:
    """The HF model at `path` on `device` in `dtype`, in eval mode; load_format "dummy" (SGLang's name):
    random weights from the config, made on the device (benchmarks of models too large to save)."""
    if load_format == "dummy":
        with torch.device(device):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype).eval()
    if load_format in (None, "auto"):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    raise ValueError(f"load_format {load_format!r}: expected auto or dummy")


# Long: the scheduler's state and its admission, pause and finishing; prefill/decode steps and weight
#   operations are mixins of their own
class Runner(RunnerWeights, RunnerSteps):
    """Owns the model, the KV cache, the request queue and the generation thread."""

    @classmethod
    def from_options(cls, o: EngineOptions) -> Runner:
        """The runner an engine's options describe (engine/options.py: the server's, the command line's)."""
        return cls(
            o.model_path,
            device=o.device,
            max_batch_size=o.max_batch_size,
            weight_version=o.weight_version,
            context_length=o.context_length,
            dtype=getattr(torch, o.dtype) if o.dtype else None,
            kv_cache_tokens=o.kv_cache_tokens,
            mem_fraction_static=o.mem_fraction_static,
            cuda_graphs=not o.disable_cuda_graph,
            load_format=o.load_format,
            fp32_lm_head=o.fp32_lm_head,
            json_any_whitespace=not o.constrained_json_disable_any_whitespace,
            lora=o.lora,
            max_loras=o.max_loras,
            prefill_wait_steps=o.prefill_wait_steps,
            prefix_cache=not o.disable_radix_cache,
            profile_dir=o.profile_dir,
        )

    # Long: the scheduler's state declared in one place, each field with what it guards
    def __init__(
        self,
        model_path: str,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        max_batch_size: int = 256,
        weight_version: str = "0",
        context_length: int | None = None,
        kv_cache_tokens: int | None = None,
        block_size: int = 16,
        max_prefill_tokens: int | None = None,
        cuda_graphs: bool = True,
        mem_fraction: float = 0.5,
        load_format: str | None = None,
        mem_fraction_static: float | None = None,
        fp32_lm_head: bool = False,
        lora: LoraSpec | None = None,
        max_loras: int = 1,
        json_any_whitespace: bool = True,
        prefill_wait_steps: int = 8,
        prefix_cache: bool = True,
        profile_dir: str | None = None,
    ) -> None:
        """`kv_cache_tokens`: size of the KV pool; default on CUDA = `mem_fraction` of the memory free after
        loading the model, on CPU = 2 GiB worth; never more than `max_batch_size × context_length`.
        `mem_fraction_static` (CUDA, SGLang's meaning): the share of the GPU's total memory for the weights
        and the KV pool together, so the pool gets that share minus the weights, whatever else (a
        colocated trainer) holds memory at the time; `kv_cache_tokens` wins over it.
        `max_prefill_tokens`: padded tokens one prefill step may take (default 16384 CUDA, 2048 CPU).
        `load_format`: None loads the weights; "dummy" (SGLang's name) initialises them randomly from the
        config on the device, for benchmarks of models that would take minutes to save and load.
        `fp32_lm_head`: logits from the final norm's output and the LM head's weight in fp32.
        `lora`: serve up to `max_loras` LoRA adapters of this shape (max rank, target modules); decode then
        runs eagerly (no CUDA graphs), the adapter deltas being per-row inputs the graphs do not take.
        `json_any_whitespace`: json_schema grammars allow any whitespace between JSON tokens (SGLang's
        default); False allows the compact and `json.dumps` separators only.
        `prefill_wait_steps`: EngineOptions.prefill_wait_steps.
        `prefix_cache`: keep finished requests' K/V for requests that start with the same tokens
        (engine/prefix_cache.py; EngineOptions.disable_radix_cache turns it off).
        `profile_dir`: where step profiles go (engine/profiling.py); None = profiling off."""
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.dtype = dtype or default_dtype(self.device)
        self.max_batch_size = max_batch_size
        self.tokenizer = load_tokenizer(self.model_path)
        self.model = load_model(self.model_path, self.device, self.dtype, load_format)
        self.config = self.model.config
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.context_length = int(context_length or getattr(self.config, "max_position_embeddings", 4096))
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self.grammar = GrammarBackend(
            self.tokenizer, self.vocab_size, self.eos_token_ids, any_whitespace=json_any_whitespace
        )
        """Compiles requests' regex / json_schema / ebnf and masks their logits (xgrammar)."""
        self._weights = WeightsBackup(self.model)
        check_supported(self.config)
        lay_out_weights(self.model)  # before the KV pool sizes itself from the free memory
        self.cache = self._build_cache(kv_cache_tokens, block_size, mem_fraction, mem_fraction_static)
        self.fwd = PagedForward(self.model, self.cache, self.context_length, fp32_lm_head=fp32_lm_head)
        self.prefix = PrefixCache(self.cache) if prefix_cache else None
        """Finished requests' K/V by their tokens, for the next turn of an episode (None: off)."""
        # Live views of the parameters keyed by HF name (tied weights appear under both names), taken
        # after the forward fused the projections, so a weight update is an in-place copy_ into the fused
        # tensors and never re-allocates what the forward pass (and the captured CUDA graphs) use.
        self._named_tensors = self.model.state_dict()
        self._staging: torch.Tensor | None = None
        """The staging arena of staged weight updates (bus.stage_weights), allocated at the first one."""
        self._copy = MultiCopy()
        """Weight updates' copies in one kernel, its plan kept for the same tensors (engine/multi_copy.py)."""
        if lora is not None:
            self.fwd.lora = LoraBank(lora, self.config, max_loras, self.device, self.dtype)
        self.max_prefill_tokens = max_prefill_tokens or (16384 if self.device.type == "cuda" else 2048)
        max_blocks = blocks_for(self.context_length + 1, block_size)
        self.gpu_lock = threading.Lock()
        """Held by a CUDA graph capture and by the CUDA work of every weight-bus operation (see
        DecodeGraphs), so the two never overlap. Never held while waiting for a step boundary."""
        self.graphs = (
            DecodeGraphs(self.fwd, max_batch_size, max_blocks, capture_lock=self.gpu_lock)
            if cuda_graphs and self.device.type == "cuda" and lora is None
            else None
        )
        self.stats = RunnerStats()
        log.info(
            "engine runner: %s on %s/%s, KV pool %d tokens (%.2f GiB, block %d), max batch %d, cuda graphs %s",
            self.model_path,
            self.device,
            str(self.dtype).removeprefix("torch."),
            self.cache.capacity_blocks * block_size,
            self.cache.bytes / 2**30,
            block_size,
            max_batch_size,
            self.graphs is not None,
        )

        # _cv guards everything below; the generation thread waits on it for work, for resume, and for
        # weight updates to finish; updaters wait on it for the step in flight to end.
        self._cv = threading.Condition()
        self._queue: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._weight_version = str(weight_version)
        self._paused = False
        self._pause_mode: str | None = None
        self._in_step = False
        self._updating = False
        self._stopping = False
        self._last_was_prefill = False
        self.prefill_wait_steps = prefill_wait_steps
        self._decodes_since_prefill = 0
        """Decode steps since the last prefill: a deferred prefill runs once this reaches prefill_wait_steps."""
        self._released: set[str] = set()
        """Memory tags released (release_memory): no step runs while any is."""
        self._update_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.fatal: str | None = None
        """Set once a fatal CUDA error hit the engine (the cause); the runner then takes no more work."""
        self.on_fatal: list[Callable[[str], None]] = []
        """Called once (from the thread that hit the error) when the engine turns unhealthy."""
        self._fault, self._step_delay_s = os.environ.get(FAULT_ENV) or None, step_delay_s()  # testing hooks
        self.profiler = StepProfiler(profile_dir, self.device)
        self._lora_sources: dict[str, str] = {}

    def _build_cache(
        self, tokens: int | None, block_size: int, mem_fraction: float, mem_fraction_static: float | None
    ) -> PagedKVCache:
        cfg = self.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_token = PagedKVCache.bytes_per_token(
            cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, self.dtype
        )
        useful = self.max_batch_size * (self.context_length + 1)
        if tokens is None:
            if self.device.type == "cuda" and mem_fraction_static is not None:
                _, total = torch.cuda.mem_get_info(self.device)
                budget = static_kv_budget(total, mem_fraction_static, self.weights_bytes())
                if budget < per_token * (self.context_length + 1):
                    raise ValueError(
                        f"mem_fraction_static {mem_fraction_static}: {mem_fraction_static} of the GPU's "
                        f"{total / 2**30:.2f} GiB minus the weights' {self.weights_bytes() / 2**30:.2f} GiB "
                        f"leaves {max(budget, 0) / 2**30:.3f} GiB for the KV pool, less than one "
                        f"{self.context_length + 1}-token sequence needs ({per_token * (self.context_length + 1) / 2**30:.3f} GiB)"
                    )
            elif self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * mem_fraction)
            else:
                if mem_fraction_static is not None:
                    log.warning("mem_fraction_static applies to CUDA devices; the CPU pool is 2 GiB worth")
                budget = 2 * 2**30
            tokens = min(useful, max(budget // per_token, self.context_length + 1))
        num_blocks = blocks_for(tokens, block_size) + 1  # + the scratch block
        return PagedKVCache(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=self.dtype,
            device=self.device,
        )

    def weights_bytes(self) -> int:
        """Bytes of the model's parameters and buffers (tied weights once)."""
        seen: set[int] = set()
        total = 0
        for t in itertools.chain(self.model.parameters(), self.model.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total

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
            if self.fatal is not None:
                req.done = True
                req.future.set_exception(EngineUnhealthy(self.fatal))
            elif self._stopping:
                self._finish(req, abort_reason("Engine is shutting down"))
            elif req.lora_name is not None and (
                self.fwd.lora is None or req.lora_name not in self.fwd.lora.names
            ):
                self._finish(req, abort_reason(f"LoRA adapter {req.lora_name} is not loaded"))
            else:
                self._enqueue(req)
                self._cv.notify_all()
        return req.future

    def _enqueue(self, req: Request) -> None:
        """Queue `req` behind every queued request of its priority or higher (caller holds _cv). Requests
        of one priority (the usual case) append in O(1); a lower-priority one waits for all others."""
        q = self._queue
        if not q or q[-1].priority >= req.priority:
            q.append(req)
            return
        i = len(q)
        while i > 0 and q[i - 1].priority < req.priority:
            i -= 1
        q.insert(i, req)

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
        """Stop starting steps (SGLang's pause_generation modes):
        "abort": abort everything queued or in flight; returns once all of them have returned.
        "retract": running requests go back to the queue and free their KV; after `resume()` they are
        re-prefilled from their tokens so far (under the weights of that moment) and go on.
        "in_place": running requests keep their KV cache and go on after `resume()`."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode {mode!r} is not one of abort, retract, in_place")
        with self._cv:
            self._paused = True
            self._pause_mode = mode
            self._cv.notify_all()
            if mode == "abort":
                self._abort_matching(lambda r: True, "Abort by pause_generation")
                self._cv.notify_all()
                while self._running:
                    self._cv.wait()
            elif mode == "retract":
                while self._in_step:
                    self._cv.wait()
                for r in reversed(list(self._running)):
                    self._retract(r)
                log.info("pause(retract): %d requests back in the queue", len(self._queue))
            # Every mode returns only once the step in flight (a forward pass, a graph capture) has
            # ended: a caller that pauses for a weight update then has the device to itself.
            while self._in_step:
                self._cv.wait()

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._pause_mode = None
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    # ---- introspection ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Scheduler state for /server_info internal_states and the gauges of /metrics."""
        with self._cv:
            running = len(self._running)
            used_blocks = self.cache.capacity_blocks - self.cache.free_blocks - self._evictable()
            return {
                "num_running_reqs": running,
                "num_queue_reqs": len(self._queue),
                "num_paused_reqs": running if self._paused else 0,
                "paused": self._paused,
                "pause_mode": self._pause_mode,
                "memory_released": self.released,
                "weight_version": self._weight_version,
                "last_gen_throughput": self.stats.gen_throughput,
                "generation_tokens_total": self.stats.generation_tokens_total,
                "num_requests_total": self.stats.num_requests_total,
                "num_retractions_total": self.stats.num_retractions_total,
                "max_total_num_tokens": self.max_total_num_tokens,
                "num_used_tokens": used_blocks * self.cache.block_size,
                "token_usage": used_blocks / self.cache.capacity_blocks,
                "prefix_cached_tokens": (self.prefix.cached_blocks if self.prefix else 0)
                * self.cache.block_size,
            }

    @property
    def max_total_num_tokens(self) -> int:
        """Tokens the KV pool holds (SGLang's max_total_num_tokens)."""
        return self.cache.capacity_blocks * self.cache.block_size

    def start_profile(self, **kw) -> None:
        """Profile the next steps (engine/profiling.py StepProfiler.start's arguments; ProfileError)."""
        self.profiler.start(**kw)
        with self._cv:
            self._cv.notify_all()  # an idle generation thread begins it now

    def stop_profile(self) -> bool:
        """End the running profile at the next step boundary; False when none runs."""
        stopping = self.profiler.stop()
        with self._cv:
            self._cv.notify_all()
        return stopping

    # ---- generation thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while True:
                        self._reap_aborted()
                        if self._stopping:
                            self._abort_matching(lambda r: True, "Engine is shutting down")
                            self._reap_aborted()
                            self.profiler.finish()
                            return
                        can_step = not (self._paused or self._updating or self._released)
                        if (can_step and (self._running or self._queue)) or self.profiler.pending:
                            break
                        self.stats.gen_throughput = 0.0
                        self._cv.wait()
                    admitted = self._admit() if can_step else []  # (woken for the profiler alone)
                    self._in_step = True
                    version = self._weight_version
                fatal = False
                try:
                    self.profiler.at_boundary()
                    if self._fault is not None and (admitted or can_step):
                        self._inject_fault()
                    if admitted:
                        with self.profiler.step("prefill"):
                            self._prefill(admitted, version)
                    elif self._running and can_step:
                        with self.profiler.step("decode"):
                            self._decode(version)
                except Exception as exc:
                    fatal = is_fatal_cuda_error(exc)
                    if not fatal:
                        log.exception(
                            "generation step failed; failing %d running requests", len(self._running)
                        )
                        with self._cv:
                            for r in list(self._running):
                                self._drop(r)
                                if not r.done:
                                    r.done = True
                                    r.future.set_exception(exc)
                    else:
                        self.poison(exc)
                finally:
                    with self._cv:
                        self._in_step = False
                        self._cv.notify_all()
                if fatal:
                    return
                if self._step_delay_s:
                    time.sleep(self._step_delay_s)  # STEP_DELAY_ENV's testing hook

    def poison(self, exc: BaseException) -> bool:
        """If `exc` is a fatal CUDA error (is_fatal_cuda_error), turn the engine unhealthy: log the cause
        once, fail every request running or queued with EngineUnhealthy (their calls answer with the
        cause), refuse new ones, end the generation thread and call the `on_fatal` callbacks (the
        server then reports unhealthy and exits). Returns whether it was fatal; safe from any thread."""
        if not is_fatal_cuda_error(exc):
            return False
        cause = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        with self._cv:
            first = self.fatal is None
            if first:
                self.fatal = cause
                self._stopping = True
                failed = [*self._running, *self._queue]
                self._queue.clear()
                for r in failed:
                    self._drop(r)
                    if not r.done:
                        r.done = True
                        r.future.set_exception(EngineUnhealthy(cause))
                        if r.listener:
                            r.listener()
            self._cv.notify_all()
        if first:
            log.critical(
                "engine unhealthy: fatal CUDA error, the GPU context cannot be trusted (%s); failed %d "
                "requests, taking no more work",
                cause,
                len(failed),
                exc_info=exc,
            )
            for callback in self.on_fatal:
                try:
                    callback(cause)
                except Exception:
                    log.exception("on_fatal callback failed")
        return True

    def _inject_fault(self) -> None:
        """FAULT_ENV's testing hook (see there)."""
        if not self._fault.startswith("@"):
            fault, self._fault = self._fault, None
            raise RuntimeError(fault)
        path = self._fault[1:]
        taken = f"{path}.taken-{os.getpid()}"
        try:
            os.rename(path, taken)  # atomic: one engine takes it
        except FileNotFoundError:
            return
        self._fault = None
        with open(taken) as f:
            raise RuntimeError(f.read().strip())

    def _reap_aborted(self) -> None:
        """Finish running requests that were asked to abort (caller holds _cv, no step in flight)."""
        for r in [r for r in self._running if r.abort_message is not None]:
            self._finish(r, abort_reason(r.abort_message))

    # ---- finishing (callers hold _cv or are the generation thread) -------------------------------

    def _abort_matching(self, pred: Callable[[Request], bool], message: str) -> int:
        n = 0
        kept: collections.deque[Request] = collections.deque()
        for r in self._queue:
            if pred(r):
                # a retracted request keeps what it generated; one that never ran gets SGLang's message
                self._finish(r, abort_reason(message if r.output_ids else ABORT_QUEUED))
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
            num_retractions=r.num_retractions,
            cached_tokens=r.cached_tokens,
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
            self._drop(r)
            self.stats.num_requests_total += 1
            if reason["type"] == "abort":
                self.stats.num_aborted_requests_total += 1
        r.future.set_result(completion)
        if r.listener:
            r.listener()


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


def static_kv_budget(total: int, fraction: float, weights: int) -> int:
    """Bytes for the KV pool under SGLang's mem_fraction_static: `fraction` of the device's `total`
    memory holds the weights and the pool."""
    return int(total * fraction) - weights
