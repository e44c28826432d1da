"""Weight-bus benchmark: one full `WeightBus.publish` of Qwen2.5-shaped bf16 weights to N real built-in
engine processes (`--engines`, default 1), side by side in one run with a raw torch.distributed broadcast
of one flat buffer of the same byte size from the same trainer device to N peers on the engines' devices.

Setup: this process is the trainer on GPU `--trainer-gpu` (0). Engine i (`python -m
generator_fleet.engine --load-format dummy`, random weights initialised from the config on its GPU, so
nothing is saved or loaded) and raw peer i (a plain torch.distributed rank) both run with
CUDA_VISIBLE_DEVICES = the i-th of `--engine-gpus` (default: `--engine-gpu`, 1, for one engine; 1..N for
N). The trainer's weights are random bf16 tensors with the model's real HF names and shapes, already on
the trainer GPU, handed to the bus as a lazy iterator (a trainer with FSDP would gather each one there).
On CPU every engine and peer is a CPU process and both sides run over gloo (`--quick`: a tiny shape).
`--bus-backend ipc`: the bus hands its buckets to the engines by CUDA IPC (CPU: shared memory) through
/update_weights_from_tensor instead of broadcasting them; the raw side stays a broadcast.

  nvidia-h200-x2, one engine:   python benchmarks/weight_bus.py
  nvidia-h200-x4, two engines:  python benchmarks/weight_bus.py --engines 2 --engine-gpus 1,2 --label 2engines

Per model, after one untimed publish (NCCL communicator setup, allocator warm-up; reported as
first_publish_ms) and one untimed raw broadcast, `--repeats` rounds alternate raw and bus:
- raw: one group of world N+1 (rank 0 here, ranks 1..N the raw peers); rank 0 broadcasts one flat uint8
  buffer of the model's byte size to all peers; timed on rank 0 from after a barrier (every rank ready,
  buffers allocated) to the end of the broadcast (device synced).
- bus: wall time of `bus.publish(...)` to all N engines: membership probe, gather/cast/pack of the first
  bucket, pause, every bucket announced over HTTP and broadcast, continue. Its PublishStats give
  transfer_ms (first announcement to last confirmation by every engine) and pause_ms (pause sent to
  continue answered). After the rounds every engine must report the final weight version.
`--lora RANK`: adapter-only publishes (a LoRA job's) next to full-weight ones, same engines, same bus
and group, same base shape: the engines start with `--lora {"rank": RANK}` (every target projection)
and each round publishes the full bf16 weights, then the adapter alone (random bf16 tensors under PEFT's
names, rank RANK on q/k/v/o/gate/up/down of every layer), in alternating order; no raw peers.
ratios.adapter_vs_full_publish = full publish ms / adapter publish ms (medians), adapter_vs_full_pause and
adapter_vs_full_transfer likewise, adapter_bytes_fraction = adapter bytes / full bytes. On one GPU:
`--bus-backend ipc --engine-gpu 0` (colocated: the engine on the trainer's GPU, handles by CUDA IPC):

  nvidia-h200:  python benchmarks/weight_bus.py --lora 16 --bus-backend ipc --engine-gpu 0 \
                  --models qwen2.5-7b-shape --repeats 3 --label lora

Medians over the rounds. bus_vs_raw_broadcast = raw time / bus publish time (= bus bandwidth ÷ raw
bandwidth); transfer_vs_raw_broadcast uses transfer_ms instead of the whole publish. Headline
(benchmarks/README.md): the largest model of the run. Result file: weight_bus-<device>[-<label>]-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from time import perf_counter
from typing import Any

import torch

from benchmarks.common import ResultFile
from benchmarks.shapes import SHAPES, config_kwargs

ROOT = Path(__file__).resolve().parent.parent
MAX_INFLIGHT = 2
"""weight_bus.transfer.MAX_INFLIGHT (not imported here: --help stays instant and the raw peer stays light)."""
TOKENIZER_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 "
"""A throwaway tokenizer for the engine to load (nothing is generated)."""
API_KEY = "weight-bus-bench"
ENGINE_KV_TOKENS = 8192
"""The engine's KV pool: small, so that its GPU keeps room for the raw peer's buffer."""
DEFAULTS = {
    "models": "qwen2.5-0.5b-shape,qwen2.5-1.5b-shape,qwen2.5-7b-shape",
    "repeats": 5,
    "bucket_mb": 512,
}
QUICK = {"models": "tiny", "repeats": 2, "bucket_mb": 4}


def log(msg: str) -> None:
    print(f"[weight-bus-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def child_env(args: argparse.Namespace, gpu: int | None) -> dict[str, str]:
    path = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )  # keep carried wheels
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- model ----------------------------------------------------------------------------------------


def qwen2_config(shape: str):
    from transformers import Qwen2Config

    from model_zoo.tiny import build_tokenizer

    tokenizer = build_tokenizer(TOKENIZER_ALPHABET, [TOKENIZER_ALPHABET])
    cfg = Qwen2Config(
        **config_kwargs(shape),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return cfg, tokenizer


def model_dir(path: Path, shape: str) -> Path:
    """Config and tokenizer only: the engine starts with --load-format dummy."""
    cfg, tokenizer = qwen2_config(shape)
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def trainer_weights(shape: str, device: torch.device, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Random bf16 tensors with the model's HF names and shapes (tied weights once, as a trainer's
    named_parameters gives them), created on `device`."""
    from transformers import AutoModelForCausalLM

    cfg, _ = qwen2_config(shape)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    return [
        (name, torch.randn(p.shape, dtype=torch.bfloat16, device=device, generator=gen))
        for name, p in meta.named_parameters()
    ]


# --- processes ------------------------------------------------------------------------------------


def engine_argv(args: argparse.Namespace, path: Path) -> list[str]:
    """The flags of the benchmark's engines (`python -m generator_fleet.engine ...`): random weights, bf16."""
    argv = ["--model", str(path), "--port", "0", "--api-key", API_KEY, "--load-format", "dummy"]
    argv += ["--dtype", "bfloat16", "--log-level", "WARNING", "--kv-cache-tokens", str(ENGINE_KV_TOKENS)]
    argv += ["--max-batch-size", "8", "--context-length", "2048"]
    if getattr(args, "lora", None):
        argv += ["--lora", json.dumps({"rank": args.lora})]
    if args.device == "cuda":
        argv += ["--device", "cuda", "--disable-cuda-graph"]
    else:
        argv += ["--device", "cpu", "--torch-threads", "1"]
    return argv


class EngineProcess:
    """A built-in engine with random weights on `gpu` (None: CPU); started here, ready after wait_ready()
    (so that several engines boot at once)."""

    def __init__(self, args: argparse.Namespace, path: Path, log_path: Path, gpu: int | None) -> None:
        cmd = [sys.executable, "-m", "generator_fleet.engine", *engine_argv(args, path)]
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in stop())
        self.t0 = perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=child_env(args, gpu), cwd=ROOT
        )
        self.url = ""
        self.start_s = float("nan")

    def wait_ready(self) -> None:
        # readline returns when the engine is ready or dead; the job's limit bounds the rest
        line = "-"
        while line and not line.startswith("engine ready at "):  # "engine ready at URL"; "" if it died
            line = self.proc.stdout.readline()
        if not line:
            self.stop()
            tail = self.log_path.read_text()[-2000:]
            raise RuntimeError(f"engine did not start ({line!r}); log tail:\n{tail}")
        self.url = line.split()[-1]
        self.start_s = perf_counter() - self.t0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(60)
        self.log.close()


def start_engines(args: argparse.Namespace, path: Path, tmp: Path, shape: str) -> list[EngineProcess]:
    """One engine per engine GPU (CPU: `--engines` CPU processes), all booting at once; ready on return."""
    engines: list[EngineProcess] = []
    try:
        for i, gpu in enumerate(args.engine_gpus):
            engines.append(EngineProcess(args, path, tmp / f"engine-{shape}-{i}.log", gpu))
        for e in engines:
            e.wait_ready()
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines


class RawPeers:
    """Ranks 1..N of a plain group of world N+1 (`--raw-peer` mode of this script), peer i on engine i's
    device; rank 0 is this process on the trainer device. The peers receive broadcasts of whatever size
    rank 0 announces, until told to stop."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        from common.net import free_port

        self.device = (
            torch.device(args.device, args.trainer_gpu) if args.device == "cuda" else torch.device("cpu")
        )
        self.backend = "nccl" if args.device == "cuda" else "gloo"
        self.world_size = len(args.engine_gpus) + 1
        self.port = free_port()
        # Peers wait for each measurement's header on the host (a store), not in a posted NCCL receive: a
        # receive kernel left spinning on an engine's GPU would share that GPU with the engine's own
        # receive while the bus is timed (halving it, measured 2026-11-28 on nvidia-h200-x4).
        from weight_bus.group import tcp_store

        self.header_port = free_port()
        self.store = tcp_store("127.0.0.1", self.header_port, self.world_size, True, 600)
        self.seq = 0
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        for rank, gpu in enumerate(args.engine_gpus, start=1):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--raw-peer", str(self.port)]
            cmd += ["--raw-header-port", str(self.header_port)]
            cmd += [
                "--raw-rank",
                str(rank),
                "--raw-world-size",
                str(self.world_size),
                "--device",
                args.device,
            ]
            self.logs.append(open(tmp / f"raw-peer-{rank}.log", "w"))  # noqa: SIM115 (closed in stop())
            self.procs.append(
                subprocess.Popen(
                    cmd, stdout=self.logs[-1], stderr=subprocess.STDOUT, env=child_env(args, gpu), cwd=ROOT
                )
            )
        self.group = None  # joined at first use: the peers boot while the first engines do
        self.buf: torch.Tensor | None = None

    def _header(self, nbytes: int, chunk: int = 0) -> None:
        from weight_bus.group import new_group

        self.store.set(f"raw/{self.seq}", f"{nbytes},{chunk}")
        self.seq += 1
        if self.group is None and nbytes:
            self.group = new_group(
                "127.0.0.1", self.port, 0, self.world_size, self.backend, "raw", timeout_s=600
            )
            log(f"raw peers joined ({self.backend}, world {self.world_size})")

    def _barrier(self) -> None:
        t = torch.zeros(1, device=self.device)
        self.group.allreduce([t]).wait()
        sync(self.device)

    def measure(self, nbytes: int, chunk: int = 0) -> float:
        """Seconds for one broadcast of `nbytes` from rank 0 to every peer, all ranks ready; `chunk` > 0:
        as back-to-back broadcasts of that many bytes each (what a bucketed transfer can reach)."""
        if self.buf is None or self.buf.numel() != nbytes:
            self.buf = None
            self.buf = torch.ones(nbytes, dtype=torch.uint8, device=self.device)
        self._header(nbytes, chunk)
        self._barrier()
        t0 = perf_counter()
        broadcast_chunks(self.group, self.buf, chunk)
        sync(self.device)
        return perf_counter() - t0

    def stop(self) -> None:
        try:
            if self.group is None:
                raise RuntimeError("never joined")
            self._header(0)
            for proc in self.procs:
                proc.wait(60)
        except Exception:  # noqa: BLE001 - tearing down either way
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(60)
        self.buf = None
        for f in self.logs:
            f.close()


def broadcast_chunks(group, buf: torch.Tensor, chunk: int) -> None:
    """One broadcast of `buf`, or (chunk > 0) one per `chunk` bytes of it, issued back to back."""
    from weight_bus.group import broadcast_async

    step = chunk or buf.numel()
    works = [broadcast_async(group, buf[i : i + step]) for i in range(0, buf.numel(), step)]
    for w in works:
        w.wait()


def raw_peer_main(port: int, header_port: int, rank: int, world_size: int, device_type: str) -> None:
    from weight_bus.group import new_group, tcp_store

    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    backend = "nccl" if device_type == "cuda" else "gloo"
    store = tcp_store("127.0.0.1", header_port, world_size, False, 600)
    group = None
    buf = None
    seq = 0
    while True:
        nbytes, chunk = (int(x) for x in store.get(f"raw/{seq}").decode().split(","))
        seq += 1
        if nbytes == 0:
            return
        if group is None:
            group = new_group("127.0.0.1", port, rank, world_size, backend, "raw", timeout_s=600)
        if buf is None or buf.numel() != nbytes:
            buf = None
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        t = torch.zeros(1, device=device)
        group.allreduce([t]).wait()
        broadcast_chunks(group, buf, chunk)
        if device.type == "cuda":
            torch.cuda.synchronize(device)


# --- the run --------------------------------------------------------------------------------------


def env_info(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "host_load_1m_start": os.getloadavg()[0],
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
    }
    if args.device == "cuda":
        info["device_name"] = torch.cuda.get_device_name(args.trainer_gpu)
        info["device_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        info["device_name"] = platform.processor() or "cpu"
    return info


def phase_totals(url: str) -> dict[str, tuple[float, float]]:
    """(sum seconds, count) of each phase of the engine's slipstream_engine_weight_bucket_seconds, from
    its /metrics (all weight loads of this engine so far)."""
    import httpx

    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'slipstream_engine_weight_bucket_seconds_(sum|count)\{.*phase="(\w+)".*\} (\S+)', line)
        if m:
            (sums if m[1] == "sum" else counts)[m[2]] = float(m[3])
    return {ph: (sums[ph], counts.get(ph, 0.0)) for ph in sums}


def engine_phases(url: str) -> dict[str, float]:
    """Mean host ms per bucket of each weight-load phase, from the engine's /metrics (all publishes of
    this engine, the untimed first included)."""
    return {ph: round(s / n * 1e3, 3) for ph, (s, n) in phase_totals(url).items() if n}


def adapter_weights(shape: str, rank: int, device: torch.device, seed: int) -> list[tuple[str, torch.Tensor]]:
    """A LoRA adapter of `rank` on every target projection of every layer, as Learner.adapter_tensors
    yields it (PEFT's saved names, lora_A [r, in], lora_B [out, r]): random bf16 on `device`."""
    from generator_fleet.engine.lora import module_dims
    from models.config import LORA_TARGETS

    cfg, _ = qwen2_config(shape)
    dims = module_dims(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for i in range(cfg.num_hidden_layers):
        for mod in LORA_TARGETS:
            block = "mlp" if mod in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{i}.{block}.{mod}"
            fan_in, fan_out = dims[mod]
            for ab, shp in (("A", (rank, fan_in)), ("B", (fan_out, rank))):
                t = torch.randn(shp, dtype=torch.bfloat16, device=device, generator=gen)
                out.append((f"{prefix}.lora_{ab}.weight", t))
    return out


def make_bus(args, urls: list[str], device):
    """The bus every run of this benchmark publishes through."""
    from weight_bus import WeightBus

    return WeightBus(
        urls,
        api_key=API_KEY,
        backend=args.bus_backend,
        bucket_bytes=args.bucket_mb * 2**20,
        timeout_s=args.timeout_s,
        device=device,
        max_inflight=args.max_inflight,
    )


def measure_lora(args, shape: str, tmp: Path, device: torch.device) -> dict[str, Any]:
    """`--lora`: full-weight and adapter-only publishes to the same engines over the same bus, alternating."""
    import httpx

    from models.config import LoraSpec

    med = statistics.median
    m: dict[str, Any] = {}
    params = trainer_weights(shape, device, args.seed)
    adapter = adapter_weights(shape, args.lora, device, args.seed + 1)
    spec = LoraSpec(rank=args.lora, alpha=2.0 * args.lora)
    sizes = {
        "full": sum(t.numel() * t.element_size() for _, t in params),
        "adapter": sum(t.numel() * t.element_size() for _, t in adapter),
    }
    m["bytes"], m["adapter_bytes"] = sizes["full"], sizes["adapter"]
    m["tensors"], m["adapter_tensors"] = len(params), len(adapter)
    log(
        f"{shape}: full {sizes['full'] / 2**30:.2f} GiB, adapter rank {args.lora} {sizes['adapter'] / 2**20:.2f} MiB"
    )
    engines = start_engines(args, model_dir(tmp / shape, shape), tmp, shape)
    urls = [e.url for e in engines]
    m["engine_start_s"] = max(e.start_s for e in engines)
    bus = make_bus(args, urls, device)
    times: dict[str, dict[str, list[float]]] = {
        k: {"publish": [], "transfer": [], "pause": []} for k in sizes
    }
    version = 0

    def publish(kind: str, timed: bool) -> None:
        nonlocal version
        version += 1
        # one bus and one group for both kinds: only the payload (and the engine route) differs
        bus.transfer.lora = spec if kind == "adapter" else None
        t0 = perf_counter()
        stats = bus.publish(iter(adapter if kind == "adapter" else params), version=version)
        dt = perf_counter() - t0
        # a streamed full update sends the engines' whole arena: its tensors plus the gaps between them
        if sorted(stats.engines) != sorted(urls) or stats.bytes < sizes[kind] or stats.kind != kind:
            raise RuntimeError(
                f"{kind} publish reached {stats.engines} with {stats.bytes} bytes ({stats.kind})"
            )
        if timed:
            times[kind]["publish"].append(dt * 1e3)
            times[kind]["transfer"].append(stats.transfer_ms)
            times[kind]["pause"].append(stats.pause_ms)
        else:
            m[f"{kind}_first_publish_ms"] = dt * 1e3

    try:
        bus.connect()
        publish("full", timed=False)  # untimed: communicator setup, allocator warm-up, the ring
        publish("adapter", timed=False)
        for r in range(args.repeats):
            for kind in ("full", "adapter") if r % 2 == 0 else ("adapter", "full"):
                publish(kind, timed=True)
            log(
                f"{shape} round {r + 1}/{args.repeats}: full {times['full']['publish'][-1]:.2f} ms "
                f"(pause {times['full']['pause'][-1]:.2f}), adapter {times['adapter']['publish'][-1]:.2f} ms "
                f"(pause {times['adapter']['pause'][-1]:.2f})"
            )
        m["final_version"] = version
        m["engine_weight_versions"] = [
            httpx.get(u + "/get_model_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()[
                "weight_version"
            ]
            for u in urls
        ]
        if m["engine_weight_versions"] != [str(version)] * len(urls):
            raise RuntimeError(f"engines at versions {m['engine_weight_versions']}, expected {version}")
    finally:
        bus.close()
        for e in engines:
            e.stop()
        params.clear()  # the tensors go before the next shape's are made
        adapter.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for kind in sizes:
        prefix = "" if kind == "full" else "adapter_"
        for what in ("publish", "transfer", "pause"):
            m[f"{prefix}{what}_ms"] = med(times[kind][what])
            m[f"{prefix}{what}_ms_all"] = times[kind][what]
    m["adapter_vs_full_publish"] = m["publish_ms"] / m["adapter_publish_ms"]
    m["adapter_vs_full_transfer"] = m["transfer_ms"] / m["adapter_transfer_ms"]
    m["adapter_vs_full_pause"] = m["pause_ms"] / m["adapter_pause_ms"]
    m["adapter_bytes_fraction"] = sizes["adapter"] / sizes["full"]
    return m


LORA_RATIOS = (
    "adapter_vs_full_publish",
    "adapter_vs_full_transfer",
    "adapter_vs_full_pause",
    "adapter_bytes_fraction",
)


def publish_variant(bus, variant: str, params, version: int):
    """One publish of `params` the way `variant` says: "bus" (the default: streamed once the trainer's
    tensors are known, in place), "per_bucket" (SGLang's protocol: an HTTP call and an engine copy per
    bucket, with pause and continue around them), "staged" (streamed beside the serving weights)."""
    bus.transfer.stream = variant != "per_bucket"
    bus.transfer.stage = variant == "staged"
    try:
        return bus.publish(iter(params), version=version)
    finally:
        bus.transfer.stream, bus.transfer.stage = True, False


def profile_publish(bus, params, version: int, trace: Path) -> list[list]:
    """One more default publish under torch.profiler (CPU and CUDA activity on the trainer's process):
    its Chrome trace to `trace`, and each GPU kernel's [name, start ms, duration ms] (from the first) back."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        bus.publish(iter(params), version=version)
        torch.cuda.synchronize()
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    if not kernels:
        return []
    t0 = min(e.time_range.start for e in kernels)
    rows = sorted(
        [
            e.name[:60],
            round((e.time_range.start - t0) / 1e3, 3),
            round((e.time_range.end - e.time_range.start) / 1e3, 3),
        ]
        for e in kernels
    )
    rows.sort(key=lambda r: r[1])
    for r in rows:
        if "nccl" in r[0].lower() or r[2] > 0.05:
            log(f"profile: {r[1]:9.3f} ms  {r[2]:8.3f} ms  {r[0]}")
    return rows


def measure_model(args, shape: str, tmp: Path, raw: RawPeers, result: dict, save) -> dict[str, Any]:

    device = raw.device
    m: dict[str, Any] = {}
    t0 = perf_counter()
    params = trainer_weights(shape, device, args.seed)
    nbytes = sum(t.numel() * t.element_size() for _, t in params)
    m["bytes"] = nbytes
    m["tensors"] = len(params)
    log(
        f"{shape}: {len(params)} tensors, {nbytes / 2**30:.2f} GiB bf16 on {device} ({perf_counter() - t0:.1f}s)"
    )
    engines = start_engines(args, model_dir(tmp / shape, shape), tmp, shape)
    urls = [e.url for e in engines]
    m["engine_start_s"] = max(e.start_s for e in engines)  # booted at once: until the last is ready
    m["engine_start_s_per_engine"] = [e.start_s for e in engines]
    log(f"{shape}: {len(engines)} engine(s) at {urls} after {m['engine_start_s']:.1f}s")
    bus = make_bus(args, urls, device)
    try:
        bus.connect()
        t0 = perf_counter()
        first = bus.publish(iter(params), version=1)
        m["first_publish_ms"] = (perf_counter() - t0) * 1e3
        m["buckets"] = first.buckets
        log(
            f"{shape}: first publish {m['first_publish_ms']:.1f} ms ({first.buckets} buckets; communicator setup)"
        )
        raw.measure(nbytes)  # untimed: the peer allocates its buffer
        variants = ["bus"] + (
            [] if args.bus_backend == "ipc" or args.no_variants else ["per_bucket", "staged"]
        )
        for v in variants[1:]:  # untimed: a staged engine allocates its staging arena at its first one
            publish_variant(bus, v, params, version=1)
        raw_s: list[float] = []
        raw_chunked_s: list[float] = []
        phases: list[dict[str, float]] = []  # the bus publishes' PublishStats.phases_ms
        timed: dict[str, dict[str, list[float]]] = {
            v: {"s": [], "transfer": [], "pause": [], "gather": []} for v in variants
        }
        version = 1
        for r in range(args.repeats):
            sides = ["raw", "raw_chunked", *variants]
            sides = sides[r % len(sides) :] + sides[: r % len(sides)]  # each side first in turn
            for side in sides:
                if side == "raw":
                    raw_s.append(raw.measure(nbytes))
                    continue
                if side == "raw_chunked":
                    raw_chunked_s.append(raw.measure(nbytes, args.bucket_mb * 2**20))
                    continue
                version += 1
                t0 = perf_counter()
                stats = publish_variant(bus, side, params, version)
                took = perf_counter() - t0
                for k, x in (
                    ("s", took),
                    ("transfer", stats.transfer_ms),
                    ("pause", stats.pause_ms),
                    ("gather", stats.gather_ms),
                ):
                    timed[side][k].append(x)
                if sorted(stats.engines) != sorted(urls) or stats.bytes < nbytes:
                    raise RuntimeError(f"publish reached {stats.engines} with {stats.bytes} bytes")
                if side == "bus":
                    phases.append(stats.phases_ms)
                    m["stream"] = stats.stream
                    m["engine_marks_last"] = (
                        stats.engine_marks
                    )  # taken up, held, posted, all posted, done, answered
                    m["timeline_last"] = stats.timeline  # per bucket: [index, launched, sent, answered] ms
            log(
                f"{shape} round {r + 1}/{args.repeats}: raw {raw_s[-1] * 1e3:.2f} ms, "
                + ", ".join(
                    f"{v} {timed[v]['s'][-1] * 1e3:.2f} ms (pause {timed[v]['pause'][-1]:.2f})"
                    for v in variants
                )
            )
        bus_s, transfer_ms, pause_ms, gather_ms = (
            timed["bus"][k] for k in ("s", "transfer", "pause", "gather")
        )
        m["publish_phases_ms"] = (
            {k: statistics.median(p[k] for p in phases) for k in phases[0]} if phases else {}
        )
        log(f"{shape}: bus publish phases (ms, median): {m['publish_phases_ms']}")
        if args.profile:
            m["profile"] = profile_publish(
                bus, params, version + 1, Path(args.out_dir) / f"profile-{shape}.json"
            )
            version += 1
        m["raw_chunked_ms"] = statistics.median(raw_chunked_s) * 1e3
        m["raw_chunked_vs_raw"] = statistics.median(raw_s) / statistics.median(raw_chunked_s)
        log(
            f"{shape}: raw in {args.bucket_mb} MiB chunks {m['raw_chunked_ms']:.2f} ms ({m['raw_chunked_vs_raw']:.3f} of one broadcast)"
        )
        for v in variants[1:]:
            med = statistics.median
            m[v] = {
                "publish_ms": med(timed[v]["s"]) * 1e3,
                "transfer_ms": med(timed[v]["transfer"]),
                "pause_ms": med(timed[v]["pause"]),
                "vs_raw_broadcast": med(raw_s) / med(timed[v]["s"]),
                "publish_ms_all": [x * 1e3 for x in timed[v]["s"]],
            }
            log(
                f"{shape}: {v} {m[v]['publish_ms']:.2f} ms ({m[v]['vs_raw_broadcast']:.3f} of raw), pause {m[v]['pause_ms']:.2f} ms"
            )
        import httpx

        m["final_version"] = version
        m["engine_weight_versions"] = [
            httpx.get(u + "/get_model_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()[
                "weight_version"
            ]
            for u in urls
        ]
        if m["engine_weight_versions"] != [str(m["final_version"])] * len(urls):
            raise RuntimeError(
                f"engines at versions {m['engine_weight_versions']}, expected {m['final_version']}"
            )
        per_engine = [engine_phases(u) for u in urls]
        m["engine_bucket_phase_ms_per_engine"] = per_engine  # in --engine-gpus order
        m["engine_bucket_phase_ms"] = {  # mean over the engines (one engine: its own)
            ph: round(statistics.fmean(p[ph] for p in per_engine), 3)
            for ph in per_engine[0]
            if all(ph in p for p in per_engine)
        }
        for i, p in enumerate(per_engine):
            log(f"{shape}: engine {i} host time per bucket (ms, mean): {p}")
    finally:
        bus.close()
        for e in engines:
            e.stop()
        del params
        if device.type == "cuda":
            torch.cuda.empty_cache()
    med = statistics.median
    m |= {
        "raw_ms": med(raw_s) * 1e3,
        "raw_gb_per_s": nbytes / med(raw_s) / 1e9,
        "bus_publish_ms": med(bus_s) * 1e3,
        "bus_gb_per_s": nbytes / med(bus_s) / 1e9,
        "transfer_ms": med(transfer_ms),
        "pause_ms": med(pause_ms),
        "gather_ms": med(gather_ms),
        "pause_minus_transfer_ms": med(p - t for p, t in zip(pause_ms, transfer_ms, strict=True)),
        "raw_ms_all": [x * 1e3 for x in raw_s],
        "bus_publish_ms_all": [x * 1e3 for x in bus_s],
        "transfer_ms_all": transfer_ms,
        "pause_ms_all": pause_ms,
    }
    m["bus_vs_raw_broadcast"] = med(raw_s) / med(bus_s)
    m["transfer_vs_raw_broadcast"] = med(raw_s) * 1e3 / med(transfer_ms)
    return m


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    if args.device == "cuda":
        torch.cuda.set_device(args.trainer_gpu)
    models = args.models.split(",")
    rf = ResultFile(
        "weight_bus",
        args.device_kind,
        argv,
        args.out_dir,
        label=args.label,
        config={
            "models": models,
            "shapes": {s: SHAPES[s] for s in models},
            "dtype": "bfloat16",
            "device": args.device,
            "backend": args.bus_backend,
            "raw_backend": "nccl" if args.device == "cuda" else "gloo",
            "trainer_gpu": args.trainer_gpu if args.device == "cuda" else None,
            "engines": args.engines,
            "engine_gpu": args.engine_gpus[0] if args.device == "cuda" and args.engines == 1 else None,
            "engine_gpus": args.engine_gpus if args.device == "cuda" else None,
            "raw_world_size": args.engines + 1,
            "label": args.label,
            "bucket_bytes": args.bucket_mb * 2**20,
            "max_inflight": args.max_inflight,
            "repeats": args.repeats,
            "pause_mode": "in_place",
            "lora_rank": args.lora,
            "lora_targets": "q/k/v/o/gate/up/down" if args.lora else None,
            "engine": "built-in, --load-format dummy, one process per engine",
            "env": env_info(args),
        },
    )
    result, save = rf.result, rf.save

    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="weight-bus-bench-") as tmp:
        tmp = Path(tmp)
        raw = None

        def stop_raw() -> None:
            if raw is not None:
                raw.stop()

        with rf.recording(log, t_start, stop_raw):
            if not args.lora:
                raw = RawPeers(args, tmp)
            device = torch.device("cuda", args.trainer_gpu) if args.device == "cuda" else torch.device("cpu")
            for shape in models:
                try:
                    if args.lora:
                        m = measure_lora(args, shape, tmp, device)
                    else:
                        m = measure_model(args, shape, tmp, raw, result, save)
                except Exception as exc:  # noqa: BLE001 - recorded; the next model still runs
                    log(f"{shape} FAILED: {exc!r}")
                    result["errors"].append(
                        {
                            "model": shape,
                            "error": repr(exc),
                            "traceback": traceback.format_exception(exc)[-3:],
                        }
                    )
                    save()
                    continue
                if args.lora:
                    result["metrics"] |= {f"{shape}_{k}": v for k, v in m.items() if k not in LORA_RATIOS}
                    result["ratios"] |= {f"{shape}_{k}": m[k] for k in LORA_RATIOS}
                    result["ratios"] |= {k: m[k] for k in LORA_RATIOS}  # headline: the last (largest) shape
                    result["config"]["headline_model"] = shape
                    for k in ("pause_ms", "transfer_ms", "adapter_pause_ms", "adapter_transfer_ms"):
                        result["metrics"][k] = m[k]
                    save()
                    continue
                result["metrics"] |= {f"{shape}_{k}": v for k, v in m.items() if "vs_raw" not in k}
                result["ratios"] |= {f"{shape}_{k}": v for k, v in m.items() if "vs_raw" in k}
                # headline: the largest model measured so far (the last one, in the default order)
                result["config"]["headline_model"] = shape
                result["ratios"]["bus_vs_raw_broadcast"] = m["bus_vs_raw_broadcast"]
                result["ratios"]["transfer_vs_raw_broadcast"] = m["transfer_vs_raw_broadcast"]
                result["metrics"]["pause_ms"] = m["pause_ms"]
                result["metrics"]["transfer_ms"] = m["transfer_ms"]
                save()
    return result


def report_lora(result: dict) -> str:
    m, r, cfg = result["metrics"], result["ratios"], result["config"]
    lines = [
        f"adapter-only (LoRA rank {cfg['lora_rank']}) vs full-weight publish to {cfg['engines']} engine(s) on "
        f"{result['device']} ({cfg['env']['device_name']}, {cfg['backend']}), bf16, median of {cfg['repeats']}",
        f"{'model':<20} {'full MiB':>9} {'adapter MiB':>11} {'full ms':>8} {'adapter ms':>10} {'full pause':>10} "
        f"{'adapter pause':>13} {'speedup':>8}",
    ]
    for s in cfg["models"]:
        if f"{s}_adapter_publish_ms" not in m:
            continue
        lines.append(
            f"{s:<20} {m[f'{s}_bytes'] / 2**20:>9.1f} {m[f'{s}_adapter_bytes'] / 2**20:>11.2f} "
            f"{m[f'{s}_publish_ms']:>8.2f} {m[f'{s}_adapter_publish_ms']:>10.2f} {m[f'{s}_pause_ms']:>10.2f} "
            f"{m[f'{s}_adapter_pause_ms']:>13.2f} {r[f'{s}_adapter_vs_full_publish']:>8.2f}"
        )
    for e in result["errors"]:
        lines.append(f"ERROR {e['model']}: {e['error']}")
    if cfg.get("headline_model") is not None:
        lines.append(
            f"weight_bus adapter_vs_full_publish={r['adapter_vs_full_publish']:.2f} "
            f"adapter_pause_ms={m['adapter_pause_ms']:.2f} pause_ms={m['pause_ms']:.2f} "
            f"adapter_bytes_fraction={r['adapter_bytes_fraction']:.4f} "
            f"(model={cfg['headline_model']}, rank={cfg['lora_rank']}, device={result['device']})"
        )
    return "\n".join(lines)


def report(result: dict) -> str:
    m, r, cfg = result["metrics"], result["ratios"], result["config"]
    if cfg.get("lora_rank"):
        return report_lora(result)
    lines = [
        f"weight bus to {cfg['engines']} engine(s) vs raw broadcast to as many peers on {result['device']} "
        f"({cfg['env']['device_name']}, {cfg['backend']}), bf16, buckets of {cfg['bucket_bytes'] / 2**20:.0f} MiB, "
        f"median of {cfg['repeats']}",
        f"{'model':<20} {'GiB':>6} {'raw ms':>8} {'raw GB/s':>9} {'bus ms':>8} {'bus GB/s':>9} {'bus/raw':>8} "
        f"{'transfer':>9} {'pause':>8} {'1st ms':>8}",
    ]
    for s in cfg["models"]:
        if f"{s}_bytes" not in m or f"{s}_raw_ms" not in m:
            continue
        lines.append(
            f"{s:<20} {m[f'{s}_bytes'] / 2**30:>6.2f} {m[f'{s}_raw_ms']:>8.2f} {m[f'{s}_raw_gb_per_s']:>9.1f} "
            f"{m[f'{s}_bus_publish_ms']:>8.2f} {m[f'{s}_bus_gb_per_s']:>9.1f} {r[f'{s}_bus_vs_raw_broadcast']:>8.3f} "
            f"{m[f'{s}_transfer_ms']:>9.2f} {m[f'{s}_pause_ms']:>8.2f} {m[f'{s}_first_publish_ms']:>8.1f}"
        )
    for e in result["errors"]:
        lines.append(f"ERROR {e['model']}: {e['error']}")
    head = cfg.get("headline_model")
    if head is not None:
        lines.append(
            f"weight_bus bus_vs_raw_broadcast={r['bus_vs_raw_broadcast']:.3f} pause_ms={m['pause_ms']:.2f} "
            f"transfer_ms={m['transfer_ms']:.2f} (model={head}, engines={cfg['engines']}, device={result['device']})"
        )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", help=f"comma-separated of {sorted(SHAPES)} (default {DEFAULTS['models']})")
    p.add_argument("--repeats", type=int, help=f"timed rounds per model (default {DEFAULTS['repeats']})")
    p.add_argument("--bucket-mb", type=int, help=f"bus bucket size in MiB (default {DEFAULTS['bucket_mb']})")
    p.add_argument(
        "--max-inflight", type=int, default=MAX_INFLIGHT, help="unconfirmed buckets at a time (bus default)"
    )
    p.add_argument("--quick", action="store_true", help=f"CPU smoke defaults: {QUICK}")
    p.add_argument("--profile", action="store_true", help="one more publish per model under torch.profiler")
    p.add_argument(
        "--no-variants",
        action="store_true",
        help="time only the default publish (not also SGLang's per-bucket protocol and the staged update)",
    )
    p.add_argument(
        "--lora",
        type=int,
        metavar="RANK",
        help="adapter-only publishes of a rank-RANK LoRA adapter beside full-weight ones (no raw peers)",
    )
    p.add_argument(
        "--bus-backend",
        choices=["gloo", "nccl", "ipc"],
        help="the bus's backend (default: nccl on cuda, gloo on cpu; ipc: buckets handed over by CUDA IPC / "
        "shared memory, the engines on this host)",
    )
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"]
    )
    p.add_argument("--engines", type=int, default=1, help="engines the bus publishes to (and raw peers)")
    p.add_argument("--trainer-gpu", type=int, default=0)
    p.add_argument("--engine-gpu", type=int, help="the engine's GPU with one engine (default 1)")
    p.add_argument(
        "--engine-gpus", help="comma-separated, one GPU per engine (default: --engine-gpu for one, else 1..N)"
    )
    p.add_argument("--label", help="suffix of the result file name: weight_bus-<device>-<label>-<date>.json")
    p.add_argument("--device-kind", help="for the result file name (default: from the GPU name and count)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="the bus's bound on calls and collectives")
    p.add_argument("--engine-timeout-s", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--raw-peer", type=int, help=argparse.SUPPRESS)  # internal: run as a raw peer
    p.add_argument("--raw-header-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--raw-rank", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--raw-world-size", type=int, default=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.raw_peer is not None:
        return args
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.bus_backend is None:
        args.bus_backend = "nccl" if args.device == "cuda" else "gloo"
    unknown = set(args.models.split(",")) - set(SHAPES)
    if unknown:
        p.error(f"unknown models {sorted(unknown)}")
    if args.engines < 1:
        p.error("--engines must be at least 1")
    if args.label is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", args.label):
        p.error(f"--label {args.label!r}: letters, digits, ., _ and - only")
    args.engine_gpus = engine_gpus(p, args)
    if args.device_kind is None:
        if args.device == "cuda":
            name = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
            n = torch.cuda.device_count()
            args.device_kind = f"{name}-x{n}" if n > 1 else name
        else:
            args.device_kind = "cpu"
    return args


def engine_gpus(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[int | None]:
    """One GPU per engine (and its raw peer); on CPU, None for each (CPU processes)."""
    if args.device != "cuda":
        return [None] * args.engines
    if args.engine_gpus is not None:
        if args.engine_gpu is not None:
            p.error("give --engine-gpu or --engine-gpus, not both")
        gpus = [int(g) for g in args.engine_gpus.split(",")]
    elif args.engines == 1:
        gpus = [1 if args.engine_gpu is None else args.engine_gpu]
    elif args.engine_gpu is not None:
        p.error("--engine-gpu names one engine's GPU: with --engines N > 1 give --engine-gpus")
    else:
        gpus = list(range(1, args.engines + 1))
    # ipc with --lora needs no raw peer: an engine may share the trainer's GPU (colocated)
    shared = args.bus_backend == "ipc" and bool(args.lora)
    if len(gpus) != args.engines or len(set(gpus)) != len(gpus) or (args.trainer_gpu in gpus and not shared):
        p.error(f"--engine-gpus {gpus}: need {args.engines} distinct GPUs other than the trainer's")
    return gpus


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent machines
    args = parse_args(argv)
    if args.raw_peer is not None:
        raw_peer_main(args.raw_peer, args.raw_header_port, args.raw_rank, args.raw_world_size, args.device)
        return None
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    result = run(args, argv)
    print(report(result), flush=True)
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
