"""Golden loss curve: the trainer alone (slipstream.job.trainers.trainer_only: one CPU rank, fp32, fixed
seeds) replays a recorded stream of group records from the tiny arithmetic model, and its per-step loss
and grad norm must match the committed curve. Any change to what the trainer computes from the same data
(advantages, packing, log-probs, the loss, clipping, the optimizer step) moves the curve.

Files (tests/data/golden/):
- tiny_arith_stream.jsonl: the recorded stream, one group record per line (per-token fields as lists),
  in stream order; generated once by the generators alone (slipstream.job.generators.generators_only)
  from the tiny model that tests/conftest.py's `tiny_model_dir` builds (seed 0).
- tiny_arith_loss_curve.json: per step, the trainer's `loss` and `grad_norm` (and the batch's reward).

Regenerate (from the worktree root):
    PYTHONPATH=$PWD python tests/harness/golden_loss.py --update-golden   # the curve, from the committed stream
    PYTHONPATH=$PWD python tests/harness/golden_loss.py --record-stream   # a new stream, then its curve
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from ray_fixtures import shutdown_shared_ray

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"
STREAM = GOLDEN / "tiny_arith_stream.jsonl"
CURVE = GOLDEN / "tiny_arith_loss_curve.json"
STEPS = 6
GROUPS_PER_STEP = 4
GROUP_SIZE = 8
COMPARED = ("loss", "grad_norm", "reward_mean")
RTOL = 1e-4
"""Relative tolerance of the comparison: fp32 on one thread repeats to a few ulps; a change to the loss
moves it by far more."""
PER_TOKEN = ("prompt_ids", "response_ids", "loss_mask", "behavior_logprobs", "token_versions")


def build_model(path: Path) -> Path:
    """The tiny arithmetic model of tests/conftest.py's `tiny_model_dir` (random weights, seed 0)."""
    from generator_fleet.tasks.arith import ALPHABET, ArithTask
    from model_zoo.tiny import build

    task = ArithTask()
    build(path, ALPHABET, [p.prompt + str(p.answer) for p in task.problems], seed=0)
    return path


def golden_spec(model: Path, out: Path, name: str = "golden"):
    """The job both the recording and the replay run: CPU, fp32, one rank, fixed seeds, admission
    unbounded (every recorded group is at version 0; the replay trains STEPS steps on them)."""
    import jobspec

    return jobspec.from_dict(
        {
            "name": name,
            "output_dir": str(out),
            "model": {"path": str(model)},
            "dataset": {"name": "arith", "max_operand": 9, "seed": 0},
            "reward": {"name": "arith", "format_weight": 0.1},
            "rollout": {
                "group_size": GROUP_SIZE,
                "concurrency": 8,
                "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 6},
            },
            "algorithm": {
                "groups_per_step": GROUPS_PER_STEP,
                "total_steps": STEPS,
                "seed": 0,
                "lr": 1e-3,
                # every step has a loss and a gradient, whatever the rewards: the entropy bonus, and the
                # KL to the reference model once the policy moved
                "entropy_coef": 0.01,
                "kl_coef": 0.05,
            },
            "generators": {"engine": "builtin", "num_engines": 1, "num_workers": 1},
            "buffer": {"max_staleness": 1_000_000},
            "trainer": {"device": "cpu", "torch_threads": 1, "export_hf": False, "checkpoint_every": 0},
            "bus": {"backend": "gloo"},
        }
    )


def group_to_json(group) -> dict:
    samples = [
        {
            **{name: s.view(name).tolist() for name in PER_TOKEN},
            "reward": s.reward,
            "finish_reason": s.finish_reason,
        }
        for s in group.samples
    ]
    return {"prompt_id": group.prompt_id, "samples": samples}


def group_from_json(rec: dict, job: str, index: int):
    from replay_buffer.schema import Sample, make_group

    samples = [Sample.build(**s) for s in rec["samples"]]
    return make_group(job, rec["prompt_id"], samples, group_id=f"golden-{index:04d}")


def load_stream(job: str) -> list:
    lines = STREAM.read_text().splitlines()
    return [group_from_json(json.loads(line), job, i) for i, line in enumerate(lines)]


def record_stream(work: Path) -> int:
    """Generate STEPS * GROUPS_PER_STEP groups with the generators alone, and write them to STREAM."""
    import ray

    from replay_buffer import ReplayBuffer
    from replay_buffer.redis_server import ManagedRedis
    from replay_buffer.schema import decode
    from slipstream.job.generators import generators_only
    from slipstream.job.prepare import init_local_ray

    model = build_model(work / "model")
    spec = golden_spec(model, work / "record", "golden-record")
    groups = STEPS * GROUPS_PER_STEP
    with ManagedRedis(data_dir=work / "redis-record") as server:
        shutdown_shared_ray()  # its own Ray, not the job tests' shared one
        init_local_ray(num_cpus=2)
        try:
            pool, _ = generators_only(spec, server.url, groups, timeout_s=600)
            pool.close()
        finally:
            ray.shutdown()
        r = server.client()
        entries = r.xrange(ReplayBuffer(r, spec.name).keys.groups)[:groups]
        records = [group_to_json(decode(fields[b"d"])) for _, fields in entries]
        r.close()
    GOLDEN.mkdir(exist_ok=True)
    STREAM.write_text("".join(json.dumps(rec, separators=(",", ":")) + "\n" for rec in records))
    return len(records)


def replay(model: Path, work: Path, redis_url: str) -> list[dict]:
    """The committed stream put into a fresh job's buffer, then the trainer alone on it for STEPS steps
    (needs a running Ray); the per-step values that COMPARED names."""
    from replay_buffer import ReplayBuffer
    from replay_buffer.client import connect
    from slipstream.job.trainers import trainer_only

    spec = golden_spec(model, work / "replay")
    r = connect(redis_url)
    buffer = ReplayBuffer(r, spec.name)
    buffer.ensure_group()
    buffer.set_version(0)
    for group in load_stream(spec.name):
        buffer.put(group)
    r.close()
    result, records = trainer_only(spec, redis_url)
    assert result.version == STEPS, result
    return [{"step": rec["step"], **{k: rec[k] for k in COMPARED}} for rec in records]


def compare(curve: list[dict], golden: list[dict]) -> list[str]:
    """Where `curve` leaves the golden one (empty: it matches within RTOL)."""
    if [c["step"] for c in curve] != [g["step"] for g in golden]:
        return [f"steps {[c['step'] for c in curve]} != golden {[g['step'] for g in golden]}"]
    out = []
    for c, g in zip(curve, golden, strict=True):
        for key in COMPARED:
            if abs(c[key] - g[key]) > RTOL * max(abs(g[key]), 1e-6):
                out.append(f"step {g['step']} {key}: {c[key]!r} != golden {g[key]!r}")
    return out


def update_golden(work: Path) -> list[dict]:
    """Replay the committed stream and write its curve to CURVE."""
    import ray

    from replay_buffer.redis_server import ManagedRedis
    from slipstream.job.prepare import init_local_ray

    model = build_model(work / "model")
    with ManagedRedis(data_dir=work / "redis-replay") as server:
        shutdown_shared_ray()  # its own Ray, not the job tests' shared one
        init_local_ray(num_cpus=2)
        try:
            curve = replay(model, work, server.url)
        finally:
            ray.shutdown()
    CURVE.write_text(json.dumps({"rtol": RTOL, "steps": curve}, indent=1) + "\n")
    return curve


def main(argv: list[str] | None = None) -> None:
    import os

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--record-stream", action="store_true", help="generate a new stream, then its curve")
    p.add_argument("--update-golden", action="store_true", help="the curve from the committed stream")
    args = p.parse_args(argv)
    if not (args.record_stream or args.update_golden):
        p.error("nothing to do: --record-stream and/or --update-golden")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="golden-loss-") as tmp:
        if args.record_stream:
            print(f"recorded {record_stream(Path(tmp))} groups to {STREAM}")
        curve = update_golden(Path(tmp))
        print(f"wrote {len(curve)} steps to {CURVE}: " + ", ".join(f"{c['loss']:+.5f}" for c in curve))


if __name__ == "__main__":
    main()
