"""The engine's forward passes over a paged KV cache, for Llama-family decoders (Qwen2, Qwen3, Llama,
Mistral): the HF model keeps the weights (so weight updates stay in-place copies by HF name), and these
functions walk its modules in a packed token layout instead of calling its forward.

- `prefill`: several sequences at once, padded to one [N, L] batch for causal SDPA; K/V are written to
  the pool at each token's slot.
- `decode`: one new token for each of B sequences. On CUDA (unless SLIPSTREAM_ENGINE_TRITON_DECODE=0)
  attention is the Triton paged decode kernel (decode_attention.py), reading K/V through the block
  tables; otherwise K/V are gathered from the pool through block tables and attention is SDPA with a
  length mask. On CUDA `DecodeGraphs` captures it per (batch, KV-length) bucket so a step is one graph
  replay instead of hundreds of kernel launches.

Each layer's q/k/v projections run as one GEMM and gate/up as another (`fuse_weights`: the HF parameters
become views into one buffer per layer, so an in-place copy by HF name updates the fused weights). On CUDA
the decode step also runs the fused kernels of fused_ops.py (residual add + RMSNorm, RoPE with the K/V pool
write, SwiGLU): about 10 kernels per layer instead of 25 (SLIPSTREAM_ENGINE_FUSED_DECODE=0 turns them off;
LoRA decode and Qwen3's q/k norms take the unfused path).
"""

from __future__ import annotations

import logging
import os
import random
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from generator_fleet.engine import arena
from generator_fleet.engine.kv_cache import PagedKVCache
from generator_fleet.engine.prefill_attention import PrefillAttention

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")

TRITON_DECODE_ENV = "SLIPSTREAM_ENGINE_TRITON_DECODE"
"""Set to 0 to run CUDA decode attention as gather + SDPA instead of the Triton paged kernel (the
default on CUDA; CPU always gathers)."""


FUSED_DECODE_ENV = "SLIPSTREAM_ENGINE_FUSED_DECODE"
"""Set to 0 to decode and prefill on CUDA with the unfused PyTorch ops (the fused Triton kernels are the
default; FUSED_PREFILL_ENV turns them off for prefill alone)."""
FUSED_PREFILL_ENV = "SLIPSTREAM_ENGINE_FUSED_PREFILL"
"""Set to 0 to prefill with the PyTorch ops while decode keeps the fused kernels (for comparison)."""


def check_supported(config) -> None:
    """Raise ValueError unless the engine's forward covers this architecture exactly."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"the built-in engine supports model types {', '.join(SUPPORTED_MODEL_TYPES)}; got {mt!r} "
            "(serve it with engine: sglang instead)"
        )
    if getattr(config, "use_sliding_window", False) or (
        mt == "mistral" and getattr(config, "sliding_window", None)
    ):
        raise ValueError("the built-in engine does not implement sliding-window attention")


@dataclass
class DecodeInputs:
    """One decode step for B sequences (row i = sequence i)."""

    input_ids: torch.Tensor
    """[B] the last sampled token of each sequence (its K/V is not cached yet)."""
    positions: torch.Tensor
    """[B] that token's position (= KV length before the step)."""
    slots: torch.Tensor
    """[B] pool slot its K/V is written to."""
    block_tables: torch.Tensor
    """[B, MB] pool blocks of each sequence (unused columns: any valid block)."""
    seq_lens: torch.Tensor
    """[B] KV length after the step (positions + 1)."""


class PagedForward:
    """Forward passes of one HF Llama-family model over a `PagedKVCache`."""

    def __init__(
        self, model: torch.nn.Module, cache: PagedKVCache, context_length: int, fp32_lm_head: bool = False
    ) -> None:
        check_supported(model.config)
        self.model = model
        self.fp32_lm_head = fp32_lm_head
        self.decoder = model.model
        self.cache = cache
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.group = self.num_heads // self.num_kv_heads
        dev = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        # cos/sin for every position once, through the model's own rotary module (rope scaling included).
        with torch.no_grad():
            pos = torch.arange(context_length + 1, device=dev)[None]
            probe = torch.zeros(1, device=dev, dtype=dtype)
            cos, sin = self.decoder.rotary_emb(probe, pos)
        half = self.head_dim // 2
        # rotate_half(x)·sin == roll(x, half)·sin_signed: one roll instead of split, negate and cat
        sin_signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        self.cos, self.sin = cos[0].to(dtype), sin_signed.to(dtype)  # [positions, head_dim]
        self.half = half
        self.lora = None
        """A `LoraBank` when the engine serves LoRA adapters; None keeps the forward adapter-free."""
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_w: list[torch.Tensor] | None = None
        self.qkv_b: list[torch.Tensor | None] | None = None
        self.gate_up_w: list[torch.Tensor] | None = None
        self.gate_up_b: list[torch.Tensor | None] | None = None
        self.arena: arena.Arena | None = None
        """Every weight in one buffer (engine/arena.py); None when the model could not be laid out."""
        self.fuse_weights()
        self._fused_kernels = self._fused_kernels_usable()
        self._fused_prefill = self._fused_kernels and os.environ.get(FUSED_PREFILL_ENV, "1") != "0"
        log.info(
            "decode path: attention %s, %s",
            "Triton paged" if _paged_attention(cache) is not None else "gather + SDPA",
            "fused Triton kernels"
            if self._fused_kernels
            else "PyTorch ops around fused q/k/v and gate/up GEMMs",
        )

    # ---- fused projections -------------------------------------------------------------------------

    def fuse_weights(self) -> None:
        """Lay every weight out in one arena (engine/arena.py: a weight update can then be received
        straight into it), each layer's q/k/v weights (and biases) adjacent as one tensor and gate/up as
        another, the HF parameters views into them: a weight update's in-place copy by HF name lands in
        the fused tensor. Called again after the weights come back from host memory (WeightsBackup
        restores the arena as it was; only the views are taken again); a state_dict taken before a
        release is stale after it. Without an arena (tensors on several devices, or not contiguous) the
        projections are fused by concatenation, as views of their own tensors."""
        layers, _, kinds = arena.projections(self.decoder)
        self.arena = arena.lay_out_weights(self.model)
        n = len(layers)
        fused: dict[str, list] = {k: [None] * n for k in ("qkv_w", "qkv_b", "gate_up_w", "gate_up_b")}
        if self.arena is not None:
            for (kind, i), t in zip(kinds, self.arena.fused, strict=True):
                fused[kind][i] = t
        else:
            for i, qkv, gate_up in layers:
                fused["qkv_w"][i], fused["qkv_b"][i] = _fuse_linears(qkv)
                fused["gate_up_w"][i], fused["gate_up_b"][i] = _fuse_linears(gate_up)
        self.qkv_w, self.qkv_b = fused["qkv_w"], fused["qkv_b"]
        self.gate_up_w, self.gate_up_b = fused["gate_up_w"], fused["gate_up_b"]

    def unfuse_weights(self) -> None:
        """Drop the references to the fused tensors and the arena (before the parameters are moved to
        host memory, so their device memory goes with the parameters'); `fuse_weights` makes them again."""
        self.qkv_w = self.qkv_b = self.gate_up_w = self.gate_up_b = None
        self.arena = None

    def _fused_kernels_usable(self) -> bool:
        if self.cache.device.type != "cuda" or os.environ.get(FUSED_DECODE_ENV, "1") == "0":
            return False
        if _paged_attention(self.cache) is None or getattr(self.model.config, "hidden_act", None) != "silu":
            return False
        if any(hasattr(layer.self_attn, "q_norm") for layer in self.decoder.layers):
            return False
        from generator_fleet.engine import fused_ops

        return fused_ops.available()

    def _gate_up(self, idx: int, mlp, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.gate_up_w is None:
            return mlp.gate_proj(x), mlp.up_proj(x)
        gate, up = F.linear(x, self.gate_up_w[idx], self.gate_up_b[idx]).chunk(2, dim=-1)
        return gate, up

    def _lora_delta(self, layer_idx: int, module: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (projection `module`'s output for rows x) plus the rows' adapter deltas."""
        d = self.lora.delta(layer_idx, module, x)
        return out if d is None else out + d

    def _select_lora(self, row_slots: list[int] | None, repeats: list[int] | None, dev) -> None:
        if self.lora is None:
            return
        slots = torch.tensor(row_slots if row_slots is not None else [-1] * len(repeats or [0]), device=dev)
        if repeats is not None:
            slots = slots.repeat_interleave(torch.tensor(repeats, device=dev))
        self.lora.select(slots)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for `positions`, shaped to broadcast over heads (looked up once per forward)."""
        return self.cos[positions][:, None], self.sin[positions][:, None]

    # ---- shared pieces -----------------------------------------------------------------------------

    def _qkv(self, layer, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], idx: int = 0):
        """h [T, hidden] → q [T, H, D], k/v [T, KV, D] with RoPE applied (and Qwen3's q/k norms)."""
        attn = layer.self_attn
        T = h.shape[0]
        if self.qkv_w is None:
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        else:
            qkv = F.linear(h, self.qkv_w[idx], self.qkv_b[idx])
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.lora is not None:
            q = self._lora_delta(idx, "q_proj", h, q)
            k = self._lora_delta(idx, "k_proj", h, k)
            v = self._lora_delta(idx, "v_proj", h, v)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):
            q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
        cos, sin = rope
        q = torch.addcmul(q * cos, q.roll(self.half, -1), sin)
        k = torch.addcmul(k * cos, k.roll(self.half, -1), sin)
        return q, k, v

    def _layer_tail(
        self, layer, residual: torch.Tensor, attn_out: torch.Tensor, idx: int = 0
    ) -> torch.Tensor:
        if self.lora is not None:
            return self._layer_tail_lora(layer, residual, attn_out, idx)
        h = residual + layer.self_attn.o_proj(attn_out)
        mlp = layer.mlp
        gate, up = self._gate_up(idx, mlp, _rms_norm(layer.post_attention_layernorm, h))
        return h + mlp.down_proj(mlp.act_fn(gate) * up)

    def _layer_tail_lora(
        self, layer, residual: torch.Tensor, attn_out: torch.Tensor, idx: int
    ) -> torch.Tensor:
        h = residual + self._lora_delta(idx, "o_proj", attn_out, layer.self_attn.o_proj(attn_out))
        x = _rms_norm(layer.post_attention_layernorm, h)
        mlp = layer.mlp
        gate, up = self._gate_up(idx, mlp, x)
        gate = self._lora_delta(idx, "gate_proj", x, gate)
        up = self._lora_delta(idx, "up_proj", x, up)
        inner = mlp.act_fn(gate) * up
        return h + self._lora_delta(idx, "down_proj", inner, mlp.down_proj(inner))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head. With `fp32_lm_head` the norm's output and the head's weight are cast to
        fp32 for the matmul (SGLang's --enable-fp32-lm-head): the cast reads the live weight, so weight
        updates and captured CUDA graphs need nothing more."""
        return self._head(_rms_norm(self.decoder.norm, hidden))

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head over final-normed hidden states (fp32 with `fp32_lm_head`)."""
        if not self.fp32_lm_head or h.dtype == torch.float32:
            return self.model.lm_head(h)
        head = self.model.lm_head
        bias = None if head.bias is None else head.bias.float()
        return F.linear(h.float(), head.weight.float(), bias)

    # ---- prefill -----------------------------------------------------------------------------------

    def prefill(
        self,
        seqs: list[list[int]],
        slots: torch.Tensor,
        lora_slots: list[int] | None = None,
        past: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """Run `seqs` (token lists), writing K/V at `slots` (flat, in sequence order). Each sequence starts
        at position 0, or with `past` after a cached prefix: per sequence, the pool slots of the tokens
        before it, whose K/V the pool holds already (the prefix cache's); it then starts at position
        len(past[i]) and attends to them too.
        `lora_slots`: each sequence's adapter slot (-1 = base; only with adapters loaded).
        Returns the final hidden states [sum(len), hidden] (before the last norm)."""
        dev = slots.device
        lens = [len(s) for s in seqs]
        self._select_lora(lora_slots, lens, dev)
        total = sum(lens)
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=dev)
        attend = PrefillAttention(
            self.cache, lens, past, slots, head_dim=self.head_dim, group=self.group, scale=self.scaling
        )
        positions = torch.cat(
            [torch.arange(o, o + n_, device=dev) for o, n_ in zip(attend.offsets, lens, strict=True)]
        )
        if self._fused_prefill and self.lora is None and self.qkv_w is not None:
            from generator_fleet.engine import fused_forward

            return fused_forward.prefill(self, ids, positions, slots, attend)
        h = self.decoder.embed_tokens(ids)
        rope = self.rope(positions)
        for i, layer in enumerate(self.decoder.layers):
            residual = h
            q, k, v = self._qkv(layer, _rms_norm(layer.input_layernorm, h), rope, i)
            self.cache.write(i, slots, k, v)
            h = self._layer_tail(layer, residual, attend(i, q, k, v), i)
            del q, k, v
        assert h.shape[0] == total
        return h

    # ---- decode ------------------------------------------------------------------------------------

    def decode(self, x: DecodeInputs, lora_slots: list[int] | None = None) -> torch.Tensor:
        """One token per sequence; returns fp32 logits [B, vocab]. `lora_slots`: each row's adapter slot
        (-1 = base; only with adapters loaded)."""
        B, MB = x.block_tables.shape
        if self.lora is not None:
            self._select_lora(lora_slots if lora_slots is not None else [-1] * B, None, x.seq_lens.device)
        if self._fused_kernels and self.lora is None and self.qkv_w is not None:
            from generator_fleet.engine import fused_forward

            return fused_forward.decode(self, x)
        L = MB * self.cache.block_size
        paged = _paged_attention(self.cache)
        mask = None
        if paged is None:
            mask = (torch.arange(L, device=x.seq_lens.device)[None] < x.seq_lens[:, None])[:, None, None]
        h = self.decoder.embed_tokens(x.input_ids)
        rope = self.rope(x.positions)
        for i, layer in enumerate(self.decoder.layers):
            residual = h
            q, k, v = self._qkv(layer, _rms_norm(layer.input_layernorm, h), rope, i)
            self.cache.write(i, x.slots, k, v)
            if paged is not None:
                # CUDA: the Triton kernel reads K/V through the block tables (no dense copy).
                o = paged(
                    q.view(B, -1, self.head_dim),
                    self.cache.k[i],
                    self.cache.v[i],
                    x.block_tables,
                    x.seq_lens,
                    block_size=self.cache.block_size,
                    scale=self.scaling,
                )
                h = self._layer_tail(layer, residual, o.reshape(B, -1), i)
                continue
            kc, vc = self.cache.gather(i, x.block_tables)  # [B, L, KV, D]
            # GQA without repeating K/V: the `group` query heads of one KV head act as query rows.
            qg = q.view(B, self.num_kv_heads, self.group, self.head_dim)
            o = F.scaled_dot_product_attention(
                qg, kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=mask, scale=self.scaling
            )
            h = self._layer_tail(layer, residual, o.reshape(B, -1), i)
        return self.logits(h).float()


def _fuse_linears(mods: list[torch.nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) tensor holding `mods`' outputs in order; each module's parameters become
    views into it (same values, same parameter objects)."""
    with torch.no_grad():
        w = torch.cat([m.weight.data for m in mods])
        has_bias = [m.bias is not None for m in mods]
        b = torch.cat([m.bias.data for m in mods]) if all(has_bias) else None
        off = 0
        for m in mods:
            n = m.weight.shape[0]
            m.weight.data = w[off : off + n]
            if b is not None:
                m.bias.data = b[off : off + n]
            off += n
    if any(has_bias) and b is None:  # some biased, some not: the fused GEMM adds the biases after
        b = torch.cat([m.bias.data if m.bias is not None else w.new_zeros(m.weight.shape[0]) for m in mods])
        off = 0
        for m in mods:
            n = m.weight.shape[0]
            if m.bias is not None:
                m.bias.data = b[off : off + n]
            off += n
    return w, b


def _paged_attention(cache: PagedKVCache):
    """The Triton paged decode attention on CUDA (power-of-2 block sizes), else None (CPU keeps gather +
    SDPA). Imported here, not at module load, so CPU tests can run the kernels under Triton's
    interpreter."""
    if cache.device.type != "cuda" or cache.block_size & (cache.block_size - 1):
        return None
    if os.environ.get(TRITON_DECODE_ENV, "1") == "0":
        return None
    from generator_fleet.engine import decode_attention

    return decode_attention.paged_decode_attention if decode_attention.available() else None


def _fused_ops_available() -> bool:
    from generator_fleet.engine import fused_ops

    return fused_ops.available()


def _rms_norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The HF RMSNorm module's function as one fused op (HF's forward is several kernels)."""
    return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)


class DecodeGraphs:
    """CUDA graphs of one decode step, one per (batch bucket, block-table width bucket), captured on first
    use into one shared memory pool. A step is one host→device copy of a pinned int64 block holding every
    input, one replay, and one device→host copy of the chosen tokens and their logprobs: the graph also
    samples (greedy, or temperature through the Gumbel-max race in fused_ops.sample_rows, seeded per step
    through the input block) for rows with plain sampling settings. Padding rows write to the cache's scratch slot and attend to it alone.

    A capture holds `capture_lock`, which every weight-bus operation on this device takes too (its CUDA
    work: buffers, the broadcast, the gloo copy to the device), so no such call can land inside a
    capture: CUDA refuses most calls while a stream captures and the capture then fails for good.
    The capture never waits for the lock: while a weight operation holds it, the step runs eagerly and
    the bucket is captured at a later step (a receive can block on its sender for the group timeout).
    Captures use `capture_error_mode="thread_local"`, so a CUDA call of any other thread of the process
    (the NCCL watchdog's event queries, a library's thread) cannot invalidate one either."""

    COLS = 5
    """input_ids, positions, slots, seq_lens, the step's sampling seed; block tables follow."""

    def __init__(
        self,
        fwd: PagedForward,
        max_batch: int,
        max_blocks: int,
        capture_lock: threading.Lock | None = None,
    ) -> None:
        self.fwd = fwd
        self.capture_lock = capture_lock or threading.Lock()
        self.batch_buckets = _buckets(
            max_batch, [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]
        )
        self.block_buckets = _buckets(max_blocks, [2**i for i in range(4, 20)])
        dev = fwd.cache.device
        B, MB = self.batch_buckets[-1], self.block_buckets[-1]
        self.host = torch.zeros((B, self.COLS + MB), dtype=torch.long, pin_memory=True)
        self.host_np = self.host.numpy()
        self.inputs = torch.zeros((B, self.COLS + MB), dtype=torch.long, device=dev)
        self.host_temps = torch.zeros(B, dtype=torch.float32, pin_memory=True)
        self.host_temps_np = self.host_temps.numpy()
        self.temps = torch.zeros(B, dtype=torch.float32, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.fused_sampling = os.environ.get(FUSED_DECODE_ENV, "1") != "0" and _fused_ops_available()
        """Sample with fused_ops.sample_rows (one pass over the logits); else PyTorch ops."""
        self._seeds = random.Random(torch.initial_seed())

    def drop(self) -> int:
        """Forget every captured graph (release_memory_occupation: they hold the addresses of the KV pool
        and the weights, and their pool's memory); each bucket is captured again on its next use, into a
        fresh pool. The caller holds `capture_lock`. Returns how many graphs were dropped."""
        n = len(self.graphs)
        self.graphs.clear()
        self.pool = torch.cuda.graph_pool_handle()
        if n:
            log.info("dropped %d decode graphs (captured again on use)", n)
        return n

    def _view(self, b: int, mb: int) -> DecodeInputs:
        x = self.inputs[:b]
        return DecodeInputs(x[:, 0], x[:, 1], x[:, 2], x[:, self.COLS : self.COLS + mb], x[:, 3])

    def _step(self, b: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.fwd.decode(self._view(b, mb))
        temps = self.temps[:b]
        if self.fused_sampling:
            from generator_fleet.engine import fused_ops

            return logits, fused_ops.sample_rows(logits, temps, self.inputs[0:1, 4])
        greedy = temps <= 0
        lp_all = torch.log_softmax(logits / torch.where(greedy, 1.0, temps)[:, None], dim=-1)
        race = lp_all - torch.empty_like(lp_all).exponential_().log()  # argmax p/E, E ~ Exp(1)
        tok = torch.where(greedy, logits.argmax(dim=-1), race.argmax(dim=-1))
        lp = lp_all.gather(1, tok[:, None]).squeeze(1)
        return logits, torch.stack([tok.to(torch.float64), lp.to(torch.float64)], dim=1)

    def run(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        temps: list[float] | None,
    ) -> tuple[torch.Tensor, tuple[list[int], list[float]] | None] | None:
        """Decode one token for each row. Returns the fp32 logits [B, vocab] and, when `temps` is given
        (0 = greedy), the tokens the graph sampled with their logprobs; None (nothing ran) when the
        step's bucket has no graph yet and a weight operation holds the capture lock: decode eagerly."""
        B = len(ids)
        MB = max(len(t) for t in tables)
        b = next(v for v in self.batch_buckets if v >= B)
        mb = next(v for v in self.block_buckets if v >= MB)
        key = (b, mb)
        capture = key not in self.graphs
        if capture and not self.capture_lock.acquire(blocking=False):
            return None
        try:
            return self._run(key, ids, positions, slots, tables, temps, capture)
        finally:
            if capture:
                self.capture_lock.release()

    def _run(
        self,
        key: tuple[int, int],
        ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        temps: list[float] | None,
        capture: bool,
    ) -> tuple[torch.Tensor, tuple[list[int], list[float]] | None]:
        B, (b, mb) = len(ids), key
        scratch, bs = self.fwd.cache.scratch_block, self.fwd.cache.block_size
        h = self.host_np
        h[:B, 0], h[:B, 1], h[:B, 2] = ids, positions, slots
        h[:B, 3] = h[:B, 1] + 1
        h[0, 4] = self._seeds.getrandbits(62)
        tab = h[:b, self.COLS : self.COLS + mb]
        tab.fill(scratch)
        for i, t in enumerate(tables):
            tab[i, : len(t)] = t
        if b > B:  # padding rows
            h[B:b, 0:2] = 0
            h[B:b, 2] = scratch * bs
            h[B:b, 3] = 1
        self.host_temps_np[:B] = temps if temps is not None else 0.0
        self.host_temps_np[B:b] = 0.0
        self.inputs[:b, : self.COLS + mb].copy_(self.host[:b, : self.COLS + mb], non_blocking=True)
        self.temps[:b].copy_(self.host_temps[:b], non_blocking=True)
        if capture:  # after the copy: the warm-up runs write this step's K/V, as the replay will
            self.graphs[key] = self._capture(b, mb)
        graph, logits, picked = self.graphs[key]
        graph.replay()
        if temps is None:
            return logits[:B], None
        res = picked[:B].cpu()  # the step's one sync
        return logits[:B], (res[:, 0].long().tolist(), res[:, 1].tolist())

    def _capture(self, b: int, mb: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (lazy init, cuBLAS workspaces)
                self._step(b, mb)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits, picked = self._step(b, mb)
        log.info("captured decode graph batch=%d kv_len=%d", b, mb * self.fwd.cache.block_size)
        return graph, logits, picked


def _buckets(limit: int, candidates: list[int]) -> list[int]:
    out = [c for c in candidates if c < limit]
    return [*out, limit]
