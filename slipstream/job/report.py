"""End-of-job report: PNG plots of reward, staleness and throughput from a job's progress records (the
dicts slipstream.job.progress.ProgressReader yields, one per optimizer step), and of its evaluations (its
eval records: scores and duration per version), written next to the job's checkpoints (its output_dir).
`slipstream run` and the cluster's job driver call it when a job ends.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

log = logging.getLogger(__name__)

REWARD_PNG = "report_reward.png"
STALENESS_PNG = "report_staleness.png"
THROUGHPUT_PNG = "report_throughput.png"
EVAL_PNG = "report_eval.png"


def _eval_series(evals: list[dict]) -> list[dict]:
    """Eval records flattened for plotting: version plus the scalars of `eval`."""
    return [{"version": r.get("version"), **(r.get("eval") or {})} for r in evals]


LENGTHS_PNG = "report_lengths.png"


def _series(progress: list[dict], x: str, y: str) -> tuple[list[float], list[float]]:
    """(x, y) of the records that have a numeric value for both keys."""
    xs, ys = [], []
    for rec in progress:
        a, b = rec.get(x), rec.get(y)
        if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(b, bool):
            xs.append(float(a))
            ys.append(float(b))
    return xs, ys


def _plot_lines(ax, progress: list[dict], x: str, ys: list[tuple[str, str]]) -> bool:
    drawn = False
    for key, label in ys:
        xs, vals = _series(progress, x, key)
        if xs:
            ax.plot(xs, vals, marker="." if len(xs) < 50 else None, label=label)
            drawn = True
    if drawn:
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    return drawn


# Long: one figure per panel, in the order the report shows them
def write_report(progress: list[dict], out_dir: Path) -> list[Path]:
    """Writes report_reward.png, report_staleness.png, report_throughput.png and report_lengths.png (the
    response lengths of trained and of stale-dropped samples) into `out_dir`, and report_eval.png when
    `progress` holds eval records (`kind: "eval"`), and returns their paths; a figure none of whose series
    has data is not written. No records: nothing, []."""
    records = [r for r in progress or [] if isinstance(r, dict)]
    evals = _eval_series([r for r in records if r.get("kind") == "eval"])
    progress = [r for r in records if r.get("kind") != "eval"]
    if not records:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig, name: str, drawn: bool) -> None:
        try:
            if drawn:
                fig.tight_layout()
                path = out_dir / name
                fig.savefig(path, dpi=100)
                written.append(path)
        finally:
            plt.close(fig)

    # reward vs version and vs wall time
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    d1 = _plot_lines(a1, progress, "version", [("reward_mean", "reward mean")])
    a1.set(xlabel="version", ylabel="reward", title="Reward vs version")
    d2 = _plot_lines(a2, progress, "elapsed_s", [("reward_mean", "reward mean")])
    a2.set(xlabel="trainer time (s)", ylabel="reward", title="Reward vs time")
    save(fig, REWARD_PNG, d1 or d2)

    # staleness vs version, and its distribution over the steps
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    d1 = _plot_lines(
        a1, progress, "version", [("staleness_mean", "staleness mean"), ("staleness_max", "staleness max")]
    )
    a1.set(xlabel="version", ylabel="versions behind", title="Staleness of trained groups")
    # per-group staleness when a record carries it (a list under "staleness"), else the steps' maxima
    per_group = [s for r in progress for s in (r.get("staleness") or []) if isinstance(s, int | float)]
    values = per_group or [
        r["staleness_max"] for r in progress if isinstance(r.get("staleness_max"), int | float)
    ]
    d2 = bool(values)
    if d2:
        counts = Counter(int(round(v)) for v in values)
        ks = sorted(counts)
        a2.bar(ks, [counts[k] for k in ks], width=0.8)
        a2.set_xticks(ks)
        a2.grid(True, axis="y", alpha=0.3)
        a2.set(
            xlabel="versions behind",
            ylabel="groups" if per_group else "steps",
            title="Staleness per group" if per_group else "Max staleness per step",
        )
    else:
        a2.text(0.5, 0.5, "no data", ha="center", va="center", transform=a2.transAxes)
    save(fig, STALENESS_PNG, d1 or d2)

    # throughput and step time vs version
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    d1 = _plot_lines(
        a1,
        progress,
        "version",
        [("tokens_per_s", "generated tokens/s"), ("train_tokens_per_s", "trained tokens/s")],
    )
    a1.set(xlabel="version", ylabel="tokens/s", title="Throughput")
    d2 = _plot_lines(a2, progress, "version", [("step_s", "step"), ("wait_s", "wait for data")])
    a2.set(xlabel="version", ylabel="seconds", title="Step time")
    save(fig, THROUGHPUT_PNG, d1 or d2)

    # evaluation scores and duration vs version
    if evals:
        metrics = sorted(
            {k for r in evals for k in r if k in ("accuracy", "greedy_reward") or k.startswith("pass@")}
        )
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        d1 = _plot_lines(a1, evals, "version", [(k, k) for k in metrics])
        a1.set(xlabel="version", ylabel="score", title="Evaluation on the held-out set")
        d2 = _plot_lines(a2, evals, "version", [("duration_s", "evaluation")])
        a2.set(xlabel="version", ylabel="seconds", title="Evaluation time")
        save(fig, EVAL_PNG, d1 or d2)
    # response lengths: trained vs dropped as stale (a length bias shows as stale above trained)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    d1 = _plot_lines(
        a1,
        progress,
        "version",
        [
            ("len_trained_mean", "trained mean"),
            ("len_trained_p90", "trained p90"),
            ("len_stale_mean", "dropped stale mean"),
            ("len_stale_p90", "dropped stale p90"),
        ],
    )
    a1.set(xlabel="version", ylabel="response tokens", title="Response length: trained vs dropped stale")
    xs, ys = _series(progress, "version", "stale_samples")
    d2 = bool(xs)
    if d2:
        a2.bar(xs, ys, width=0.8)
        a2.grid(True, axis="y", alpha=0.3)
        a2.set(xlabel="version", ylabel="samples", title=f"Samples dropped as stale ({int(sum(ys))} in all)")
    else:
        a2.text(0.5, 0.5, "no data", ha="center", va="center", transform=a2.transAxes)
    save(fig, LENGTHS_PNG, d1 or d2)
    return written


def write_report_logged(progress: list[dict], out_dir: Path) -> list[Path]:
    """write_report that never raises (a job does not fail for its report); logs one line."""
    try:
        paths = write_report(progress, out_dir)
    except Exception as e:
        log.warning("end-of-job report failed: %s: %s", type(e).__name__, e)
        return []
    if paths:
        log.info("report: %s", ", ".join(str(p) for p in paths))
    return paths
