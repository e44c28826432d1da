"""Length bias of the staleness policy (`python -m benchmarks.async_vs_sync --length-bias`): does training
see long responses as often as the engines generate them?

Dropping groups that became too stale loses the long ones: they finish last, so groups admitted after them
are trained first and the trainer's version runs past them. Three jobs of the CPU benchmark's a+b task, on
the *untrained* tiny model (its EOS comes at random positions, so response lengths spread over the whole
budget, `--length-max-new-tokens`) with a negligible learning rate (the policy, and so the distribution of
generated lengths, stays the same during and across the jobs):

- `sync`: max_staleness 0, the reference: nothing can be overtaken, every generated group is trained;
- `version`: max_staleness `--length-staleness` with `buffer.admission: version` (AReaL's cap, counted
  from the published version; stale groups dropped);
- `oldest`: the same with `buffer.admission: oldest` (the default: the cap counts from the oldest group
  still in flight);
- `keep`: `version` admission with `buffer.stale_policy: keep` (AReaL's rule: staleness bounded where a
  group starts; a group that went stale is trained, not dropped).

For each: the response-length distributions (samples per length) of the trained samples and of those
dropped as stale (the buffer's per-run histograms, ReplayBuffer.length_histograms), "generated" = trained +
stale (every group the trainer took), their mean/p50/p90, and two-sample Kolmogorov-Smirnov statistics
(D and its asymptotic p-value, at the number of samples and at the number of groups: the samples of a group
share a prompt, so the truth lies between; lengths are discrete, which makes both conservative): trained vs
generated within the job, and trained vs the sync job's trained distribution.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import msgspec

from benchmarks.async_vs_sync.job import base_spec, log, make_spec

POLICIES = {
    "sync": ("version", "drop"),
    "version": ("version", "drop"),
    "oldest": ("oldest", "drop"),
    "keep": ("version", "keep"),
}
"""Job name -> (buffer.admission, buffer.stale_policy)."""
NEGLIGIBLE_LR = 1e-12
"""algorithm.lr of the length jobs: the policy (and its length distribution) stays put."""


def summary(hist: dict[int, int]) -> dict:
    """n, mean, p50, p90 (nearest rank) of a length histogram."""
    n = sum(hist.values())
    if not n:
        return {"n": 0, "mean": None, "p50": None, "p90": None}
    items = sorted(hist.items())

    def q(p: float) -> int:
        rank, seen = max(1, math.ceil(p * n)), 0
        for length, c in items:
            seen += c
            if seen >= rank:
                return length
        return items[-1][0]

    return {"n": n, "mean": sum(k * c for k, c in items) / n, "p50": q(0.5), "p90": q(0.9)}


def _kolmogorov_p(d: float, na: float, nb: float) -> float:
    """Asymptotic p-value of a two-sample KS statistic: Kolmogorov's distribution at (sqrt(ne) + 0.12 +
    0.11 / sqrt(ne)) * D, ne = n_a n_b / (n_a + n_b) (as in Numerical Recipes)."""
    en = math.sqrt(na * nb / (na + nb))
    lam = (en + 0.12 + 0.11 / en) * d
    if lam < 0.2:
        return 1.0  # P(K > 0.2) = 1 - 1e-10
    if lam < 1.0:  # the series that converges fast here: P(K <= lam) = sqrt(2 pi) / lam * sum exp(...)
        cdf = (
            math.sqrt(2 * math.pi)
            / lam
            * sum(math.exp(-((2 * j - 1) ** 2) * math.pi**2 / (8 * lam * lam)) for j in range(1, 20))
        )
        return min(1.0, max(0.0, 1.0 - cdf))
    p = 2 * sum((-1) ** (j - 1) * math.exp(-2 * j * j * lam * lam) for j in range(1, 101))
    return min(1.0, max(0.0, p))


def ks_2samp(a: dict[int, int], b: dict[int, int], group_size: int = 1) -> dict:
    """Two-sample Kolmogorov-Smirnov statistic D = max |F_a - F_b| of two histograms and its asymptotic
    p-value; `p_groups`: the same at the number of groups (samples / group_size): the samples of a group
    share a prompt, so the effective sample size lies between the two and the truth between p and
    p_groups. None when either is empty."""
    na, nb = sum(a.values()), sum(b.values())
    if not na or not nb:
        return {"d": None, "p": None, "p_groups": None, "n": [na, nb]}
    ca = cb = 0
    d = 0.0
    for x in sorted(set(a) | set(b)):
        ca += a.get(x, 0)
        cb += b.get(x, 0)
        d = max(d, abs(ca / na - cb / nb))
    return {
        "d": d,
        "p": _kolmogorov_p(d, na, nb),
        "p_groups": _kolmogorov_p(d, max(1.0, na / group_size), max(1.0, nb / group_size)),
        "n": [na, nb],
    }


def add(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in sorted(set(a) | set(b))}


def build_untrained_model(work: Path, seed: int) -> Path:
    """The tiny a+b model with no SFT warm-up (random EOS positions: lengths spread over the budget)."""
    from generator_fleet.tasks.arith import ALPHABET, ArithTask
    from model_zoo.tiny import build

    path = work / "tiny-untrained"
    if not (path / "config.json").exists():
        task = ArithTask()
        build(path, ALPHABET, [p.prompt + str(p.answer) for p in task.problems], seed=seed)
    return path


def length_jobs(args: argparse.Namespace, work: Path, on_job=None) -> dict:
    """The three jobs and their distributions (see the module docstring)."""
    from slipstream.job.local import run_job

    model = build_untrained_model(work, args.seed)
    raw = base_spec(args, model, task="arith")
    raw["rollout"]["sampling"]["max_new_tokens"] = args.length_max_new_tokens
    raw["algorithm"]["lr"] = NEGLIGIBLE_LR
    raw["tracking"] = {"tensorboard": False}
    steps = args.steps + args.warmup
    gsize = raw["rollout"]["group_size"]
    out: dict = {"jobs": {}}
    for policy, (admission, stale_policy) in POLICIES.items():
        staleness = 0 if policy == "sync" else args.length_staleness
        spec = make_spec(
            raw,
            name=f"lengths-{policy}",
            out=work / f"lengths-{policy}",
            max_staleness=staleness,
            total_steps=steps,
        )
        buffer = msgspec.structs.replace(spec.buffer, admission=admission, stale_policy=stale_policy)
        spec = msgspec.structs.replace(spec, buffer=buffer)
        t0 = time.monotonic()
        res = run_job(spec)
        trained = {int(k): v for k, v in res.lengths["trained"].items()}
        stale = {int(k): v for k, v in res.lengths["stale"].items()}
        generated = add(trained, stale)
        job = {
            "max_staleness": staleness,
            "admission": admission,
            "stale_policy": stale_policy,
            "wall_s": time.monotonic() - t0,
            "samples_per_s": sum(trained.values()) / max(res.progress[-1]["elapsed_s"], 1e-9),
            "groups_trained": res.buffer["consumed"],
            "groups_dropped_stale": res.buffer["dropped_stale"],
            "staleness_histogram": res.buffer["staleness"],
            "trained": summary(trained),
            "stale": summary(stale),
            "generated": summary(generated),
            "ks_trained_vs_generated": ks_2samp(trained, generated, gsize),
            "ks_trained_vs_stale": ks_2samp(trained, stale, gsize),
            "histograms": {"trained": trained, "stale": stale, "generated": generated},
        }
        out["jobs"][policy] = job
        log(
            f"lengths {policy}: trained {job['trained']}, stale {job['stale']}, "
            f"dropped {job['groups_dropped_stale']} groups, KS trained vs generated "
            f"{job['ks_trained_vs_generated']['d']:.3f}"
        )
        if on_job:
            on_job(out)
    ref = out["jobs"]["sync"]["histograms"]["trained"]
    for policy in list(POLICIES)[1:]:
        job = out["jobs"][policy]
        job["ks_trained_vs_sync_trained"] = ks_2samp(job["histograms"]["trained"], ref, gsize)
    return out


def length_report(res: dict) -> str:
    """The distributions side by side and the statistics, as text."""
    lines = ["length bias: response tokens per sample (n, mean, p50, p90)"]
    for policy, job in res["jobs"].items():
        t, s, g = job["trained"], job["stale"], job["generated"]

        def fmt(x: dict) -> str:
            return (
                f"n {x['n']:>5}  mean {x['mean'] or 0:6.2f}  p50 {x['p50'] or 0:>3}  p90 {x['p90'] or 0:>3}"
            )

        lines.append(
            f"  {policy:<8} (max_staleness {job['max_staleness']}, admission {job['admission']}, "
            f"stale_policy {job.get('stale_policy', 'drop')})"
        )
        lines.append(f"    generated {fmt(g)}")
        lines.append(f"    trained   {fmt(t)}")
        lines.append(f"    stale     {fmt(s)}   dropped groups {job['groups_dropped_stale']}")
        ks = job["ks_trained_vs_generated"]
        line = f"    KS trained vs generated: D {ks['d']:.4f} p {ks['p']:.3f} (groups {ks['p_groups']:.3f})"
        if "ks_trained_vs_sync_trained" in job and job["ks_trained_vs_sync_trained"]["d"] is not None:
            k2 = job["ks_trained_vs_sync_trained"]
            line += (
                f"; trained vs sync's trained: D {k2['d']:.4f} p {k2['p']:.3f} (groups {k2['p_groups']:.3f})"
            )
        lines.append(line)
        lines.append(f"    samples/s {job['samples_per_s']:.1f}")
        lines.append(f"    histogram trained   {job['histograms']['trained']}")
        lines.append(f"    histogram generated {job['histograms']['generated']}")
    return "\n".join(lines)
