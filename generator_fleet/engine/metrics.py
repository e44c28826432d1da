"""Prometheus metrics of the built-in engine: SGLang's `sglang:*` names (the subset it can measure, labelled
`model_name`) plus `slipstream_engine_*`, in a registry per engine so several engines share a process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from generator_fleet.engine.grammar import KINDS as GRAMMAR_KINDS
from generator_fleet.engine.memory import TAGS
from generator_fleet.engine.request import RunnerStats
from generator_fleet.engine.runner import Runner

# SGLang's default latency buckets are for GPU serving; these also resolve a tiny CPU model's milliseconds.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
GRAMMAR_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
PAUSE_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class _SchedulerCollector(Collector):
    """Reads the runner's state at scrape time, so gauges are never stale and the runner stays free of
    prometheus code."""

    def __init__(self, runner: Runner, model_name: str, waiting_at_gate: Callable[[], int]) -> None:
        self.runner = runner
        self.model_name = model_name
        self.waiting_at_gate = waiting_at_gate

    # Long: one sample per SGLang metric name, in the order SGLang's /metrics lists them
    def collect(self) -> Iterator[Metric]:
        snap = self.runner.snapshot()
        stats: RunnerStats = self.runner.stats
        gauges: dict[str, tuple[str, Any]] = {
            "num_running_reqs": ("Requests in the running batch.", snap["num_running_reqs"]),
            "num_queue_reqs": (
                "Requests waiting for a batch (incl. calls held by a pause).",
                snap["num_queue_reqs"] + self.waiting_at_gate(),
            ),
            "num_paused_reqs": ("Running requests parked by an in-place pause.", snap["num_paused_reqs"]),
            "gen_throughput": (
                "Generation throughput of the last decode step (tokens/s).",
                stats.gen_throughput,
            ),
            "max_total_num_tokens": ("Tokens the paged KV pool holds.", snap["max_total_num_tokens"]),
            "num_used_tokens": (
                "KV pool tokens held by running requests (whole blocks).",
                snap["num_used_tokens"],
            ),
            "token_usage": ("Fraction of the KV pool in use.", snap["token_usage"]),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(f"sglang:{name}", doc, labels=["model_name"])
            g.add_metric([self.model_name], float(value))
            yield g
        try:  # versions the bus publishes are integers; an engine started from a checkpoint path is not
            version = float(int(snap["weight_version"]))
        except (TypeError, ValueError):
            version = float("nan")
        g = GaugeMetricFamily(
            "slipstream_engine_weight_version",
            "Weight version this engine generates with (the trainer's version minus this: versions behind).",
            labels=["model_name"],
        )
        g.add_metric([self.model_name], version)
        yield g
        g = GaugeMetricFamily(
            "slipstream_engine_prefix_cache_tokens",
            "Tokens whose K/V the prefix cache holds for later requests (whole blocks; given back first "
            "when the pool runs short).",
            labels=["model_name"],
        )
        g.add_metric([self.model_name], float(snap["prefix_cached_tokens"]))
        yield g
        g = GaugeMetricFamily(
            "slipstream_engine_healthy",
            "1 while the engine serves; 0 once a fatal CUDA error made it unhealthy (it then exits).",
            labels=["model_name"],
        )
        g.add_metric([self.model_name], 0.0 if self.runner.fatal is not None else 1.0)
        yield g
        g = GaugeMetricFamily(
            "slipstream_engine_memory_released",
            "1 while this memory (tag: kv_cache, weights, cuda_graph) is released by "
            "/release_memory_occupation; generation waits while any is.",
            labels=["model_name", "tag"],
        )
        released = self.runner.released
        for tag in TAGS:
            g.add_metric([self.model_name, tag], 1.0 if tag in released else 0.0)
        yield g
        if self.runner.lora is not None:
            g = GaugeMetricFamily(
                "slipstream_engine_lora_adapters",
                "LoRA adapters loaded (of the engine's max_loras slots).",
                labels=["model_name"],
            )
            g.add_metric([self.model_name], float(len(self.runner.lora.names)))
            yield g
        counters = {
            "sglang:prompt_tokens": ("Prefilled prompt tokens.", stats.prompt_tokens_total),
            "sglang:generation_tokens": ("Generated tokens.", stats.generation_tokens_total),
            "sglang:num_requests": ("Finished requests (any finish reason).", stats.num_requests_total),
            "sglang:num_aborted_requests": ("Aborted requests.", stats.num_aborted_requests_total),
            "sglang:num_retractions": (
                "Requests retracted (KV freed, re-prefilled later).",
                stats.num_retractions_total,
            ),
            "slipstream_engine_graph_captures_deferred": (
                "Decode steps run without a CUDA graph because a weight operation held the device (the "
                "bucket's graph is captured at a later step).",
                stats.graph_captures_deferred_total,
            ),
            "slipstream_engine_prefix_cached_tokens": (
                "Prompt tokens whose K/V a prefill took from the prefix cache (an earlier request's: the "
                "previous turn of an episode) instead of computing them; / sglang:prompt_tokens = the hit "
                "rate.",
                stats.prefix_cached_tokens_total,
            ),
            "slipstream_engine_prefix_evicted_tokens": (
                "Tokens the prefix cache gave back to the KV pool for running requests.",
                self.runner.prefix.evicted_blocks_total * self.runner.cache.block_size
                if self.runner.prefix
                else 0,
            ),
            "slipstream_engine_prefill_shared_tokens": (
                "Prompt tokens whose K/V a prefill copied from an identical prompt of the same step (a "
                "group's samples) instead of computing them.",
                stats.prefill_shared_tokens_total,
            ),
        }
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], float(value))
            yield c
        yield from self._steps(stats)

    def _steps(self, stats: RunnerStats) -> Iterator[Metric]:
        """Prefill and decode steps, their host time and their rows: the mean decode batch and the share
        of time in prefills say whether a steady stream of requests keeps the batch full."""
        c = CounterMetricFamily(
            "slipstream_engine_steps", "Generation steps by kind.", labels=["model_name", "kind"]
        )
        c.add_metric([self.model_name, "prefill"], float(stats.num_prefill_steps_total))
        c.add_metric([self.model_name, "decode"], float(stats.num_decode_steps_total))
        yield c
        c = CounterMetricFamily(
            "slipstream_engine_step_seconds",
            "Host time in generation steps by kind (including the GPU time a step waits on for its tokens).",
            labels=["model_name", "kind"],
        )
        c.add_metric([self.model_name, "prefill"], stats.prefill_seconds_total)
        c.add_metric([self.model_name, "decode"], stats.decode_seconds_total)
        yield c
        c = CounterMetricFamily(
            "slipstream_engine_step_rows",
            "Requests in generation steps by kind, summed over steps (/ steps = the mean decode batch, the "
            "requests per prefill).",
            labels=["model_name", "kind"],
        )
        c.add_metric([self.model_name, "prefill"], float(stats.prefill_rows_total))
        c.add_metric([self.model_name, "decode"], float(stats.decode_rows_total))
        yield c


class EngineMetrics:
    """One engine's registry; the server observes request latencies, pauses and weight updates."""

    # Long: the declarations of every SGLang-named metric, one statement each
    def __init__(
        self, runner: Runner, model_name: str, waiting_at_gate: Callable[[], int] = lambda: 0
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SchedulerCollector(runner, model_name, waiting_at_gate))
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        self.e2e_latency = Histogram(
            "sglang:e2e_request_latency_seconds",
            "End-to-end request latency.",
            buckets=LATENCY_BUCKETS_S,
            **labels,
        ).labels(model_name)
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds", "Time to first token.", buckets=LATENCY_BUCKETS_S, **labels
        ).labels(model_name)
        self.pause_seconds = Histogram(
            "slipstream_engine_pause_seconds",
            "Time from /pause_generation to /continue_generation.",
            buckets=PAUSE_BUCKETS_S,
            **labels,
        ).labels(model_name)
        self.weight_updates = Counter(
            "slipstream_engine_weight_updates",
            "Successful weight update calls (each weight-bus bucket, or a load from disk).",
            **labels,
        ).labels(model_name)

        self.ipc_payloads = Counter(
            "slipstream_engine_ipc_payloads",
            "/update_weights_from_tensor payloads by how their tensors were had: opened (unpickled, the "
            "sender's handles mapped or found mapped), kept (the same payload as before, loaded from "
            "the tensors it mapped then: no unpickling) or ref (a reference to a payload it keeps, sent "
            "in the payload's place).",
            labelnames=["model_name", "how"],
            registry=self.registry,
        )
        for how in ("opened", "kept"):  # exported (as 0) before the first call
            self.ipc_payloads.labels(model_name, how)
        phase = Histogram(
            "slipstream_engine_weight_bucket_seconds",
            "Per weight-bus bucket, host time of each phase of /update_weights_from_distributed and "
            "/update_weights_from_tensor: wait (for the previous weight operation), receive (join the "
            "broadcast; or map the sender's CUDA-IPC / shared memory), load (copy into the parameters "
            "at a step boundary). On NCCL the GPU work is queued, not waited for.",
            labelnames=["model_name", "phase"],
            buckets=PAUSE_BUCKETS_S,
            registry=self.registry,
        )
        self.bucket_phase = {ph: phase.labels(model_name, ph) for ph in ("wait", "receive", "load")}

        releases = Counter(
            "slipstream_engine_memory_releases",
            "Releases of device memory by /release_memory_occupation, per tag (kv_cache, weights, cuda_graph).",
            labelnames=["model_name", "tag"],
            registry=self.registry,
        )
        freed = Counter(
            "slipstream_engine_memory_freed_bytes",
            "Device bytes freed by /release_memory_occupation, per tag (cuda_graph: the allocator's drop "
            "when the graphs went; 0 on CPU).",
            labelnames=["model_name", "tag"],
            registry=self.registry,
        )
        self.memory_releases = {t: releases.labels(model_name, t) for t in TAGS}
        self.memory_freed_bytes = {t: freed.labels(model_name, t) for t in TAGS}
        seconds = Histogram(
            "slipstream_engine_memory_seconds",
            "Time of a /release_memory_occupation (op=release: retract, drop graphs, free the KV pool, "
            "copy the weights to host) or /resume_memory_occupation (op=resume) that changed something.",
            labelnames=["model_name", "op"],
            buckets=PAUSE_BUCKETS_S,
            registry=self.registry,
        )
        self.memory_seconds = {op: seconds.labels(model_name, op) for op in ("release", "resume")}

        self.lora_ops = Counter(
            "slipstream_engine_lora_ops",
            "LoRA adapter operations by op (load: a PEFT directory, load_from_tensors, unload, "
            "update: over the weight-update group) and outcome (ok, error).",
            labelnames=["model_name", "op", "outcome"],
            registry=self.registry,
        )
        self.lora_op_seconds = Histogram(
            "slipstream_engine_lora_op_seconds",
            "Time of a successful LoRA adapter load, replacement or unload (lock wait included).",
            labelnames=["model_name"],
            buckets=PAUSE_BUCKETS_S,
            registry=self.registry,
        ).labels(model_name)
        kinds = Counter(
            "slipstream_engine_grammar_requests",
            "Grammar-constrained requests accepted, by kind (regex, json_schema, ebnf); n > 1 counts each sample.",
            labelnames=["model_name", "kind"],
            registry=self.registry,
        )
        self.grammar_requests = {k: kinds.labels(model_name, k) for k in GRAMMAR_KINDS}
        compile_s = Histogram(
            "slipstream_engine_grammar_compile_seconds",
            "Time to compile a request's grammar with xgrammar (cache misses only; in a worker thread, "
            "before the request is queued).",
            labelnames=["model_name", "kind"],
            buckets=GRAMMAR_BUCKETS_S,
            registry=self.registry,
        )
        errors = Counter(
            "slipstream_engine_grammar_compile_errors",
            "Grammars that did not compile (the request got a 400), by kind.",
            labelnames=["model_name", "kind"],
            registry=self.registry,
        )
        self.grammar_mask_seconds = Histogram(
            "slipstream_engine_grammar_mask_seconds",
            "Per generation step with constrained rows: time to fill their token bitmasks (CPU, batched) "
            "and apply them to the logits.",
            labelnames=["model_name"],
            buckets=GRAMMAR_BUCKETS_S,
            registry=self.registry,
        ).labels(model_name)
        # Every kind's series exist from the start (at 0), so dashboards show them before the first grammar.
        compile_by_kind = {k: compile_s.labels(model_name, k) for k in GRAMMAR_KINDS}
        errors_by_kind = {k: errors.labels(model_name, k) for k in GRAMMAR_KINDS}
        backend = runner.grammar
        backend.on_compile.append(lambda kind, s: compile_by_kind[kind].observe(s))
        backend.on_compile_error.append(lambda kind: errors_by_kind[kind].inc())
        backend.on_mask_fill.append(self.grammar_mask_seconds.observe)
        self.model_name = model_name

    def lora_op(self, op: str, ok: bool) -> None:
        self.lora_ops.labels(self.model_name, op, "ok" if ok else "error").inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
