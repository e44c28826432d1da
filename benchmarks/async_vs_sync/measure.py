"""One job of the benchmark run through `slipstream.job.local.run_job`, its trainer-clock rates, and the
engine's busy share sampled from its Prometheus metrics."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.async_vs_sync.job import ENGINE_KEY_ENV, ExternalEngine, colocated, log, make_spec


def profiling(args, engine: ExternalEngine | None) -> dict[str, Any]:
    """EngineSampler's profile arguments: --engine-profile-steps of an external engine (its --profile-dir
    set by ExternalEngine), else none."""
    steps = getattr(args, "engine_profile_steps", 0)
    if engine is None or not steps:
        return {}
    return {
        "profile_steps": steps,
        "profile_after_tokens": args.engine_profile_after_tokens,
        "api_key": os.environ[ENGINE_KEY_ENV],
    }


class EngineSampler:
    """Polls the engine's Prometheus metrics every `interval_s` in a thread: (monotonic time, decoding?,
    generated tokens so far). Finds the engine through the job's redis.url file and metrics_targets hash
    (built-in engine actor) or is given its URL (external engine). `profile_steps` > 0: once the engine has
    generated `profile_after_tokens` tokens (past the start-up and warm-up), it asks the engine to profile
    that many steps (/start_profile with `api_key`; the engine writes into its --profile-dir)."""

    def __init__(
        self,
        out_dir: Path,
        job: str,
        interval_s: float,
        url: str | None = None,
        profile_steps: int = 0,
        profile_after_tokens: float = 0.0,
        api_key: str | None = None,
    ) -> None:
        self.out_dir, self.job, self.interval_s, self.url = out_dir, job, interval_s, url
        self.profile_steps, self.profile_after_tokens, self.api_key = (
            profile_steps,
            profile_after_tokens,
            api_key,
        )
        self.profile_started: float | None = None
        """When the profile was asked for (monotonic), if it was."""
        self.samples: list[tuple[float, bool, float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _find(self) -> str | None:
        import redis

        from replay_buffer.keys import JobKeys

        url_file = self.out_dir / "redis.url"
        if not url_file.exists():
            return None
        try:
            r = redis.Redis.from_url(url_file.read_text().strip(), socket_timeout=2)
            target = r.hget(JobKeys(self.job).metrics_targets, "engine-0")
            r.close()
        except Exception:  # noqa: BLE001 - not up yet
            return None
        return f"http://{target.decode()}" if target else None

    def _run(self) -> None:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        client = httpx.Client(timeout=2.0)
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                if self.url is None:
                    self.url = self._find()
                if self.url is not None:
                    vals: dict[str, float] = {}
                    for fam in text_string_to_metric_families(client.get(self.url + "/metrics").text):
                        for s in fam.samples:
                            vals[s.name] = vals.get(s.name, 0.0) + s.value
                            if "kind" in s.labels:  # the engine's step counters, by kind
                                k = f'{s.name}{{kind="{s.labels["kind"]}"}}'
                                vals[k] = vals.get(k, 0.0) + s.value
                    if "sglang:num_running_reqs" in vals:
                        busy = vals["sglang:num_running_reqs"] - vals.get("sglang:num_paused_reqs", 0) > 0
                        tokens = vals.get(
                            "sglang:generation_tokens_total", vals.get("sglang:generation_tokens", 0)
                        )
                        self.samples.append((t, busy, tokens, _step_counters(vals)))
                        if (
                            self.profile_steps
                            and self.profile_started is None
                            and tokens >= self.profile_after_tokens
                        ):
                            self._start_profile(client)
            except Exception:  # noqa: BLE001 - engine starting or gone; keep polling
                pass
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t)))
        client.close()

    def _start_profile(self, client: Any) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        r = client.post(self.url + "/start_profile", json={"num_steps": self.profile_steps}, headers=headers)
        self.profile_started = time.monotonic()
        log(f"engine profile of {self.profile_steps} steps: {r.status_code} {r.text.strip()}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return {"busy_fraction": None, "generated_tokens_per_s": None, "samples": len(inside)}
        first, last = inside[0][3], inside[-1][3]
        d = {k: last.get(k, 0.0) - first.get(k, 0.0) for k in last}
        steps = d.get("decode_steps", 0.0) + d.get("prefill_steps", 0.0)
        seconds = d.get("decode_s", 0.0) + d.get("prefill_s", 0.0)
        return {
            "busy_fraction": sum(s[1] for s in inside) / len(inside),
            "generated_tokens_per_s": (inside[-1][2] - inside[0][2]) / (inside[-1][0] - inside[0][0]),
            "samples": len(inside),
            "mean_decode_batch": d["decode_rows"] / d["decode_steps"] if d.get("decode_steps") else None,
            "prefill_step_share": d["prefill_steps"] / steps if steps else None,
            "requests_per_prefill": d["prefill_rows"] / d["prefill_steps"]
            if d.get("prefill_steps")
            else None,
            "prefill_time_share": d["prefill_s"] / seconds if seconds else None,
            "prefix_hit_share": d["prefix_cached_tokens"] / d["prompt_tokens"]
            if d.get("prompt_tokens") and "prefix_cached_tokens" in d
            else None,
        }


def _step_counters(vals: dict[str, float]) -> dict[str, float]:
    """The built-in engine's step counters in one scrape (engine/metrics.py; empty for other engines)."""
    names = {
        "decode_rows": 'slipstream_engine_step_rows_total{kind="decode"}',
        "prefill_rows": 'slipstream_engine_step_rows_total{kind="prefill"}',
        "decode_steps": 'slipstream_engine_steps_total{kind="decode"}',
        "prefill_steps": 'slipstream_engine_steps_total{kind="prefill"}',
        "decode_s": 'slipstream_engine_step_seconds_total{kind="decode"}',
        "prefill_s": 'slipstream_engine_step_seconds_total{kind="prefill"}',
        "prompt_tokens": "sglang:prompt_tokens_total",
        "prefix_cached_tokens": "slipstream_engine_prefix_cached_tokens_total",
    }
    return {k: vals[v] for k, v in names.items() if v in vals}


def rates(progress: list[dict], arrivals: list[float], warmup: int, samples_per_step: int) -> dict[str, Any]:
    """Trainer-clock rates over the steps after `warmup` (module docstring)."""
    timed = progress[warmup:]
    window = timed[-1]["elapsed_s"] - progress[warmup - 1]["elapsed_s"]
    sum_ = lambda key: sum(float(r.get(key) or 0.0) for r in timed)  # noqa: E731
    return {
        "steps_timed": len(timed),
        "window_s": window,
        "samples_per_s": len(timed) * samples_per_step / window,
        "tokens_per_s": sum_("response_tokens") / window,
        "trainer_busy_fraction": sum_("step_s") / window,
        "trainer_wait_fraction": sum_("wait_s") / window,
        "trainer_publish_fraction": sum_("publish_s") / window,
        # the whole publish call (commit, gather, pause and continue too), and what no phase accounts for
        "trainer_publish_call_fraction": sum_("publish_call_s") / window,
        "trainer_other_fraction": 1 - (sum_("step_s") + sum_("wait_s") + sum_("publish_call_s")) / window,
        "step_s_mean": sum_("step_s") / len(timed),
        "staleness_mean": sum_("staleness_mean") / len(timed),
        "staleness_max": max(int(r["staleness_max"]) for r in timed),
        "wall_window": [arrivals[warmup - 1], arrivals[-1]],
    }


def slim(progress: list[dict]) -> list[dict]:
    keys = ("step", "reward_mean", "staleness_mean", "staleness_max", "response_tokens", "wait_s", "step_s")
    keys += ("publish_s", "pause_s", "publish_call_s", "release_s", "resume_s", "elapsed_s")
    keys += ("logprob_diff_mean", "behav_kl")
    return [{k: r.get(k) for k in keys} for r in progress]


def run_config(args, raw: dict, model: Path, work: Path, label: str, max_staleness: int, steps: int, **over):
    """One job through run_job; progress records, their arrival times and the engine samples."""
    from slipstream.job.local import run_job

    out = work / label
    spec = make_spec(raw, name=label, out=out, max_staleness=max_staleness, total_steps=steps, **over)
    engine = None
    if args.device == "cuda" and not colocated(args):
        engine = ExternalEngine(
            args,
            model,
            work / f"{label}-engine.log",
            os.environ[ENGINE_KEY_ENV],
            fp32_lm_head=spec.trainer_fp32_lm_head,  # the engine's head as the trainer's
        )
        spec = _with_urls(spec, [engine.url])
    sampler = EngineSampler(
        out, label, args.sample_interval_s, engine.url if engine else None, **profiling(args, engine)
    )
    progress, arrivals = [], []

    def on_progress(rec: dict) -> None:
        arrivals.append(time.monotonic())
        progress.append(rec)
        if rec["step"] % max(1, steps // 5) == 0 or rec["step"] == steps:
            log(
                f"{label} step {rec['step']}/{steps}: reward {rec['reward_mean']:.3f} staleness "
                f"{rec['staleness_mean']:.2f} step {rec['step_s'] * 1e3:.0f} ms wait {rec['wait_s'] * 1e3:.0f} ms"
            )

    t0 = time.monotonic()
    try:
        result = run_job(spec, on_progress=on_progress)
    finally:
        sampler.stop()
        if engine:
            engine.stop()
    log(f"{label}: {len(progress)} steps, job {result.elapsed_s:.1f} s, wall {time.monotonic() - t0:.1f} s")
    return progress, arrivals, sampler, result.buffer


def _with_urls(spec, urls: list[str]):
    import msgspec

    return msgspec.structs.replace(spec, generators=msgspec.structs.replace(spec.generators, urls=urls))


def throughput_run(args, raw, model, work, ms: int, samples_per_step: int) -> dict[str, Any]:
    label = f"staleness-{ms}"
    progress, arrivals, sampler, buffer = run_config(
        args, raw, model, work, label, ms, args.warmup + args.steps
    )
    m = rates(progress, arrivals, args.warmup, samples_per_step)
    m["generator"] = sampler.window(*m["wall_window"])
    m["staleness_histogram"] = {str(k): v for k, v in buffer["staleness"].items()}
    m["buffer"] = {k: v for k, v in buffer.items() if k != "staleness"}
    m["progress"] = slim(progress)
    m["wall_window"] = None
    return m
