"""Probe of the built-in engine's decode step on one GPU, in pieces the engine benchmark does not separate:

- `attention`: the Triton paged decode attention against gather + SDPA for the Qwen2.5 shapes' head
  layouts at one batch (correctness in bf16 against an fp32 reference, and the time of one layer's call
  under CUDA-graph replay, so launch gaps stay out), for a few split counts and tile sizes.
- `prefill<rows>`: one prefill step of `rows` prompts of 100-400 tokens and their last logits (wall ms, kernel
  µs, top kernels), e.g. `prefill16`.
- `step`: a Runner with random weights (`load_format="dummy"`) of a shape decodes `concurrency` requests of
  `new_tokens` greedy tokens; it reports the wall time per decode step, the GPU time of one replay of the
  step's captured graph (CUDA events over many replays: the difference is host time), and a
  torch.profiler summary of the replay (kernels, kernel µs, top kernels).

`python -m benchmarks.probes.decode_step --parts attention,step --shapes qwen2.5-1.5b-shape --out F.json`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.shapes import SHAPES, config_kwargs


def _graph_time_ms(fn, iters: int = 50) -> float:
    """Median ms of one call of `fn` replayed from a CUDA graph (captured after two warm-up calls)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return statistics.median(times)


def attention(shape: str, batch: int, seed: int = 0) -> dict:
    from generator_fleet.engine import decode_attention as da
    from generator_fleet.engine.kv_cache import PagedKVCache

    cfg = SHAPES[shape]
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg["hidden_size"] // H
    bs = 16
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(96, 417, (batch,), generator=g).tolist()
    mb = 27
    need = [(n + bs - 1) // bs for n in lens]
    cache = PagedKVCache(
        num_layers=1,
        num_kv_heads=KV,
        head_dim=D,
        num_blocks=sum(need) + 2,
        block_size=bs,
        dtype=torch.bfloat16,
        device=torch.device("cuda"),
    )
    cache.k[0].copy_(torch.randn(cache.shape, generator=g).to(torch.bfloat16))
    cache.v[0].copy_(torch.randn(cache.shape, generator=g).to(torch.bfloat16))
    tables = [[] for _ in lens]
    for step in range(max(need)):
        for i, n in enumerate(need):
            if step < n:
                tables[i] += cache.allocate(1)
    bt = torch.zeros((batch, mb), dtype=torch.long)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    bt = bt.cuda()
    sl = torch.tensor(lens, dtype=torch.long, device="cuda")
    q = torch.randn((batch, H, D), generator=g).to(torch.bfloat16).cuda()
    scale = D**-0.5
    L = mb * bs
    mask = (torch.arange(L, device="cuda")[None] < sl[:, None])[:, None, None]

    def sdpa(qq, k, v):
        kc, vc = (
            k.view(-1, bs, KV, D)[bt].view(batch, L, KV, D),
            v.view(-1, bs, KV, D)[bt].view(batch, L, KV, D),
        )
        o = torch.nn.functional.scaled_dot_product_attention(
            qq.view(batch, KV, H // KV, D),
            kc.transpose(1, 2),
            vc.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
        )
        return o.reshape(batch, H, D)

    ref = sdpa(q.float(), cache.k[0].float(), cache.v[0].float())
    out = {"shape": shape, "batch": batch, "heads": H, "kv_heads": KV, "head_dim": D}
    out["gather_sdpa_ms"] = _graph_time_ms(lambda: sdpa(q, cache.k[0], cache.v[0]))
    variants = {"auto": {}}
    for s in (2, 4, 8, 16):
        variants[f"s{s}"] = {"num_splits": s}
    variants["auto_n64"] = {"block_n": 64}
    variants["auto_w8"] = {"num_warps": 8}
    variants["auto_st3"] = {"num_stages": 3}
    for name, kw in variants.items():

        def call(kw=kw):
            return da.paged_decode_attention(
                q, cache.k[0], cache.v[0], bt, sl, block_size=bs, scale=scale, **kw
            )

        got = call().float()
        err = ((got - ref).norm() / ref.norm()).item()
        out[f"triton_{name}_ms"] = _graph_time_ms(call)
        out[f"triton_{name}_rel_err"] = err
    return out


def _model_dir(path: Path, shape: str) -> None:
    from transformers import Qwen2Config

    from model_zoo.tiny import build_tokenizer

    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 "
    tok = build_tokenizer(alphabet, [alphabet])
    Qwen2Config(
        **config_kwargs(shape),
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        torch_dtype="bfloat16",
    ).save_pretrained(path)
    tok.save_pretrained(path)


def _kernel_summary(fn, n: int = 10) -> dict:
    """torch.profiler over `n` calls of `fn`: kernels and kernel µs per call, the top 15 kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_ctx

    with prof_ctx(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    per: dict[str, list] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            c = per.setdefault(ev.name, [0, 0.0])
            c[0] += 1
            c[1] += ev.device_time_total
    top = sorted(per.items(), key=lambda kv: -kv[1][1])[:15]
    return {
        "kernels_per_step": sum(c for c, _ in per.values()) / n,
        "kernel_us_per_step": sum(u for _, u in per.values()) / n,
        "top_kernels": [
            {"name": k[:120], "calls_per_step": c / n, "us_per_step": u / n} for k, (c, u) in top
        ],
    }


def prefill(shape: str, rows: int, profile: bool, lo: int = 100, hi: int = 400) -> dict:
    """One prefill step of `rows` prompts of lo..hi tokens (a multi-turn fleet's later turns) and the
    logits of their last tokens, as the engine's step runs them: wall ms per step, kernel µs per step (the
    difference is host time between kernels) and the top kernels."""
    from generator_fleet.engine.kv_cache import blocks_for
    from generator_fleet.engine.runner import Runner

    with tempfile.TemporaryDirectory() as d:
        _model_dir(Path(d), shape)
        runner = Runner(d, device="cuda", dtype=torch.bfloat16, load_format="dummy", context_length=hi + 64)
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(lo, hi + 1, (rows,), generator=g).tolist()
    seqs = [torch.randint(3, 150000, (n,), generator=g).tolist() for n in lens]
    bs = runner.cache.block_size
    blocks = [runner.cache.allocate(blocks_for(n + 1, bs)) for n in lens]
    flat = [s for b, n in zip(blocks, lens, strict=True) for s in runner.cache.slots(b, 0, n)]
    slots = torch.tensor(flat, dtype=torch.long, device="cuda")
    last = torch.tensor(lens, device="cuda").cumsum(0) - 1

    def run() -> None:
        with torch.inference_mode():
            h = runner.fwd.prefill(seqs, slots)
            runner.fwd.logits(h[last]).float().argmax(-1).tolist()

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        run()
    ms = (time.perf_counter() - t) / 10 * 1e3
    out = {"shape": shape, "rows": rows, "tokens": sum(lens), "padded": rows * max(lens), "step_ms": ms}
    out["tokens_per_s"] = sum(lens) / ms * 1e3
    if profile:
        out["profile"] = _kernel_summary(run)
    return out


def step(shape: str, concurrency: int, new_tokens: int, profile: bool) -> dict:
    from generator_fleet.engine.request import Request, SamplingParams
    from generator_fleet.engine.runner import Runner

    out: dict = {"shape": shape, "concurrency": concurrency, "new_tokens": new_tokens}
    with tempfile.TemporaryDirectory() as d:
        _model_dir(Path(d), shape)
        t0 = time.perf_counter()
        runner = Runner(
            d,
            device="cuda",
            dtype=torch.bfloat16,
            load_format="dummy",
            max_batch_size=256,
            context_length=160 + new_tokens,
        )
        out["load_s"] = time.perf_counter() - t0
    runner.start()
    g = torch.Generator().manual_seed(0)

    def batch(tag: str, n: int) -> tuple[float, list]:
        prompts = [
            torch.randint(3, 150000, (int(k),), generator=g).tolist()
            for k in torch.randint(96, 161, (concurrency,), generator=g)
        ]
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        torch.cuda.synchronize()
        runner.pause("in_place")
        t = time.perf_counter()
        try:
            futs = [runner.submit(Request(f"{tag}-{i}", p, params)) for i, p in enumerate(prompts)]
        finally:
            runner.resume()
        done = [f.result() for f in futs]
        return time.perf_counter() - t, done

    try:
        batch("warm", new_tokens)  # captures every bucket the timed run uses
        wall, done = batch("timed", new_tokens)
        ttft = max(c.time_to_first_token for c in done)
        out["tokens_per_s"] = concurrency * new_tokens / wall
        out["decode_step_ms"] = (wall - ttft) / (new_tokens - 1) * 1e3
        out["greedy_first_ids"] = done[0].output_ids[:8]
        graphs = runner.graphs
        if graphs is not None and graphs.graphs:
            key = max(k for k in graphs.graphs if k[0] >= concurrency)
            graph = graphs.graphs[key][0]
            out["graph_key"] = list(key)
            times = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(20):
                    graph.replay()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) / 20)
            out["graph_replay_ms"] = statistics.median(times)
            if profile:
                out["profile"] = _kernel_summary(graph.replay)
    finally:
        runner.stop()

        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="attention,step")
    p.add_argument("--shapes", default="qwen2.5-0.5b-shape,qwen2.5-1.5b-shape,qwen2.5-7b-shape")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    res: dict = {"env": {"triton_decode": os.environ.get("SLIPSTREAM_ENGINE_TRITON_DECODE")}, "runs": []}
    for shape in args.shapes.split(","):
        for part in args.parts.split(","):
            t = time.perf_counter()
            try:
                if part == "attention":
                    r = attention(shape, args.concurrency)
                elif part.startswith("prefill"):  # prefill<rows>, e.g. prefill16
                    r = prefill(shape, int(part.removeprefix("prefill") or 16), args.profile)
                else:
                    r = step(shape, args.concurrency, args.new_tokens, args.profile)
            except Exception as exc:  # keep the other measurements
                r = {"shape": shape, "error": repr(exc)}
            r["part"], r["seconds"] = part, time.perf_counter() - t
            res["runs"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "profile"}), flush=True)
            if "profile" in r:
                pr = r["profile"]
                print(
                    f"  kernels {pr['kernels_per_step']:.0f}, {pr['kernel_us_per_step']:.0f} us", flush=True
                )
                for k in pr["top_kernels"][:8]:
                    print(f"    {k['us_per_step']:8.1f} us {k['calls_per_step']:5.0f}x {k['name'][:90]}")
            if args.out:
                args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
