"""The trainer's memory plan: what one rank's step holds on its device, planned before the first step.

A rank's device holds two kinds of memory during a step:

    static        the policy's fp32 master weights, gradients and AdamW state (plus a reference model's
                  and a critic's), each FSDP-sharded over the ranks: counted from the parameters
                  (`static_bytes`), 16 bytes per trained parameter and 4 per frozen one, over world size.
    activations   what the forward pass saves for backward, per token of a micro-batch: measured, not
                  guessed, by one forward/backward of a probe micro-batch on the real model at start
                  (`saved_bytes`: every tensor autograd saves, weights excluded), plus the transient of
                  the LM head's chunk and one layer's recomputation.

`plan` turns those into the three settings a user would otherwise tune by trial and out-of-memory:

    offload_optimizer         only when the static state alone would leave too little room (the last
                              resort: the optimizer step moves to the host, 3-10x slower);
    activation_checkpointing  only when the longest sample's activations do not fit without it (each
                              layer then keeps its input and recomputes the rest in backward, ~1/3 more
                              compute);
    micro_batch_tokens        as many tokens as fit in what is left, at most MAX_PLANNED_TOKENS.

A setting the spec gives explicitly is kept (a micro_batch_tokens that cannot fit is lowered, with a
warning); null ones are planned. On CPU nothing is measured: no device capacity to plan against.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainer import metrics
from trainer.logprobs import packed_logprobs
from trainer.packing import TrainSample, pack

log = logging.getLogger(__name__)

GIB = 1 << 30
CPU_MICRO_BATCH_TOKENS = 8192
"""micro_batch_tokens when null on CPU (nothing is planned there)."""
MAX_PLANNED_TOKENS = 32768
"""The most tokens a planned micro-batch holds: beyond it a larger micro-batch gains no speed."""
PROBE_TOKENS = 1024
"""Tokens of the probe micro-batch whose saved activations give the bytes per token."""
HEADROOM = 0.10
"""Share of the device kept free for the allocator's fragmentation, NCCL and the CUDA context."""
OFFLOAD_ABOVE = 0.75
"""The static state may take at most this share of the usable device before the optimizer is offloaded."""
PROMPT_ALLOWANCE = 2048
"""Prompt tokens counted on top of the response budget for the longest sample a micro-batch must hold."""


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's plan (`Learner.memory_plan`), logged at start and shown in `status`."""

    capacity: int
    """Bytes the rank may use on its device (total less HEADROOM); 0 on CPU (not planned)."""
    static: int
    """Bytes of weights, gradients and optimizer state on the device (0 with the optimizer offloaded)."""
    per_token: int
    """Activation bytes per micro-batch token with the planned checkpointing (0 when not measured)."""
    micro_batch_tokens: int
    activation_checkpointing: bool
    offload_optimizer: bool
    longest: int
    """Tokens of the longest sample one micro-batch must hold (response budget + PROMPT_ALLOWANCE)."""

    def describe(self) -> str:
        if not self.capacity:
            return (
                f"micro-batches of {self.micro_batch_tokens} tokens, activation checkpointing "
                f"{_on(self.activation_checkpointing)}, optimizer offload {_on(self.offload_optimizer)} "
                "(not planned: no device capacity on CPU)"
            )
        return (
            f"{self.capacity / GIB:.1f} GiB usable: {self.static / GIB:.1f} GiB weights, gradients and "
            f"optimizer state, {self.per_token / 1024:.0f} KiB of activations per token -> micro-batches "
            f"of {self.micro_batch_tokens} tokens (longest sample {self.longest}), activation checkpointing "
            f"{_on(self.activation_checkpointing)}, optimizer offload {_on(self.offload_optimizer)}"
        )


def _on(flag: bool) -> str:
    return "on" if flag else "off"


class MemoryPlanError(RuntimeError):
    """The job's model and samples cannot fit on the trainer's devices at any setting: raised at start,
    before the first step, so the job fails with the settings to change instead of looping on OOM."""


def static_bytes(model: nn.Module, world: int) -> int:
    """Bytes per rank of fp32 weights (4 each), and for trained parameters their gradient (4) and two
    AdamW moments (8), FSDP-sharded over `world` ranks."""
    total = 0
    for p in model.parameters():
        total += p.numel() * (16 if p.requires_grad else 4)
    return total // max(world, 1)


def should_offload(static: int, capacity: int) -> bool:
    """The last resort, decided before sharding: the static state would take more than OFFLOAD_ABOVE of
    the usable device."""
    return capacity > 0 and static > OFFLOAD_ABOVE * capacity


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(data pointer, bytes) of the storage behind `t`; for an FSDP2 (DTensor) parameter, of its local
    shard (a DTensor is a wrapper with no storage of its own: asking it for one raises)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (a linear layer saves its weight transposed; under FSDP2 that is a
    view of the gathered parameter, whose storage is not the sharded one `saved_bytes` knows)."""
    while t._base is not None:
        t = t._base
    return isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad)


@contextmanager
def saved_bytes(model: nn.Module):
    """Counts the bytes autograd saves for backward inside the block (yields a one-element list holding
    the total once the block ends): each storage once, the model's parameters (and FSDP's gathered
    copies of them, which are Parameters too) not counted."""
    params = {_storage(p)[0] for p in model.parameters() if p.numel()}
    seen: dict[int, int] = {}
    out = [0]

    def pack(t: torch.Tensor):
        if _is_weight(t):
            return t
        ptr, nbytes = _storage(t)
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), nbytes)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield out
    out[0] = sum(seen.values())


def plan(
    *,
    capacity: int,
    static: int,
    per_token: int,
    per_token_checkpointed: int,
    transient: int,
    longest: int,
    micro_batch_tokens: int | None,
    activation_checkpointing: bool | None,
    offload_optimizer: bool,
) -> MemoryPlan:
    """The plan from measured figures (bytes): `per_token` activations without checkpointing and
    `per_token_checkpointed` with it, `transient` the extra one micro-batch needs at its peak whatever its
    size. Raises MemoryPlanError when even the longest sample cannot fit."""
    left = capacity - static - transient
    checkpointing = activation_checkpointing
    if checkpointing is None:  # planned: only when the longest sample does not fit without it
        checkpointing = left < longest * per_token
    cost = per_token_checkpointed if checkpointing else per_token
    fits = max(left // max(cost, 1), 0)
    if fits < longest:
        raise MemoryPlanError(
            f"a micro-batch of the longest sample ({longest} tokens) needs {longest * cost / GIB:.1f} GiB of "
            f"activations but {max(left, 0) / GIB:.1f} GiB are left of {capacity / GIB:.1f} GiB after "
            f"{static / GIB:.1f} GiB of weights, gradients and optimizer state"
            f"{' (checkpointed)' if checkpointing else ''}: add trainer ranks (trainer.num_trainers), "
            + ("" if offload_optimizer else "turn on trainer.offload_optimizer, ")
            + ("" if checkpointing else "turn on trainer.activation_checkpointing, ")
            + "or lower rollout.sampling.max_new_tokens"
        )
    tokens = min(fits, MAX_PLANNED_TOKENS)
    if micro_batch_tokens is not None:
        if micro_batch_tokens > fits:
            log.warning(
                "trainer.micro_batch_tokens %d does not fit (%d tokens do): using %d",
                micro_batch_tokens,
                fits,
                fits,
            )
        tokens = min(micro_batch_tokens, fits)
    return MemoryPlan(
        capacity=capacity,
        static=static,
        per_token=cost,
        micro_batch_tokens=int(tokens),
        activation_checkpointing=bool(checkpointing),
        offload_optimizer=offload_optimizer,
        longest=longest,
    )


def unplanned(micro_batch_tokens: int | None, checkpointing: bool | None, offload: bool | None) -> MemoryPlan:
    """The settings as given (nulls: CPU defaults), for a device with no capacity to plan against."""
    return MemoryPlan(
        capacity=0,
        static=0,
        per_token=0,
        micro_batch_tokens=micro_batch_tokens or CPU_MICRO_BATCH_TOKENS,
        activation_checkpointing=bool(checkpointing),
        offload_optimizer=bool(offload),
        longest=0,
    )


def device_capacity(device: torch.device) -> int:
    """Bytes the trainer may use on `device`: what is free now plus what this process already holds (at
    most the process's memory fraction, when one is set), less HEADROOM of the device; 0 on CPU."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    usable = free + torch.cuda.memory_allocated(device)
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    if fraction < 1.0:  # torch.cuda.set_per_process_memory_fraction caps this process below the device
        total = int(fraction * total)
        usable = min(usable, total)
    return int(usable - HEADROOM * total)


def peak_bytes(device: torch.device, reset: bool = True) -> int:
    """Peak bytes allocated on `device` since the last reset (CUDA), or the process's peak resident set
    (CPU, kilobytes from getrusage on Linux)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return int(peak)
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def probe_sample(tokens: int, vocab: int, seed: int = 0):
    """A synthetic sample of `tokens` tokens, its second half trained (the probe's micro-batch)."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(tokens, dtype=np.float32)
    mask[tokens // 2 : tokens - 1] = 1.0
    return TrainSample(
        input_ids=rng.integers(0, vocab, tokens, dtype=np.int64),
        loss_mask=mask,
        behav_logprobs=np.zeros(tokens, dtype=np.float32),
        advantage=1.0,
        weight=1.0 / max(mask.sum(), 1.0),
        reward=0.0,
    )


def probe_per_token(model: nn.Module, device: torch.device, vocab: int, head: tuple, autocast) -> int:
    """Activation bytes per token autograd saves in one forward/backward of a PROBE_TOKENS micro-batch
    through `model` (a collective under FSDP: every rank probes the same shapes). Gradients are dropped
    afterwards."""
    mb = pack([probe_sample(PROBE_TOKENS, vocab)]).to(device)
    with autocast(), saved_bytes(model) as saved:
        logprobs, _ = packed_logprobs(model, mb, 1.0, "none", *head)
        loss = (logprobs * mb.token_weights).sum()
    loss.backward()
    for p in model.parameters():
        p.grad = None
    return -(-saved[0] // PROBE_TOKENS)


def transient_bytes(config, chunk_tokens: int, bf16: bool) -> int:
    """Bytes one micro-batch needs at its peak whatever its size: the LM head's fp32 logits chunk three
    times (logits, softmax, their gradient), and one decoder layer's gathered bf16/fp32 weights twice
    (forward and the gradient of backward)."""
    vocab, hidden = config.vocab_size, config.hidden_size
    chunk = chunk_tokens or 8192
    layer_params = 12 * hidden * hidden  # q, k, v, o and a gated MLP of about 4x hidden each way
    return 3 * chunk * vocab * 4 + 2 * layer_params * (2 if bf16 else 4)


def set_checkpointing(model: nn.Module, on: bool) -> None:
    """Activation checkpointing of every decoder layer on or off (HF's; a critic's backbone)."""
    target = getattr(model, "backbone", model)
    kwargs = {"use_reentrant": False}
    if hasattr(target, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        if on:
            target.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            target.activation_checkpointing_disable()
    elif on:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        target.gradient_checkpointing_disable()


def decide_offload(spec_offload: bool | None, models_static: int, device: torch.device, fsdp: bool) -> bool:
    """trainer.offload_optimizer, planned when null (before sharding): on only for an FSDP trainer on
    CUDA whose static state (`models_static` bytes per rank) would crowd out the activations."""
    if spec_offload is not None:
        return spec_offload
    if not fsdp or device.type != "cuda":
        return False
    capacity = device_capacity(device)
    if should_offload(models_static, capacity):
        log.warning(
            "trainer.offload_optimizer planned on: weights, gradients and optimizer state take %.1f GiB per "
            "rank of %.1f GiB usable (more than %d%%); add trainer ranks to keep the optimizer on the GPU",
            models_static / GIB,
            capacity / GIB,
            int(OFFLOAD_ABOVE * 100),
        )
        return True
    return False


def plan_learner(ln, capacity: int | None = None) -> MemoryPlan:
    """The memory plan of a set-up Learner `ln` (a collective: every rank calls it). capacity: bytes the
    rank may use (None = the device's, `device_capacity`; 0 = not planned, the settings as given). The
    smallest capacity over the ranks is planned for, so every rank takes the same plan."""
    tr = ln.trainer
    capacity = device_capacity(ln.device) if capacity is None else capacity
    if capacity:
        box = torch.tensor([float(capacity)], dtype=torch.float64, device=ln.device)
        capacity = int(ln.ranks.all_reduce(box, dist.ReduceOp.MIN).item())
    if not capacity:
        result = unplanned(tr.micro_batch_tokens, tr.activation_checkpointing, ln.offload)
    else:
        world = ln.ranks.world_size if ln.fsdp else 1
        models = [m for m in (ln.model, ln.ref, ln.critic) if m is not None]
        static = 0 if ln.offload else sum(static_bytes(m, world) for m in models)
        head = (tr.logprob_chunk_tokens, tr.compile, ln.fp32_head)

        def probe() -> int:
            per = probe_per_token(ln.model, ln.device, ln.config.vocab_size, head, ln._autocast)
            return 2 * per if ln.critic is not None else per  # GAE runs the critic over every micro-batch

        explicit = tr.activation_checkpointing
        plain = probe() if explicit is not True else 0
        if explicit is not False:
            for m in (ln.model, ln.critic):
                if m is not None:
                    set_checkpointing(m, True)
        checkpointed = probe() if explicit is not False else plain
        result = plan(
            capacity=capacity,
            static=static,
            per_token=plain or checkpointed,
            per_token_checkpointed=checkpointed,
            transient=transient_bytes(ln.config, tr.logprob_chunk_tokens, ln.bf16),
            longest=ln.response_budget + PROMPT_ALLOWANCE,
            micro_batch_tokens=tr.micro_batch_tokens,
            activation_checkpointing=explicit,
            offload_optimizer=ln.offload,
        )
        if explicit is None and not result.activation_checkpointing:
            for m in (ln.model, ln.critic):
                if m is not None:
                    set_checkpointing(m, False)
    metrics.MEMORY_PLAN.labels("capacity").set(result.capacity)
    metrics.MEMORY_PLAN.labels("static").set(result.static)
    metrics.MEMORY_PLAN.labels("per_token").set(result.per_token)
    metrics.MICRO_BATCH_TOKENS.set(result.micro_batch_tokens)
    if ln.ranks.is_main:
        log.info("memory plan: %s", result.describe())
    return result


def return_cached_memory(device: torch.device) -> int:
    """A colocated sync step is over: give the blocks the caching allocator holds but no tensor uses (the
    step's activations, mostly) back to the device, so that the engine sharing it can take its KV cache
    back (verl's sharding manager empties the cache likewise). Returns the bytes returned; logged and
    counted (slipstream_trainer_cached_memory_returned_bytes_total)."""
    before = torch.cuda.memory_reserved(device)
    torch.cuda.empty_cache()
    freed = max(0, before - torch.cuda.memory_reserved(device))
    metrics.CACHE_RETURNED.inc(freed)
    log.debug("returned %.2f GiB of cached blocks to the device for its engine", freed / 2**30)
    return freed
