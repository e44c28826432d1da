"""A short real job: managed Redis, local Ray, built-in engines over HTTP, gloo weight bus, one trainer."""

import msgspec
import pytest

import jobspec
from slipstream.job.local import run_job

pytestmark = pytest.mark.usefixtures("shared_ray")  # run_job on the session's Ray


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_short_job_advances_versions_and_loses_no_group(tmp_path, tiny_model_dir, max_staleness):
    spec = jobspec.from_dict(
        {
            "name": "e2e",
            "output_dir": str(tmp_path / "run"),
            "model": {"path": str(tiny_model_dir)},
            "rollout": {"group_size": 4, "concurrency": 4, "sampling": {"max_new_tokens": 4}},
            "generators": {"num_engines": 2, "num_workers": 1},
            "algorithm": {"groups_per_step": 3, "total_steps": 4},
            "buffer": {"max_staleness": max_staleness},
            # with staleness 1, weights go to the engines every 2nd version (and after the last)
            "bus": {"update_every": 1 + max_staleness},
        }
    )
    seen = []
    result = run_job(spec, on_progress=seen.append)

    assert result.version == 4
    assert [p["version"] for p in seen] == [1, 2, 3, 4]
    assert all(p["staleness_max"] <= max_staleness for p in seen)
    published = [p["version"] for p in seen if p["publish_s"] > 0]
    assert published == ([1, 2, 3, 4] if max_staleness == 0 else [2, 4])
    # the whole publish call holds the transfer and the engines' pause (around the first update's transfer;
    # inside a streamed update's, where the pause is the engines' own hold of their step boundary)
    assert all(p["publish_call_s"] >= max(p["pause_s"], p["publish_s"]) for p in seen)
    st = result.buffer
    assert st["version"] == 4 and st["steps"] == 4
    assert st["consumed"] == 4 * 3
    assert st["pending"] == 0  # every group read by the trainer was either trained+acked or dropped+acked
    # No group lost: everything produced was trained, dropped as stale (counted), or is still unread;
    # acknowledged entries were trimmed, so only the unread ones remain in the stream.
    assert st["produced"] == st["consumed"] + st["dropped_stale"] + st["unread"]
    assert st["depth"] == st["unread"]
    if max_staleness == 0:  # strictly on-policy: every group trained at the version that generated it
        assert st["staleness"] == {0: st["consumed"]} and st["dropped_stale"] == 0
    # Workers left cleanly: no reservations held, no leases.
    assert st["workers"] == 0
    assert st["dead_letter"] == 0
    assert sum(st["staleness"].values()) == st["consumed"]
    # The final model was saved in HF format and the job spec with it.
    assert (tmp_path / "run" / "final_model" / "config.json").exists()
    assert jobspec.from_dict(msgspec.json.decode((tmp_path / "run" / "job.json").read_bytes())).name == "e2e"
