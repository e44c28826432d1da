"""The golden loss curve (tests/harness/golden_loss.py): the trainer alone replays the committed stream of the
tiny arithmetic model for its steps on one CPU rank, and its per-step loss, grad norm and batch reward
match the committed curve within a relative 1e-4."""

import json

import pytest
import ray
from golden_loss import COMPARED, CURVE, RTOL, STEPS, build_model, compare, replay
from ray_fixtures import shutdown_shared_ray

from slipstream.job.prepare import init_local_ray


@pytest.fixture(scope="module")
def local_ray():
    shutdown_shared_ray()  # its own Ray, not the job tests' shared one
    init_local_ray(num_cpus=2)
    yield
    ray.shutdown()


def test_trainer_alone_on_the_recorded_stream_follows_the_golden_curve(local_ray, redis_server, tmp_path):
    golden = json.loads(CURVE.read_text())["steps"]
    assert len(golden) == STEPS and all(g["grad_norm"] > 0 for g in golden)  # every step trains
    curve = replay(build_model(tmp_path / "model"), tmp_path, redis_server.url)
    print("step  " + "  ".join(f"{k:>22}" for k in COMPARED))
    for c, g in zip(curve, golden, strict=False):
        print(f"{c['step']:>4}  " + "  ".join(f"{c[k]:>+10.6f} ({g[k]:>+9.6f})" for k in COMPARED))
    assert compare(curve, golden) == []


def test_the_comparison_catches_a_small_change(tmp_path):
    golden = json.loads(CURVE.read_text())["steps"]
    assert compare(golden, golden) == []
    for key in COMPARED:
        moved = [dict(g) for g in golden]
        moved[-1][key] = golden[-1][key] * (1 + 10 * RTOL) + 10 * RTOL
        assert [f"step {STEPS} {key}" in d for d in compare(moved, golden)] == [True]
