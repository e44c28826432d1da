"""Fused Triton kernels of the engine's CUDA decode step (model.py `PagedForward.decode`), each replacing
several PyTorch kernels per layer (the step is bound by kernel count at small batch):

- `add_rms_norm`: residual add and RMSNorm in one pass (h = x + residual; normed = rms_norm(h));
- `rope_kv_write`: RoPE on the fused q/k/v projection's output, q written to its own tensor and k/v
  written straight into the paged pool at each row's slot (replaces the rotate-half arithmetic, the
  splits and the two index copies);
- `silu_mul`: SwiGLU's act(gate) * up on the fused gate/up projection's output.

fp32 arithmetic inside, any float dtype in and out. The same kernels run on CPU under `TRITON_INTERPRET=1`
(tests compare them with the PyTorch ops they replace).
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
    return triton is not None


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
