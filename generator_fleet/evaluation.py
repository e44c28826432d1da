"""Evaluation during training: the job's engines answer a held-out set at the weight versions due (version
0, every `eval.every` versions, the last), and each answer is scored by the job's reward. Results are
per weight version and go to the job's progress stream as `kind: "eval"` records; no eval sample ever
reaches the replay buffer (the evaluator has no buffer producer).

- The set: `heldout` problems split off the job's dataset by a seeded hash of their prompt ids (the same
  split in every process, whatever the task's order; rollout workers drop them: `training_task`), or an
  eval dataset of its own. At most `max_samples` samples per evaluation.
- Scores: `accuracy`, the share of greedy answers whose reward reaches `correct_reward`, and
  `greedy_reward`, their mean; `pass@k`, the unbiased estimator over n samples at `temperature`.
- Agent jobs (`agent:`): an answer is one whole episode of the job's own workflow (AgentEpisodes: the
  job's tools, parser, system prompt and budgets), greedy or at `temperature`, scored by the job's reward
  (a tool's reward included) on its last assistant turn. Their records add `tool_calls_mean` and
  `turns_mean`, per episode over every episode the evaluation kept.
- Beside training: requests go through the engines' normal /generate path; on built-in engines they
  carry a lower SGLang `priority` than rollouts, so an engine's queue serves rollouts first.
- One weight version per answer (`eval.max_version_spread`: by default an evaluation that starts at
  version v keeps every answer made at v or later, and its record names the newest; with 0, one version
  per record, as follows): a sample whose tokens came from another version than the evaluation's
  (a weight update landed mid-request, or between an episode's turns) is discarded and generated again.
  When the engines moved on to a newer version, the evaluation moves with them: it keeps the answers of
  the newest version and asks again for the rest, so every score in a record comes from exactly one
  version.
- A failed or timed-out evaluation is logged and counted, and the next version due is evaluated; it
  never fails the job.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from generator_fleet import metrics
from generator_fleet.client import EngineError, GenerateResult
from generator_fleet.config import EvalConfig
from generator_fleet.tasks.heldout import split_heldout, training_task
from generator_fleet.tasks.problem import Problem, Response
from generator_fleet.workflow import AgentEpisodes

__all__ = ["Evaluator", "eval_set", "pass_at_k", "scores", "split_heldout", "training_task"]

log = logging.getLogger(__name__)

EVAL_PRIORITY = -1
"""SGLang request priority of eval requests: below the rollouts' default 0 (larger is served first)."""
IN_FLIGHT = 32
"""Eval samples in flight across the engines at once, so an evaluation never takes a whole batch."""
MAX_PASSES = 8
"""Rounds of re-asking for samples that came from another weight version before an evaluation fails."""
MAX_ATTEMPTS = 3
"""Engine errors tolerated per request (each retried on another engine)."""
POLL_S = 0.5
"""How often the evaluator checks the engines' weight version (seconds)."""


# --- the set -------------------------------------------------------------------------------------------
def eval_set(cfg: EvalConfig) -> tuple[Any, list[Problem]]:
    """(the task the eval set comes from, its problems as one evaluation takes them)."""
    from generator_fleet.tasks import build_task

    ev = cfg.eval
    task = build_task(ev.dataset if ev.dataset is not None else cfg.dataset)
    problems = (
        list(task.problems)
        if ev.dataset is not None
        else split_heldout(task.problems, ev.heldout, ev.seed)[1]
    )
    return task, problems[: ev.max_samples // ev.per_problem]


# --- the math ------------------------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k),
    the chance that k of the n drawn without replacement hold at least one correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def scores(
    greedy: Sequence[float] | None, samples: Sequence[Sequence[float]] | None, k: int, correct: float
) -> dict[str, float]:
    """An evaluation's scalars from its rewards: per problem, the greedy answer's reward and the n
    samples' rewards. `accuracy` and `greedy_reward` (with greedy answers), `pass@k` (with samples)."""
    out: dict[str, float] = {}
    if greedy:
        out["accuracy"] = sum(r >= correct for r in greedy) / len(greedy)
        out["greedy_reward"] = sum(greedy) / len(greedy)
    if samples:
        out[f"pass@{k}"] = sum(pass_at_k(len(s), sum(r >= correct for r in s), k) for s in samples) / len(
            samples
        )
    return out


def response_of(tokenizer, ids: list[int], finish_reason: str) -> Response:
    """What the reward scores for a single-turn answer (as the rollout's SingleTurn scores it): the text
    without its EOS, finished when the model ended it with EOS."""
    finished = bool(ids) and ids[-1] == tokenizer.eos_token_id and finish_reason == "stop"
    return Response(text=tokenizer.decode(ids[:-1] if finished else ids), finished=finished)


def agent_workflow(cfg: EvalConfig, tokenizer, reward) -> AgentEpisodes | None:
    """The job's agent workflow for eval episodes (one per answer; each request's sampling is set per
    answer), or None for a single-turn job."""
    if cfg.agent is None:
        return None
    from generator_fleet.agent import build_agent
    from generator_fleet.config import SamplingSpec

    sampling = SamplingSpec(temperature=0.0, top_p=1.0, max_new_tokens=cfg.max_new_tokens)
    return AgentEpisodes(build_agent(cfg.agent, cfg.tools, sampling, tokenizer), 1, reward)


def one_version(res: GenerateResult) -> int | None:
    """The single weight version that produced a whole answer, else None (its tokens span versions)."""
    versions = set(res.token_versions)
    if not versions:
        try:
            return int(res.weight_version)
        except ValueError:
            return -1
    return versions.pop() if len(versions) == 1 else None


def episode_version(results: Sequence[GenerateResult]) -> int | None:
    """The single weight version that produced every model turn of an episode, else None (its turns, or
    a turn's tokens, span versions). A request aborted before its first token adds no version."""
    versions = {one_version(r) for r in results if r.output_ids or r.finish_reason != "abort"}
    return versions.pop() if len(versions) == 1 else None


# --- the evaluator -------------------------------------------------------------------------------------
class EvalFailed(RuntimeError):
    """An evaluation that could not finish (engines failing, weights changing under it every pass)."""


class Evaluator:
    """Evaluates the job's engines at the versions due, beside training, until `stop()`. `priority`: the
    SGLang priority eval requests carry (None: none, for engines that may not schedule by priority)."""

    def __init__(
        self,
        config: EvalConfig,
        redis_url: str,
        engine_urls: list[str],
        api_key: str | None,
        priority: int | None = EVAL_PRIORITY,
    ) -> None:
        self.config, self.redis_url = config, redis_url
        self.engine_urls, self.api_key, self.priority = engine_urls, api_key, priority
        self.done: dict[int, dict] = {}
        """Eval records by version."""
        self.failed: set[int] = set()
        self.last_version = -1
        """The newest version evaluated; the next is due `every` versions after it."""
        self.unversioned = False
        """The engines report no integer weight version: answers tagged -1 count for the trainer's."""
        self.guessed = False
        """No engine answered /get_weight_version with an integer: the version due came from the trainer."""
        self._waiters: list[asyncio.Future] = []
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def due(self, version: int) -> bool:
        """Version 0, the last, and every `every` versions after the last one evaluated; never a version
        done or failed already."""
        if version in self.done or version in self.failed:
            return False
        return (
            self.last_version < 0
            or version >= self.last_version + self.config.eval.every
            or version >= self.config.total_steps
        )

    async def evaluate_now(self, timeout_s: float | None = None) -> dict | None:
        """The record of the engines' current version (evaluated now unless it was already), or None when
        that evaluation failed or took longer than `timeout_s` (default: eval.timeout_s)."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._wake.set()
        try:
            return await asyncio.wait_for(fut, timeout_s or self.config.eval.timeout_s)
        except TimeoutError:
            log.error(
                "evaluation asked for did not finish within %.0f s", timeout_s or self.config.eval.timeout_s
            )
            return None

    async def run(self) -> dict:
        """Evaluate until stopped; returns {"evaluations": versions evaluated, "failed": failures}."""
        from generator_fleet.rollout import EngineRouter, adapter_name
        from generator_fleet.tasks import build_reward
        from models.tokenizers import load_tokenizer
        from replay_buffer.client import connect_async

        cfg = self.config
        self.tokenizer = load_tokenizer(cfg.model.path)
        task, self.problems = eval_set(cfg)
        self.reward = build_reward(cfg.reward, task)
        self.workflow = agent_workflow(cfg, self.tokenizer, self.reward)
        self.engines = EngineRouter(self.engine_urls, self.api_key, adapter_name(cfg.model))
        self.redis = connect_async(self.redis_url)
        follow = asyncio.create_task(self._follow_registry())
        ev = cfg.eval
        log.info(
            "evaluator: %d problems (%s%s), every %d versions, greedy %s, pass@%d over %d samples at "
            "temperature %g, priority %s",
            len(self.problems),
            "agent episodes, " if self.workflow is not None else "",
            "eval.dataset" if ev.dataset is not None else f"held out of {cfg.dataset.name}",
            ev.every,
            ev.greedy,
            ev.k,
            ev.n,
            ev.temperature,
            self.priority,
        )
        try:
            while not self._stop.is_set():
                await self._tick()
        finally:
            follow.cancel()
            for w in self._waiters:
                if not w.done():
                    w.set_result(None)
            await self.engines.aclose()
            await self.redis.aclose()
        return {"evaluations": sorted(self.done), "failed": sorted(self.failed)}

    async def _tick(self) -> None:
        version = await self._engine_version()
        if version is not None and version < self.last_version:
            # a trainer restarted from an older checkpoint: the versions after it will be trained again
            # (and their records were dropped), so they are evaluated again as they come
            for v in [v for v in self.done if v > version]:
                del self.done[v]
            self.failed = {v for v in self.failed if v <= version}
            self.last_version = max(self.done, default=-1)
            log.info("the engines went back to version %d: evaluations after it are done again", version)
        forced = bool(self._waiters)
        if version is not None and forced and version in self.done:
            self._answer(self.done[version])
        elif version is not None and (self.due(version) or (forced and version not in self.failed)):
            waiters, self._waiters = self._waiters, []
            rec = await self._evaluate(version)
            for w in waiters:
                if not w.done():
                    w.set_result(rec)
            # callers who asked meanwhile are answered at the next tick, for the version the engines
            # hold then (the final one, for the driver's last evaluation)
        else:
            if forced and version is not None:  # this version failed already: nothing newer to wait for
                self._answer(None)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            except TimeoutError:
                pass

    def _answer(self, rec: dict | None) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(rec)

    async def _engine_version(self) -> int | None:
        """The newest weight version a live engine serves; the trainer's version when no engine says
        (a router in front); None without engines."""
        urls = list(self.engines.routable)
        if not urls:
            return None
        answers = await asyncio.gather(
            *(self.engines.clients[u].weight_version() for u in urls), return_exceptions=True
        )
        versions = []
        for a in answers:
            try:
                versions.append(int(a))
            except (TypeError, ValueError):
                continue
        # engines that answer with a version that is no integer (an external server the bus never
        # updated: SGLang's "default") tag their tokens -1; those are evaluated at the trainer's version
        self.unversioned = not versions and any(isinstance(a, str) for a in answers)
        self.guessed = not versions
        if versions:
            return max(versions)
        from replay_buffer.keys import JobKeys

        raw = await self.redis.get(JobKeys(self.config.name).version)
        return int(raw) if raw is not None else None

    async def _evaluate(self, version: int) -> dict | None:
        """One evaluation starting at `version`; its record, or None when it failed (logged)."""
        t0 = time.monotonic()
        log.info("evaluation at version %d begins (%d problems)", version, len(self.problems))
        try:
            rec = await asyncio.wait_for(self._round(version), self.config.eval.timeout_s)
        except Exception as e:  # engines, reward, Redis: whatever it was, the job goes on
            why = (
                f"took longer than eval.timeout_s = {self.config.eval.timeout_s:.0f} s"
                if isinstance(e, TimeoutError)
                else f"{type(e).__name__}: {e}"
            )
            self.failed.add(version)
            metrics.EVAL_ROUNDS.labels("failed").inc()
            log.error("evaluation at version %d failed (%s); the next version due is evaluated", version, why)
            return None
        rec["eval"]["duration_s"] = time.monotonic() - t0
        await self._publish(rec)
        return rec

    async def _round(self, version: int) -> dict:
        ev, n = self.config.eval, self.config.eval.n
        slots = [(i, "greedy", 0) for i in range(len(self.problems)) if ev.greedy]
        slots += [(i, "sample", j) for i in range(len(self.problems)) for j in range(n)]
        spread = ev.max_version_spread
        lo, kept, redone = version, {}, 0
        gate = asyncio.Semaphore(IN_FLIGHT)
        for n_pass in range(MAX_PASSES):
            todo = [s for s in slots if s not in kept]
            if not todo:
                break
            answers = await asyncio.gather(*(self._answer_one(gate, s[0], s[1]) for s in todo))
            versions = [a[1] for a in answers if a[1] is not None and a[1] >= 0]
            newest = max(versions, default=lo)
            if self.guessed and n_pass == 0 and versions:
                # no engine said its version (a router in front): the answers tell which one it is
                lo = newest if spread == 0 else min(versions)
            elif spread is not None and newest > lo + spread:  # the weights moved past the window
                log.info("evaluation at version %d: weights changed to %d mid-evaluation; going on at %d",
                         lo, newest, newest - spread)  # fmt: skip
                lo = newest - spread
                redone += sum(1 for a in kept.values() if a[1] < lo)
                kept = {s: a for s, a in kept.items() if a[1] >= lo}
            for s, answer in zip(todo, answers, strict=True):
                v = answer[1]
                if (v is not None and v >= lo and (spread is None or v <= lo + spread)) or (
                    self.unversioned and v == -1
                ):
                    kept[s] = answer
                else:
                    redone += 1
        else:
            if len(kept) < len(slots):
                raise EvalFailed(
                    f"{len(slots) - len(kept)} of {len(slots)} samples still came from other weight versions "
                    f"after {MAX_PASSES} passes"
                )
        metrics.EVAL_REDONE.inc(redone)
        greedy = [kept[(i, "greedy", 0)][0] for i in range(len(self.problems))] if ev.greedy else None
        samples = (
            [[kept[(i, "sample", j)][0] for j in range(n)] for i in range(len(self.problems))] if n else None
        )
        result = scores(greedy, samples, ev.k, ev.correct_reward)
        result.update(problems=float(len(self.problems)), samples=float(len(slots)), redone=float(redone))
        if self.workflow is not None:
            episodes = [a[2] for a in kept.values()]
            result["tool_calls_mean"] = sum(calls for calls, _ in episodes) / len(episodes)
            result["turns_mean"] = sum(turns for _, turns in episodes) / len(episodes)
        newest = max((a[1] for a in kept.values() if a[1] is not None), default=lo)
        return {"kind": "eval", "version": lo, "version_max": max(lo, newest), "eval": result}

    async def _answer_one(
        self, gate: asyncio.Semaphore, i: int, kind: str
    ) -> tuple[float, int | None, tuple[int, int] | None]:
        """(reward, the one version that produced it, or None; (tool calls, turns) of an agent episode,
        else None) of one answer (`greedy` or `sample`) to problem i."""
        ev, problem = self.config.eval, self.problems[i]
        greedy = kind == "greedy"
        sampling = {"temperature": 0.0 if greedy else ev.temperature, "top_p": 1.0 if greedy else ev.top_p}
        async with gate:
            if self.workflow is not None:
                return await self._episode(problem, sampling)
            prompt = [self.tokenizer.bos_token_id, *self.tokenizer.encode(problem.prompt)]
            (res,) = await self._generate(
                [prompt], [{"max_new_tokens": self.config.max_new_tokens, **sampling}]
            )
            if res.finish_reason == "abort":  # a pause aborted it: ask again
                return 0.0, None, None
            # scored under the gate too: IN_FLIGHT also bounds the reward threads (math-verify is CPU)
            response = response_of(self.tokenizer, res.output_ids, res.finish_reason)
            reward = await asyncio.to_thread(self.reward, problem, response)
        return reward, one_version(res), None

    async def _episode(self, problem: Problem, sampling: dict) -> tuple[float, int | None, tuple[int, int]]:
        """One agent episode of the job's workflow: its reward, the one version of all its model turns (or
        None), its tool calls and turns."""
        results: list[GenerateResult] = []

        async def generate(input_ids: list[list[int]], params: list[dict]) -> list[GenerateResult]:
            out = await self._generate(input_ids, params)
            results.extend(out)
            return out

        ((ep, reward),) = await self.workflow.episodes(
            problem, generate, self._stop.is_set, n=1, sampling=sampling
        )
        version = episode_version(results) if ep.finish_reason != "abort" else None
        return reward, version, (ep.tool_calls, ep.turns)

    async def _generate(self, input_ids: list[list[int]], params: list[dict]) -> list[GenerateResult]:
        """One /generate at the eval priority on the least-loaded engine, retried on another engine on an
        engine error (MAX_ATTEMPTS in all)."""
        failed: set[str] = set()
        for attempt in range(1, MAX_ATTEMPTS + 1):
            url = self.engines.pick(exclude=failed)
            self.engines.outstanding[url] += len(input_ids)
            try:
                return await self.engines.clients[url].generate_batch(
                    input_ids, params, return_logprob=False, priority=self.priority
                )
            except EngineError as e:
                failed.add(url)
                if attempt == MAX_ATTEMPTS:
                    raise
                log.warning("eval request on %s failed (%s); retrying elsewhere", url, e)
            finally:
                self.engines.outstanding[url] -= len(input_ids)
        raise AssertionError("unreachable")

    async def _publish(self, rec: dict) -> None:
        """The record into the job's progress stream (with the run's attempt and clock), the metrics, a log
        line."""
        from replay_buffer.keys import JobKeys
        from replay_buffer.progress import EvalRecord, async_append_progress, redis_now, run_clock

        keys = JobKeys(self.config.name)
        clock = run_clock(await self.redis.hgetall(keys.run))
        rec["elapsed_s"] = clock.elapsed_s(redis_now(await self.redis.time()))
        rec["attempt"] = clock.attempt
        record = EvalRecord(
            version=rec["version"],
            eval=rec["eval"],
            version_max=rec["version_max"],
            elapsed_s=rec["elapsed_s"],
            attempt=rec["attempt"],
        )
        await async_append_progress(self.redis, keys, record)
        v, res = rec["version"], rec["eval"]
        self.done[v] = rec
        self.last_version = max(self.last_version, v)
        metrics.EVAL_ROUNDS.labels("ok").inc()
        metrics.EVAL_VERSION.set(v)
        metrics.EVAL_SECONDS.set(res["duration_s"])
        for key, value in res.items():
            if key in ("accuracy", "greedy_reward") or key.startswith("pass@"):
                metrics.EVAL_SCORE.labels(key).set(value)
            elif key in EPISODE_STATS:
                metrics.EVAL_EPISODE.labels(EPISODE_STATS[key]).set(value)
        log.info("evaluation at version %d: %s (%.1f s)", v, format_scores(res), res["duration_s"])

    async def _follow_registry(self) -> None:
        """Route to the engines whose registry lease is live (as rollout workers do)."""
        from generator_fleet.rollout import ENGINE_REFRESH_S
        from weight_bus.registry import live_engines

        while True:
            try:
                if live := await live_engines(self.redis, self.config.name):
                    self.engines.update(live)
            except Exception as e:  # a Redis hiccup must not stop evaluation
                log.warning("engine registry refresh failed: %s", e)
            await asyncio.sleep(ENGINE_REFRESH_S)


EPISODE_STATS = {"tool_calls_mean": "tool_calls", "turns_mean": "turns"}
"""An agent eval record's per-episode means, and their `stat` label on slipstream_eval_episode_mean."""


def format_scores(res: dict) -> str:
    """`accuracy 0.625  pass@4 0.810` of an eval record's scalars (agent evals: `tool_calls_mean 1.250
    turns_mean 2.000` after them)."""
    keys = [k for k in res if k in ("accuracy", "greedy_reward") or k.startswith("pass@")]
    keys += [k for k in res if k in EPISODE_STATS]
    return "  ".join(f"{k} {res[k]:.3f}" for k in keys)
