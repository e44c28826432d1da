"""`make demo`: build the tiny arithmetic model, measure it, train it with async GRPO through the whole
system (private Redis, local Ray, built-in engine, gloo weight bus), measure again, plot the reward curve.

Evaluation is separate from training: every problem, `EVAL_SAMPLES` sampled answers each (temperature 1,
the training distribution) plus one greedy answer, scored by the task's reward.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jobspec  # noqa: E402

EVAL_SAMPLES = 4
DEFAULT_SPEC = Path(__file__).resolve().parent.parent / "examples" / "demo.yaml"


def evaluate(model_path: str, spec: jobspec.JobSpec, seed: int = 1234) -> dict:
    """Mean sampled reward and greedy reward of the model at `model_path` over the whole task."""
    import torch

    from generator_fleet.tasks import build_reward, build_task
    from generator_fleet.tasks.problem import Response
    from model_zoo.tiny import load

    torch.manual_seed(seed)
    model, tok = load(model_path)
    task = build_task(spec.dataset)
    reward = build_reward(spec.reward, task)
    max_new = spec.rollout.sampling.max_new_tokens
    prompts = [[tok.bos_token_id] + tok.encode(p.prompt) for p in task.problems]
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    attn = (ids != tok.pad_token_id).long()

    def score_all(out: torch.Tensor, reps: int) -> float:
        total = 0.0
        for i, row in enumerate(out[:, width:].tolist()):
            eos = tok.eos_token_id in row
            text = tok.decode(row[: row.index(tok.eos_token_id)] if eos else row)
            total += reward(task.problems[i // reps], Response(text=text, finished=eos))
        return total / len(out)

    common = dict(max_new_tokens=max_new, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        greedy = model.generate(input_ids=ids, attention_mask=attn, do_sample=False, **common)
        sampled = model.generate(
            input_ids=ids.repeat_interleave(EVAL_SAMPLES, 0),
            attention_mask=attn.repeat_interleave(EVAL_SAMPLES, 0),
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            **common,
        )
    return {
        "sampled_reward": score_all(sampled, EVAL_SAMPLES),
        "greedy_reward": score_all(greedy, 1),
        "problems": len(task),
    }


def plot(progress: list[dict], before: dict, after: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [p["step"] for p in progress]
    rewards = [p["reward_mean"] for p in progress]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, marker=".", label="training batch reward (sampled)")
    ax.axhline(
        before["sampled_reward"],
        color="gray",
        ls="--",
        label=f"eval before RL {before['sampled_reward']:.2f}",
    )
    ax.axhline(
        after["sampled_reward"], color="green", ls="--", label=f"eval after RL {after['sampled_reward']:.2f}"
    )
    ax.set_xlabel("optimizer step (= weight version)")
    ax.set_ylabel("mean reward")
    ax.set_title("Slipstream demo: async GRPO on a+b (tiny Qwen2, CPU)")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--spec", default=str(DEFAULT_SPEC))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = jobspec.load(args.spec, args.overrides)

    from model_zoo.prepare import prepare_model
    from slipstream.job.local import run_job
    from slipstream.job.prepare import resolve_paths
    from slipstream.job.progress import format_progress

    spec = resolve_paths(spec)
    t0 = time.monotonic()
    print(f"[demo] preparing model at {spec.model.path}", flush=True)
    prepare_model(spec.model, spec.dataset)
    before = evaluate(spec.model.path, spec)
    print(
        f"[demo] before RL: sampled reward {before['sampled_reward']:.3f}, greedy {before['greedy_reward']:.3f}",
        flush=True,
    )
    print(
        f"[demo] training {spec.algorithm.total_steps} steps, max_staleness {spec.buffer.max_staleness}",
        flush=True,
    )
    result = run_job(
        spec,
        on_progress=lambda r: print(
            format_progress(r, spec.algorithm.total_steps, spec.agent is not None), flush=True
        ),
    )
    after = evaluate(result.final_model, spec)
    print(
        f"[demo] after RL:  sampled reward {after['sampled_reward']:.3f}, greedy {after['greedy_reward']:.3f}",
        flush=True,
    )
    out = Path(spec.output_dir)
    plot(result.progress, before, after, out / "reward_curve.png")
    summary = {
        "before": before,
        "after": after,
        "steps": result.version,
        "job_seconds": result.elapsed_s,
        "total_seconds": time.monotonic() - t0,
        "buffer": result.buffer,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"[demo] reward curve: {out / 'reward_curve.png'}; summary: {out / 'summary.json'}")
    print(f"[demo] buffer: {result.buffer}")
    print(
        f"[demo] done in {summary['total_seconds']:.0f}s: sampled reward {before['sampled_reward']:.3f} -> "
        f"{after['sampled_reward']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
