"""The built-in engine's weights, as the Runner holds them: loading by name (checked, one copy kernel, at
a step boundary), the weight arena a streamed update lands in (and its staging copy), LoRA adapters, and
releasing and resuming device memory. A mixin of engine/runner.py's Runner, whose state it uses (the
step-boundary lock and condition, the model, the KV cache, the graphs)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from generator_fleet.engine.lora import LoraBank, LoraError, read_peft_dir
from generator_fleet.engine.memory import (
    CUDA_GRAPH,
    KV_CACHE,
    TAGS,
    WEIGHTS,
    WeightsReleased,
    device_used_bytes,
    empty_cache,
)
from generator_fleet.engine.request import Request
from weight_bus.schema import WeightLayout

log = logging.getLogger(__name__)


class RunnerWeights:
    """The Runner's weight and memory operations (engine/runner.py holds the state they use)."""

    # ---- weights ---------------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self._weight_version

    def set_weight_version(self, version: str) -> None:
        with self._cv:
            self._weight_version = str(version)
            self.weights_changed()

    def weights_changed(self) -> None:
        """K/V computed with the old weights is no use to requests admitted from now on: the prefix cache
        lets it go (engine/prefix_cache.py; blocks running requests hold go when they finish)."""
        if self.prefix is not None:
            with self._cv:
                self.prefix.flush()

    def flush_cache(self) -> bool:
        """SGLang's /flush_cache: empty the prefix cache, only while no request is running or queued
        (False then, nothing done)."""
        with self._cv:
            if self._running or self._queue:
                return False
            if self.prefix is not None:
                log.info("prefix cache flushed (%d blocks)", self.prefix.flush())
            return True

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
        self.weights_changed()

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
        self.weights_changed()

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
            self.weights_changed()
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
            self.weights_changed()  # a later adapter of this name is another one
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
                self.weights_changed()  # the pool (or the weights its K/V came from) goes
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
