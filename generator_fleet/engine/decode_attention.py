"""Paged decode attention in Triton: one query token per sequence attends to its K/V read straight from
the paged pool through its block table (no dense [B, L, KV, D] copy), split over the sequence (split-KV)
so short batches still fill the GPU, GQA-aware (the `group` query heads of one KV head share each K/V
load), bf16/fp16/fp32 in, fp32 accumulate.

Two kernels: stage 1 runs a grid of (batch row, KV head, split); each program walks its split's blocks
with an online softmax and writes a partial output and its log-sum-exp; stage 2 merges the splits. The
number of splits and the block-table width are fixed per call, so a call is capturable in a CUDA graph
(DecodeGraphs captures one per bucket). Rows whose `seq_lens` is 0 are never produced by the engine
(padding rows attend to the scratch slot, length 1).

The same kernels run on CPU under `TRITON_INTERPRET=1` (tests compare them with gather + SDPA).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA torch builds
    triton = None
    tl = None


def available() -> bool:
    """Whether Triton is importable (the kernels are usable on CUDA, or on CPU when interpreted)."""
    return triton is not None


if triton is not None:
    # Long: one Triton kernel: splitting it would cost a launch and registers per decode step
    @triton.jit
    def _decode_stage1(
        Q,  # [B, H, D]
        K,  # [num_slots, KV, D]
        V,
        BT,  # [B, MB] int64 block tables
        SL,  # [B] int64 KV lengths
        O_PART,  # [B, H, S, D] fp32
        LSE_PART,  # [B, H, S] fp32
        scale,
        stride_qb,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_btb,
        stride_btm,
        stride_sl,
        tokens_per_split,
        GROUP: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        h_mask = offs_h < GROUP
        d_mask = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_h
        # The group's query heads are the rows of one [BLOCK_H, D] tile (padded to a tensor-core size), so
        # each K/V tile is loaded once per KV head and both products run on tensor cores.
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=h_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        seq_len = tl.load(SL + b * stride_sl)
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, seq_len)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        s_sum = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + offs_n
            n_mask = pos < end
            block_id = tl.load(BT + b * stride_btb + (pos // BLOCK_SIZE) * stride_btm, mask=n_mask, other=0)
            slots = block_id * BLOCK_SIZE + pos % BLOCK_SIZE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(
                K + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0
            )
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(n_mask[None, :], scores * scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            s_sum = s_sum * alpha + tl.sum(p, axis=1)
            v = tl.load(
                V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0
            )
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        has = end > start
        out = tl.where(has, acc / tl.where(has, s_sum, 1.0)[:, None], 0.0)
        lse = tl.where(has, m + tl.log(tl.where(has, s_sum, 1.0)), float("-inf"))
        base = (b * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
        tl.store(
            O_PART + base[:, None] * HEAD_DIM + offs_d[None, :], out, mask=h_mask[:, None] & d_mask[None, :]
        )
        tl.store(LSE_PART + base, lse, mask=h_mask)

    @triton.jit
    def _decode_stage2(
        O_PART,  # [B*H, S, D] fp32
        LSE_PART,  # [B*H, S]
        OUT,  # [B*H, D]
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        row = tl.program_id(0)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_mask = offs_s < NUM_SPLITS
        d_mask = offs_d < HEAD_DIM
        lse = tl.load(LSE_PART + row * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))
        m = tl.max(lse, axis=0)
        w = tl.exp(lse - m)
        w = tl.where(s_mask, w, 0.0)
        parts = tl.load(
            O_PART + (row * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        out = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
        tl.store(OUT + row * HEAD_DIM + offs_d, out.to(OUT.dtype.element_ty), mask=d_mask)


BLOCK_N = 64
"""KV positions per tile of the first stage (a multiple of 16 for the tensor cores; tiles cross page
boundaries: each position's slot comes from its own block-table entry)."""
MAX_SPLITS = 16


def num_splits_for(batch: int, kv_heads: int, max_tokens: int, num_sms: int) -> int:
    """Splits over the sequence: enough (batch × KV head × split) programs for about two per
    multiprocessor, at most MAX_SPLITS and at least one tile of positions each."""
    want = triton.cdiv(2 * num_sms, max(1, batch * kv_heads))
    return max(1, min(MAX_SPLITS, want, triton.cdiv(max_tokens, BLOCK_N)))


_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    block_size: int,
    scale: float,
    num_splits: int | None = None,
    block_n: int = BLOCK_N,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Attention of one query token per row over its paged K/V.

    q [B, H, D]; k_pool/v_pool [num_blocks·block_size, KV, D] (one layer's pool); block_tables [B, MB]
    int64; seq_lens [B] int64 (>= 1); both may be strided views (the decode graphs' input block). Returns
    [B, H, D] in q's dtype. `block_size` must be a power of 2. The split count depends only on the shapes
    (not on `seq_lens`), so one CUDA graph per shape bucket replays for any lengths that fit."""
    if triton is None:
        raise RuntimeError("paged decode attention needs triton")
    B, H, D = q.shape
    KV = k_pool.shape[1]
    group = H // KV
    MB = block_tables.shape[1]
    max_tokens = MB * block_size
    S = num_splits or num_splits_for(B, KV, max_tokens, _num_sms(q.device))
    per_split = triton.cdiv(triton.cdiv(max_tokens, S), block_n) * block_n
    q = q.contiguous()
    o_part = torch.empty((B, H, S, D), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    block_d = max(16, triton.next_power_of_2(D))
    _decode_stage1[(B, KV, S)](
        q,
        k_pool,
        v_pool,
        block_tables,
        seq_lens,
        o_part,
        lse_part,
        scale,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        block_tables.stride(0),
        block_tables.stride(1),
        seq_lens.stride(0),
        per_split,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        HEAD_DIM=D,
        BLOCK_D=block_d,
        NUM_SPLITS=S,
        IEEE=q.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    _decode_stage2[(B * H,)](
        o_part,
        lse_part,
        out,
        HEAD_DIM=D,
        BLOCK_D=block_d,
        NUM_SPLITS=S,
        BLOCK_S=triton.next_power_of_2(S),
    )
    return out
