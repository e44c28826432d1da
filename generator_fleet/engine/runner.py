# Long module: Runner is one scheduler state machine (queue, rows, KV blocks, pause, weight swaps,
# memory release).
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
from transformers import AutoConfig, AutoModelForCausalLM

from generator_fleet.engine.arena import lay_out_weights
from generator_fleet.engine.faults import FAULT_ENV, EngineUnhealthy, is_fatal_cuda_error
from generator_fleet.engine.grammar import GrammarBackend
from generator_fleet.engine.kv_cache import OutOfBlocks, PagedKVCache, blocks_for
from generator_fleet.engine.lora import LoraBank, LoraError, read_peft_dir
from generator_fleet.engine.memory import (
    CUDA_GRAPH,
    KV_CACHE,
    TAGS,
    WEIGHTS,
    WeightsBackup,
    WeightsReleased,
    device_used_bytes,
    empty_cache,
)
from generator_fleet.engine.model import DecodeGraphs, DecodeInputs, PagedForward, check_supported
from generator_fleet.engine.multi_copy import MultiCopy
from generator_fleet.engine.request import Completion, Request, RunnerStats, version_spans
from generator_fleet.engine.sampler import Choice, sample
from models.config import LoraSpec
from models.tokenizers import load_tokenizer
from weight_bus.schema import WeightLayout

log = logging.getLogger(__name__)

ABORT_QUEUED = "Abort before prefill"
"""SGLang's message for a request aborted before it ran; AReaL keys on this prefix (empty output)."""


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class Runner:
    """Owns the model, the KV cache, the request queue and the generation thread."""

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
        default); False allows the compact and `json.dumps` separators only."""
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.dtype = dtype or default_dtype(self.device)
        self.max_batch_size = max_batch_size
        self.tokenizer = load_tokenizer(self.model_path)
        if load_format == "dummy":
            with torch.device(self.device):
                config = AutoConfig.from_pretrained(self.model_path)
                self.model = AutoModelForCausalLM.from_config(config, dtype=self.dtype).eval()
        elif load_format in (None, "auto"):
            self.model = (
                AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype).to(self.device).eval()
            )
        else:
            raise ValueError(f"load_format {load_format!r}: expected auto or dummy")
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
        self._released: set[str] = set()
        """Memory tags released (release_memory): no step runs while any is."""
        self._update_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.fatal: str | None = None
        """Set once a fatal CUDA error hit the engine (the cause); the runner then takes no more work."""
        self.on_fatal: list[Callable[[str], None]] = []
        """Called once (from the thread that hit the error) when the engine turns unhealthy."""
        self._fault = os.environ.get(FAULT_ENV) or None
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
                self._finish(req, _abort_reason("Engine is shutting down"))
            elif req.lora_name is not None and (
                self.fwd.lora is None or req.lora_name not in self.fwd.lora.names
            ):
                self._finish(req, _abort_reason(f"LoRA adapter {req.lora_name} is not loaded"))
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
        self,
        named_tensors: list[tuple[str, torch.Tensor]],
        weight_version: str | None = None,
        checked: bool = False,
    ) -> None:
        """Copy tensors into the parameters of the same HF name at a step boundary; all names and shapes
        are checked first, so a bad request changes nothing (`checked`: these very tensors were checked
        by an earlier call). The copies go as one kernel (engine/multi_copy.py; a multi-tensor copy where a
        cast is needed, and off CUDA); a kept payload's list (`named_tensors` itself) reuses its plan.
        WeightsReleased while the weights are released (release_memory): SGLang's weights are not there
        to load into either."""
        self._check_weights_present()
        if not checked:
            self.check_named(named_tensors)

        def apply() -> None:
            self._check_weights_present()  # a release may have come between the checks and this step
            self.copy_weights(named_tensors, weight_version)

        self.at_step_boundary(apply)

    def check_named(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """ValueError unless every name is one of the engine's weights, with its shape."""
        unknown = [n for n, _ in named_tensors if n not in self._named_tensors]
        if unknown:
            raise ValueError(f"unknown parameter names: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        for name, t in named_tensors:
            if tuple(t.shape) != tuple(self._named_tensors[name].shape):
                raise ValueError(
                    f"shape mismatch for {name}: got {list(t.shape)}, expected "
                    f"{list(self._named_tensors[name].shape)}"
                )

    def copy_weights(
        self, named_tensors: list[tuple[str, torch.Tensor]], weight_version: str | None = None
    ) -> None:
        """The copy of a weight load, queued now on the current stream: the caller holds the step boundary
        (`at_step_boundary`) and checked the names (`check_named`)."""
        with torch.no_grad():
            self._copy.copy(named_tensors, self._destinations)
        if weight_version is not None:
            self._weight_version = str(weight_version)

    # ---- the weight arena (engine/arena.py) ---------------------------------------------------------

    def weight_layout(self) -> WeightLayout | None:
        """Where every weight lives in the engine's arena; None without one (or while weights are released)."""
        arena = self.fwd.arena
        return arena.layout if arena is not None and not self._released else None

    def arena_range(self, offset: int, nbytes: int, staged: bool = False) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) of the serving arena, or of the staging arena (`staged`), as
        the uint8 tensor a broadcast is received into."""
        self._check_weights_present()
        arena = self.fwd.arena
        if arena is None:
            raise ValueError("this engine's weights are not in one arena: send named buckets")
        if staged:
            if self._staging is None:
                raise RuntimeError("no staging arena (staged_arena() first)")
            arena.range(offset, nbytes)  # bounds
            return self._staging[offset : offset + nbytes]
        return arena.range(offset, nbytes)

    def staged_arena(self) -> bool:
        """Allocate the staging arena (a second copy of the weights' bytes, kept for later updates) if
        there is none; False when the device has no room for it (the update then goes in place)."""
        arena = self.fwd.arena
        if arena is None:
            return False
        if self._staging is not None and self._staging.numel() == arena.buffer.numel():
            return True
        self._staging = None
        try:
            self._staging = torch.empty_like(arena.buffer)
        except torch.OutOfMemoryError:
            log.warning(
                "no room for a staging arena (%.2f GiB): weight updates are received in place",
                arena.buffer.numel() / 2**30,
            )
            return False
        log.info("staging arena allocated: %.2f GiB beside the serving weights", arena.buffer.numel() / 2**30)
        return True

    def swap_staged(self, weight_version: str | None) -> None:
        """Copy the staging arena over the serving one and set the version (the caller holds the step
        boundary); the copy is done when this returns."""
        self._check_weights_present()
        self.fwd.arena.buffer.copy_(self._staging)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        if weight_version is not None:
            self._weight_version = str(weight_version)

    def _destinations(self, names: list[str]) -> list[torch.Tensor]:
        """The parameters of these HF names (the destinations of a weight load)."""
        return [self._named_tensors[n] for n in names]

    # ---- LoRA adapters -----------------------------------------------------------------------------

    @property
    def lora(self) -> LoraBank | None:
        """The adapter bank (None when the engine was started without `lora`)."""
        return self.fwd.lora

    def lora_adapters(self) -> dict[str, str]:
        """Loaded adapters: name → where it came from (a PEFT directory, or "__tensor__")."""
        return dict(self._lora_sources)

    def check_lora(self, name: str | None) -> None:
        """LoraError unless `name` (a request's lora_path) is None or a loaded adapter."""
        if name is None:
            return
        if self.fwd.lora is None:
            raise LoraError("LoRA is not enabled on this engine (start it with lora)")
        self.fwd.lora.slot_of(name)

    def load_lora(
        self,
        name: str,
        config: dict,
        named_tensors: list[tuple[str, torch.Tensor]] | dict[str, torch.Tensor],
        source: str = "__tensor__",
        weight_version: str | None = None,
    ) -> int:
        """Load adapter `name`, or replace it in place, at a step boundary: requests using it see the old
        adapter up to one step and the new one from the next (their tokens carry the new weight_version).
        The adapter is validated before anything is copied. Returns its slot."""
        if self.fwd.lora is None:
            raise LoraError("LoRA is not enabled on this engine (start it with lora)")
        tensors = dict(named_tensors)

        def apply() -> int:
            slot = self.fwd.lora.load(name, config, tensors)
            self._lora_sources[name] = source
            if weight_version is not None:
                self._weight_version = str(weight_version)
            return slot

        return self.at_step_boundary(apply)

    def load_lora_from_dir(self, name: str, path: str, weight_version: str | None = None) -> int:
        """Load a PEFT adapter directory (adapter_config.json + adapter_model.safetensors or .bin)."""
        config, tensors = read_peft_dir(path, self.device, self.dtype)
        return self.load_lora(name, config, tensors, source=path, weight_version=weight_version)

    def unload_lora(self, name: str) -> int:
        """Unload adapter `name` at a step boundary; its queued and running requests are aborted.
        Returns how many were."""
        if self.fwd.lora is None:
            raise LoraError("LoRA is not enabled on this engine (start it with lora)")
        self.fwd.lora.slot_of(name)

        def apply() -> int:
            with self._cv:
                n = self._abort_matching(lambda r: r.lora_name == name, f"LoRA adapter {name} was unloaded")
                self._reap_aborted()
            self.fwd.lora.unload(name)
            self._lora_sources.pop(name, None)
            return n

        return self.at_step_boundary(apply)

    def _lora_slots(self, rows: list[Request]) -> list[int] | None:
        if self.fwd.lora is None:
            return None
        return [self.fwd.lora.names.get(r.lora_name, -1) if r.lora_name else -1 for r in rows]

    def _check_weights_present(self) -> None:
        if WEIGHTS in self._released:
            raise WeightsReleased(
                "the engine's weights are released (release_memory_occupation); resume_memory_occupation "
                'with tags ["weights"] before updating them'
            )

    def load_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        self._check_weights_present()  # before reading a checkpoint it could not load
        fresh = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        self.load_weights(list(fresh.state_dict().items()), weight_version)

    # ---- memory occupation -----------------------------------------------------------------------

    @property
    def released(self) -> list[str]:
        """Memory tags released now, in memory.TAGS order (kv_cache, weights, cuda_graph)."""
        with self._cv:  # an RLock: callers may hold it already
            return [t for t in TAGS if t in self._released]

    def release_memory(self, tags: list[str]) -> dict[str, int]:
        """Release the device memory of `tags` (memory.resolve_tags' names; SGLang's
        release_memory_occupation). Generation stops at the next step boundary and stays stopped until
        every tag is resumed: running requests are retracted (their KV freed; they are re-prefilled
        after the resume and go on), queued and new ones wait. Dropping the KV pool or the weights also
        drops the captured graphs (they hold those addresses). Tags already released are skipped.
        Returns the bytes freed per tag this call released."""
        with self._update_lock:
            with self._cv:
                new = [t for t in tags if t not in self._released]
                if not new:
                    log.info("release_memory %s: already released, nothing to do", tags)
                    return {}
                self._released.update(new)  # from here no step starts
                self._cv.notify_all()
                while self._in_step:
                    self._cv.wait()
                running = len(self._running)
                for r in reversed(list(self._running)):
                    self._retract(r)
            t0 = time.monotonic()
            freed = dict.fromkeys(new, 0)
            with self.gpu_lock:  # a graph capture never overlaps (DecodeGraphs' discipline)
                if self.graphs is not None:
                    before = device_used_bytes(self.device)
                    self.graphs.drop()
                    empty_cache(self.device)
                    if CUDA_GRAPH in new:
                        freed[CUDA_GRAPH] = max(before - device_used_bytes(self.device), 0)
                if KV_CACHE in new:
                    freed[KV_CACHE] = self.cache.free_pool()
                if WEIGHTS in new:
                    self._named_tensors = {}  # its views would keep the device copies alive
                    self._staging = None
                    self._copy.clear()
                    self.fwd.unfuse_weights()  # and so would the fused projections
                    freed[WEIGHTS] = self._weights.offload()
                empty_cache(self.device)
            log.info(
                "released memory %s in %.3f s: %s (%d running requests retracted; released now: %s)",
                new,
                time.monotonic() - t0,
                ", ".join(f"{t} {b / 2**20:.1f} MiB" for t, b in freed.items()),
                running,
                self.released,
            )
            return freed

    def resume_memory(self, tags: list[str]) -> list[str]:
        """Take back the memory of `tags` (SGLang's resume_memory_occupation): the KV pool at its size,
        the weights exactly as they were, graphs captured again on use. Generation goes on once nothing
        is released any more. Tags not released are skipped. Returns the tags resumed."""
        with self._update_lock:
            with self._cv:
                todo = [t for t in tags if t in self._released]
            if not todo:
                log.info("resume_memory %s: not released, nothing to do", tags)
                return []
            t0 = time.monotonic()
            with self.gpu_lock:
                if WEIGHTS in todo:
                    self._weights.restore()
                    self.fwd.fuse_weights()
                    self._named_tensors = self.model.state_dict()
                    self._copy.clear()
                if KV_CACHE in todo:
                    self.cache.allocate_pool()
            with self._cv:
                self._released.difference_update(todo)
                self._cv.notify_all()
                left = self.released
            log.info(
                "resumed memory %s in %.3f s (released now: %s%s)",
                todo,
                time.monotonic() - t0,
                left or "none",
                "" if left else "; generation goes on",
            )
            return todo

    # ---- introspection ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Scheduler state for /server_info internal_states and the gauges of /metrics."""
        with self._cv:
            running = len(self._running)
            used_blocks = self.cache.capacity_blocks - self.cache.free_blocks
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
            }

    @property
    def max_total_num_tokens(self) -> int:
        """Tokens the KV pool holds (SGLang's max_total_num_tokens)."""
        return self.cache.capacity_blocks * self.cache.block_size

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
                            return
                        if not (self._paused or self._updating or self._released) and (
                            self._running or self._queue
                        ):
                            break
                        self.stats.gen_throughput = 0.0
                        self._cv.wait()
                    admitted = self._admit()
                    self._in_step = True
                    version = self._weight_version
                fatal = False
                try:
                    if self._fault is not None:
                        self._inject_fault()
                    if admitted:
                        self._prefill(admitted, version)
                    elif self._running:
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
            self._finish(r, _abort_reason(r.abort_message))

    def _admit(self) -> list[Request]:
        """Move queued requests into the running set for one prefill step (caller holds _cv): in queue order
        (priority, then FIFO), while
        the batch has room, the padded prefill fits the token budget and the pool has blocks for the
        prompt plus the first decoded token. Prefill and decode steps alternate while both have work."""
        if not self._queue or (self._last_was_prefill and self._running):
            self._last_was_prefill = False
            return []
        admitted: list[Request] = []
        width = 0
        while self._queue and len(self._running) < self.max_batch_size:
            r = self._queue[0]
            n = len(_fill_tokens(r))
            w = max(width, n)
            if admitted and w * (len(admitted) + 1) > self.max_prefill_tokens:
                break
            need = blocks_for(n + 1, self.cache.block_size)
            if need > self.cache.capacity_blocks:
                self._queue.popleft()
                self._finish(
                    r,
                    _abort_reason(
                        f"request needs {n + 1} KV slots; the engine's pool holds {self.max_total_num_tokens}"
                    ),
                )
                continue
            if need > self.cache.free_blocks:
                break  # waits for running requests to free blocks
            self._queue.popleft()
            r.blocks = self.cache.allocate(need)
            self._running.append(r)
            admitted.append(r)
            width = w
        self._last_was_prefill = bool(admitted)
        return admitted

    def _prefill(self, rows: list[Request], version: str) -> None:
        fills = [_fill_tokens(r) for r in rows]
        slots = [s for r, f in zip(rows, fills, strict=True) for s in self.cache.slots(r.blocks, 0, len(f))]
        hidden = self.fwd.prefill(
            fills, torch.tensor(slots, dtype=torch.long, device=self.device), self._lora_slots(rows)
        )
        ends = list(itertools.accumulate(len(f) for f in fills))
        for r, f in zip(rows, fills, strict=True):
            r.kv_len = len(f)
        self.stats.prompt_tokens_total += len(slots)
        fresh = [i for i, r in enumerate(rows) if not r.output_ids]
        if any(rows[i].return_logprob and rows[i].logprob_start_len >= 0 for i in fresh):
            self._input_logprobs(rows, fills, hidden, ends)
        for i in fresh:
            if rows[i].params.max_new_tokens == 0:  # prefill only
                self._finish(rows[i], {"type": "length", "length": 0})
        to_sample = [i for i in fresh if not rows[i].done]
        if to_sample:
            last = torch.tensor([ends[i] - 1 for i in to_sample], device=self.device)
            logits = self.fwd.logits(hidden[last]).float()
            picked = [rows[i] for i in to_sample]
            self.grammar.mask([r.constraint for r in picked], logits)
            self._record(picked, sample(picked, logits, self.eos_token_ids), version)

    def _input_logprobs(
        self, rows: list[Request], fills: list[list[int]], hidden: torch.Tensor, ends: list[int]
    ) -> None:
        for r, f, end in zip(rows, fills, ends, strict=True):
            if r.output_ids or not (r.return_logprob and r.logprob_start_len >= 0):
                continue
            n = len(f)
            lp = torch.log_softmax(self.fwd.logits(hidden[end - n : end - 1]).float(), dim=-1)
            nxt = torch.tensor(f[1:], dtype=torch.long, device=self.device)
            got = lp.gather(1, nxt[:, None]).squeeze(1).tolist()
            full: list[float | None] = [None, *got]
            r.input_logprobs = full[min(r.logprob_start_len, n) :]

    def _decode(self, version: str) -> None:
        t0 = time.monotonic()
        rows = self._grow_blocks()
        if not rows:
            return
        ids = [r.output_ids[-1] for r in rows]
        positions = [r.kv_len for r in rows]
        slots = [self.cache.slot(r.blocks, r.kv_len) for r in rows]
        choice = None
        ran = None
        if self.graphs is not None:
            in_graph = all(_graph_sampleable(r, self.vocab_size) for r in rows)
            temps = [0.0 if r.params.greedy else r.params.temperature for r in rows] if in_graph else None
            ran = self.graphs.run(ids, positions, slots, [r.blocks for r in rows], temps)
            if ran is None:
                self.stats.graph_captures_deferred_total += 1
        if ran is not None:
            logits, picked = ran
            if picked is not None:
                choice = Choice(picked[0], picked[1], [None] * len(rows))
        else:  # no graphs, or this bucket's capture has to wait for a weight operation
            width = max(len(r.blocks) for r in rows)
            scratch = self.cache.scratch_block
            dev = self.device
            x = DecodeInputs(
                input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
                positions=torch.tensor(positions, dtype=torch.long, device=dev),
                slots=torch.tensor(slots, dtype=torch.long, device=dev),
                block_tables=torch.tensor(
                    [r.blocks + [scratch] * (width - len(r.blocks)) for r in rows],
                    dtype=torch.long,
                    device=dev,
                ),
                seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.long, device=dev),
            )
            logits = self.fwd.decode(x, self._lora_slots(rows))
        for r in rows:
            r.kv_len += 1
        self.stats.num_decode_steps_total += 1
        constrained = self.grammar.mask([r.constraint for r in rows], logits)
        if constrained and choice is not None:
            # The graph sampled every row from the raw logits: rows with a grammar are sampled again
            # from their masked logits, the others keep the graph's choice.
            sub = sample([rows[i] for i in constrained], logits[constrained], self.eos_token_ids)
            for j, i in enumerate(constrained):
                choice.tokens[i] = sub.tokens[j]
                choice.logprobs[i] = sub.logprobs[j]
        self._record(rows, choice or sample(rows, logits, self.eos_token_ids), version)
        self.stats.gen_throughput = len(rows) / max(time.monotonic() - t0, 1e-9)

    def _grow_blocks(self) -> list[Request]:
        """Give every running request room for one more token, retracting the newest ones while the
        pool is short. Returns the requests that decode this step."""
        bs = self.cache.block_size
        with self._cv:
            retracted: set[int] = set()
            for r in list(self._running):
                if id(r) in retracted:
                    continue  # retracted below to make room for an older request
                while len(r.blocks) < blocks_for(r.kv_len + 1, bs):
                    try:
                        r.blocks.extend(self.cache.allocate(1))
                    except OutOfBlocks:
                        victim = self._running[-1]
                        self._retract(victim)
                        retracted.add(id(victim))
                        if victim is r:
                            break
            return list(self._running)

    def _retract(self, r: Request) -> None:
        """Free `r`'s KV and put it back at the head of the queue (caller holds _cv, no step in flight)."""
        self._drop(r)
        self._queue.appendleft(r)
        r.num_retractions += 1
        self.stats.num_retractions_total += 1
        log.info("retracted %s (%d tokens so far) to free KV blocks", r.rid, len(r.output_ids))

    def _drop(self, r: Request) -> None:
        if r in self._running:
            self._running.remove(r)
        self.cache.release(r.blocks)
        r.kv_len = 0

    def _record(self, rows: list[Request], choice: Choice, version: str) -> None:
        """Record each row's chosen token with its logprob and version, finish rows that are done."""
        now = time.monotonic()
        for i, r in enumerate(rows):
            if r.first_token_at is None:
                r.first_token_at = now
            r.output_logprobs.append(choice.logprobs[i])
            r.versions.append(version)
            if r.top_logprobs_num > 0:
                r.output_top_logprobs.append(choice.top[i] or [])
            r.output_ids.append(choice.tokens[i])  # last: a concurrent progress() reads len(output_ids) first
            self.stats.generation_tokens_total += 1
            if r.constraint is not None and not r.constraint.accept(choice.tokens[i]):
                # The mask lets only allowed tokens through: this is a grammar that no token of the
                # vocabulary can continue (`stuck`), or a safety net.
                kind = r.constraint.kind
                why = (
                    f"no token of the model's vocabulary can continue the {kind}"
                    if r.constraint.stuck
                    else f"token {choice.tokens[i]} is not allowed by the {kind}"
                )
                log.warning("%s: aborted after %d tokens: %s", r.rid, len(r.output_ids) - 1, why)
                r.output_ids.pop()  # the refused token is not part of the output
                r.output_logprobs.pop()
                r.versions.pop()
                if r.top_logprobs_num > 0:
                    r.output_top_logprobs.pop()
                self.stats.generation_tokens_total -= 1
                self._finish(r, _abort_reason(why))
                continue
            reason = self._check_finished(r)
            if reason is not None:
                self._finish(r, reason)
            elif r.listener:
                r.listener()

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
        if r.stop_regex:
            # SGLang: search the tail that can hold a match; `matched` is the pattern and the text keeps it.
            tail = self.tokenizer.decode(r.output_ids[-(r.stop_regex_max_len + 1) :])
            for pattern, compiled in r.stop_regex:
                if compiled.search(tail):
                    return {"type": "stop", "matched": pattern}
        if r.constraint is not None and r.constraint.terminated:
            return {"type": "stop", "matched": last}  # SGLang: the grammar's stop token ended it
        return None

    # ---- finishing (callers hold _cv or are the generation thread) -------------------------------

    def _abort_matching(self, pred: Callable[[Request], bool], message: str) -> int:
        n = 0
        kept: collections.deque[Request] = collections.deque()
        for r in self._queue:
            if pred(r):
                # a retracted request keeps what it generated; one that never ran gets SGLang's message
                self._finish(r, _abort_reason(message if r.output_ids else ABORT_QUEUED))
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


def _graph_sampleable(r: Request, vocab_size: int) -> bool:
    """Greedy or plain temperature sampling: what the decode graph samples itself."""
    p = r.params
    return (
        p.plain
        and r.generator is None
        and r.top_logprobs_num == 0
        and len(r.output_ids) >= p.min_new_tokens
        and (p.top_k == -1 or p.top_k >= vocab_size)
        and p.top_p >= 1.0
        and p.min_p <= 0.0
    )


def _fill_tokens(r: Request) -> list[int]:
    """Tokens a prefill computes K/V for: the prompt of a new request; for a retracted one, the prompt and
    all its output but the last token (which the next decode step feeds)."""
    return r.prompt_ids + r.output_ids[:-1] if r.output_ids else r.prompt_ids


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


def static_kv_budget(total: int, fraction: float, weights: int) -> int:
    """Bytes for the KV pool under SGLang's mem_fraction_static: `fraction` of the device's `total`
    memory holds the weights and the pool."""
    return int(total * fraction) - weights
