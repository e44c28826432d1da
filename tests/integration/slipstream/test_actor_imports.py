"""What a rollout worker's and the evaluator's processes import at start: their actors' own constructors
(logging, metrics endpoint, the model's tokenizer, the worker), run in a fresh interpreter against a real
Redis. Neither computes with torch, so neither imports it (about a second of CPU per process at start)."""

import glob
import os
import subprocess
import sys

import msgspec
import pytest

import jobspec
from slipstream.job.gpu_metrics import DEVICE_FILES

START = """
import sys
import msgspec
import jobspec
from slipstream.job import actors

spec = jobspec.from_dict(msgspec.json.decode(sys.argv[1]))
redis_url = sys.argv[2]
if sys.argv[3] == "rollout":
    actors.RolloutActor.__ray_metadata__.modified_class(spec.rollout_config(), redis_url, [], "key", 0)
else:
    actors.EvalActor.__ray_metadata__.modified_class(spec.eval_config(), redis_url, [], "key", None)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


@pytest.mark.parametrize("actor", ["rollout", "eval"])
def test_the_rollout_and_eval_actors_start_without_torch(tmp_path, tiny_model_dir, redis_server, actor):
    raw = {
        "name": "imports",
        "output_dir": str(tmp_path / "out"),
        "model": {"path": str(tiny_model_dir)},
        "eval": {"every": 1, "heldout": 4},
    }
    jobspec.from_dict(raw)  # a valid spec
    env = dict(os.environ)
    if glob.glob(DEVICE_FILES):  # a GPU machine: Ray hides the GPUs from an actor given none
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    argv = [sys.executable, "-c", START, msgspec.json.encode(raw).decode(), redis_server.url, actor]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "out" / "logs" / f"{'rollout' if actor == 'rollout' else 'evaluator'}-0.log").exists()
