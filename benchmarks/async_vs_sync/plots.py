"""The benchmark's plots: throughput per configuration and pipeline bound, reward curves."""

from __future__ import annotations

from pathlib import Path

from benchmarks.async_vs_sync.job import ROOT


def plots(result: dict, out_dir: Path, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    m = result["metrics"]
    runs = m["runs"]
    spp = result["config"]["samples_per_step"]

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = out_dir / f"{stem}-{name}.png"
        fig.savefig(path, dpi=70)
        plt.close(fig)
        written.append(str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path))

    if runs:
        throughput_plot(result, save)
    learn = result.get("learning")
    for xkey, name, xlabel in (
        ("samples", "reward_vs_samples", "trained samples"),
        ("elapsed_s", "reward_vs_time", "trainer wall time (s)"),
    ):
        fig, ax = plt.subplots(figsize=(6, 3.2))
        if learn:
            lspp = learn.get("samples_per_step") or spp
            for i, (label, by_seed) in enumerate(learn["curves"].items()):
                for j, (seed, curve) in enumerate(by_seed.items()):
                    xs = [r["step"] * lspp if xkey == "samples" else r["elapsed_s"] for r in curve]
                    ax.plot(
                        xs,
                        [r["reward_mean"] for r in curve],
                        color=f"C{i}",
                        ls=("-", "--", ":", "-.")[j % 4],
                        lw=1,
                        label=f"{label} seed {seed}",
                    )
            ax.set_title(f"learning equivalence ({result['device']}): training-batch reward", fontsize=9)
        else:
            for i, (ms, run) in enumerate(runs.items()):
                curve = run["progress"]
                xs = [r["step"] * spp if xkey == "samples" else r["elapsed_s"] for r in curve]
                ax.plot(
                    xs, [r["reward_mean"] for r in curve], color=f"C{i}", lw=1, label=f"max_staleness {ms}"
                )
            ax.set_title("throughput jobs: training-batch reward", fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("reward")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
        save(fig, name)
    return written


def throughput_plot(result: dict, save) -> None:
    import matplotlib.pyplot as plt

    m = result["metrics"]
    runs = m["runs"]
    labels = [f"stale {k}" for k in runs] + ["gen only", "train only"]
    vals = [runs[k]["samples_per_s"] for k in runs]
    vals += [
        m.get("generator_only", {}).get("samples_per_s", 0),
        m.get("trainer_only", {}).get("samples_per_s", 0),
    ]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    colors = ["tab:gray"] + ["tab:blue"] * (len(runs) - 1) + ["tab:green", "tab:orange"]
    ax.bar(labels, vals, color=colors[: len(vals)])
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("trained samples/s")
    ax.set_title(f"async vs sync ({result['device']}): max_staleness and pipeline bounds", fontsize=9)
    save(fig, "throughput")
