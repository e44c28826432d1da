"""Fused Triton kernels of the engine's CUDA decode step (model.py `PagedForward.decode`), each replacing
several PyTorch kernels per layer (the step is bound by kernel count at small batch):

- `add_rms_norm`: residual add and RMSNorm in one pass (h = x + residual; normed = rms_norm(h));
- `rope_kv_write`: RoPE on the fused q/k/v projection's output, q written to its own tensor and k/v
  written straight into the paged pool at each row's slot (replaces the rotate-half arithmetic, the
  splits and the two index copies);
- `silu_mul`: SwiGLU's act(gate) * up on the fused gate/up projection's output;
- `sample_rows`: the decode graph's sampling (greedy, or temperature through the Gumbel-max race) with
  each chosen token's logprob, in one pass over the logits instead of about ten.

fp32 arithmetic inside, any float dtype in and out. The same kernels run on CPU under `TRITON_INTERPRET=1`
(tests compare them with the PyTorch ops they replace).
"""

from __future__ import annotations

import torch

from generator_fleet.engine.decode_attention import available, tl, triton

__all__ = ["available"]


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(X, RES, W, OUT, H_OUT, N, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(X + row * N + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            x += tl.load(RES + row * N + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(H_OUT + row * N + offs, x.to(H_OUT.dtype.element_ty), mask=mask)
            # normalise the rounded sum, as the unfused ops would
            x = x.to(H_OUT.dtype.element_ty).to(tl.float32)
        var = tl.sum(x * x, axis=0) / N
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(var + eps) * w
        tl.store(OUT + row * N + offs, y.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kv_write_kernel(
        QKV,  # [B, (H + 2 KV) * D]
        POS,  # [B] int64
        COS,  # [P, D]
        SIN,  # [P, D] (first half negated: rotate_half folded in)
        SLOT,  # [B] int64
        Q_OUT,  # [B, H, D]
        K_POOL,  # [slots, KV, D]
        V_POOL,
        stride_qkv,
        stride_pos,
        stride_slot,
        H: tl.constexpr,
        KV: tl.constexpr,
        D: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0)
        head = tl.program_id(1)  # 0..H-1: query heads; H..H+KV-1: key heads (and their value heads)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        pos = tl.load(POS + b * stride_pos)
        cos = tl.load(COS + pos * D + offs, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(SIN + pos * D + offs, mask=mask, other=0.0).to(tl.float32)
        src = QKV + b * stride_qkv + head * D
        x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        x_rot = tl.load(src + (offs + HALF) % D, mask=mask, other=0.0).to(tl.float32)
        y = x * cos + x_rot * sin
        if head < H:
            tl.store(Q_OUT + (b * H + head) * D + offs, y.to(Q_OUT.dtype.element_ty), mask=mask)
        else:
            kvh = head - H
            slot = tl.load(SLOT + b * stride_slot)
            tl.store(K_POOL + (slot * KV + kvh) * D + offs, y.to(K_POOL.dtype.element_ty), mask=mask)
            v = tl.load(src + KV * D + offs, mask=mask, other=0.0)
            tl.store(V_POOL + (slot * KV + kvh) * D + offs, v.to(V_POOL.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(GU, OUT, N, stride_gu, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < N
        g = tl.load(GU + row * stride_gu + col, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride_gu + N + col, mask=mask, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(OUT + row * N + col, y.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _sample_stage1(
        LOGITS,  # [B, V] fp32
        TEMPS,  # [B] fp32 (<= 0: greedy)
        SEED,  # [1] int64
        PART,  # [B, S, 5] fp32: max, sum of exp(z - max), best score, its index, its z
        V,
        stride_l,
        per_split,
        NUM_SPLITS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        split = tl.program_id(1)
        t = tl.load(TEMPS + row)
        greedy = t <= 0.0
        inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, t))
        seed = tl.load(SEED)
        start = split * per_split
        end = tl.minimum(start + per_split, V)
        m = float("-inf")
        s = 0.0
        best = float("-inf")
        best_i = 0
        best_z = 0.0
        for c0 in range(start, end, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            mask = offs < end
            z = tl.load(LOGITS + row * stride_l + offs, mask=mask, other=float("-inf")) * inv_t
            m_new = tl.maximum(m, tl.max(z, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.where(mask, tl.exp(z - m_new), 0.0), axis=0)
            m = m_new
            if greedy:
                score = z
            else:
                # Gumbel-max: argmax(z + G), G = -log(-log U), samples softmax(z) exactly
                u = tl.rand(seed, row * V + offs)
                score = tl.where(mask, z - tl.log(-tl.log(u)), float("-inf"))
            c_best = tl.max(score, axis=0)
            c_i = tl.argmax(score, axis=0)
            c_z = tl.sum(tl.where(tl.arange(0, BLOCK) == c_i, z, 0.0), axis=0)
            better = c_best > best
            best_i = tl.where(better, c0 + c_i, best_i)
            best_z = tl.where(better, c_z, best_z)
            best = tl.where(better, c_best, best)
        base = PART + (row * NUM_SPLITS + split) * 5
        tl.store(base, m)
        tl.store(base + 1, s)
        tl.store(base + 2, best)
        tl.store(base + 3, best_i.to(tl.float32))
        tl.store(base + 4, best_z)

    @triton.jit
    def _sample_stage2(PART, OUT, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_S)
        mask = offs < NUM_SPLITS
        base = PART + (row * NUM_SPLITS + offs) * 5
        m = tl.load(base, mask=mask, other=float("-inf"))
        s = tl.load(base + 1, mask=mask, other=0.0)
        best = tl.load(base + 2, mask=mask, other=float("-inf"))
        idx = tl.load(base + 3, mask=mask, other=0.0)
        z = tl.load(base + 4, mask=mask, other=0.0)
        mm = tl.max(m, axis=0)
        lse = mm + tl.log(tl.sum(tl.where(mask, s * tl.exp(m - mm), 0.0), axis=0))
        k = tl.argmax(best, axis=0)  # the first split on ties: the lowest token id
        sel = tl.arange(0, BLOCK_S) == k
        tok = tl.sum(tl.where(sel, idx, 0.0), axis=0)
        lp = tl.sum(tl.where(sel, z, 0.0), axis=0) - lse
        tl.store(OUT + row * 2, tok.to(tl.float64))
        tl.store(OUT + row * 2 + 1, lp.to(tl.float64))


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) · weight, x + residual) for x [T, N]; with residual None, (rms_norm(x), x)."""
    T, N = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    if residual is None:
        h = x
        _add_rms_norm_kernel[(T,)](
            x, x, weight, out, x, N, eps, HAS_RES=False, BLOCK=triton.next_power_of_2(N)
        )
        return out, h
    h = torch.empty_like(x)
    _add_rms_norm_kernel[(T,)](
        x, residual.contiguous(), weight, out, h, N, eps, HAS_RES=True, BLOCK=triton.next_power_of_2(N)
    )
    return out, h


def rope_kv_write(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    slots: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """qkv [B, (H + 2 KV) · D] (q, k, v heads in order) → q with RoPE [B, H, D]; k with RoPE and v are
    written to the pools at `slots`. cos/sin_signed [positions, D] as PagedForward keeps them."""
    B = qkv.shape[0]
    KV, D = k_pool.shape[1], k_pool.shape[2]
    assert qkv.stride(1) == 1 and k_pool.is_contiguous() and v_pool.is_contiguous()
    q = torch.empty((B, num_heads, D), dtype=qkv.dtype, device=qkv.device)
    _rope_kv_write_kernel[(B, num_heads + KV)](
        qkv,
        positions,
        cos,
        sin_signed,
        slots,
        q,
        k_pool,
        v_pool,
        qkv.stride(0),
        positions.stride(0),
        slots.stride(0),
        H=num_heads,
        KV=KV,
        D=D,
        HALF=D // 2,
        BLOCK_D=triton.next_power_of_2(D),
    )
    return q


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns first) → silu(gate) · up [T, I]."""
    T, two_n = gate_up.shape
    n = two_n // 2
    assert gate_up.stride(1) == 1
    out = torch.empty((T, n), dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(T, triton.cdiv(n, SILU_BLOCK))](gate_up, out, n, gate_up.stride(0), BLOCK=SILU_BLOCK)
    return out


SAMPLE_BLOCK = 2048
SAMPLE_SPLITS = 8
"""Programs per row over the vocabulary (rows × splits programs fill the GPU at small batch)."""


def sample_rows(
    logits: torch.Tensor, temps: torch.Tensor, seed: torch.Tensor, block: int = SAMPLE_BLOCK
) -> torch.Tensor:
    """One token per row of fp32 `logits` [B, V]: argmax where temps <= 0, else a sample of
    softmax(logits / temp) (Gumbel-max with Philox uniforms from `seed`, a one-element int64 device
    tensor: a different value each call gives independent draws). Returns [B, 2] float64: token id and
    its logprob under the row's (temperature-scaled) distribution."""
    B, V = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    per_split = triton.cdiv(triton.cdiv(V, SAMPLE_SPLITS), block) * block
    splits = triton.cdiv(V, per_split)
    part = torch.empty((B, splits, 5), dtype=torch.float32, device=logits.device)
    out = torch.empty((B, 2), dtype=torch.float64, device=logits.device)
    _sample_stage1[(B, splits)](
        logits, temps, seed, part, V, logits.stride(0), per_split, NUM_SPLITS=splits, BLOCK=block
    )
    _sample_stage2[(B,)](part, out, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits))
    return out
