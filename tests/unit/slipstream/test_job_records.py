"""The control plane's records (slipstream/job/records.py: a job's desired state and status; the trainer's
result) and the paths it derives: where a job's checkpoints are (one rule, the trainer's, whether the spec
is a JobSpec or the JSON stored at submit). Records older versions stored still decode."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import msgspec
import pytest
from msgspec import UNSET

import jobspec
from slipstream.cluster.ui import APP_JS
from slipstream.job.progress import STATUS_FIELDS
from slipstream.job.records import API_ONLY, Desired, Status, decode_status, encode_status, status_dict
from slipstream.job.store import JobStore, job_checkpoint_dir
from trainer.config import checkpoint_dir
from trainer.result import TrainerResult


def test_one_rule_derives_the_checkpoint_directory(tmp_path):
    assert checkpoint_dir(tmp_path) == tmp_path / "checkpoints"
    assert checkpoint_dir(tmp_path, "/ck") == Path("/ck")
    out = tmp_path.resolve()
    for extra, want in (("", out / "checkpoints"), ("\ntrainer: {checkpoint_dir: ck}", out / "ck")):
        spec = jobspec.resolve_paths(jobspec.loads(f"name: a\noutput_dir: {out}{extra}"), tmp_path)
        stored = json.loads(jobspec.to_json(spec))  # what the control plane reads back
        assert job_checkpoint_dir(spec) == job_checkpoint_dir(stored) == want


def test_a_status_an_older_version_stored_still_decodes_with_its_keys():
    """A status record as older writers left it (json.dumps of a dict: NaN, keys no field names, a whole
    float where an int goes, a value of a type its field does not take) decodes, and reads back with
    exactly the keys it had that Status knows."""
    old = {
        "state": "running",
        "submitted_at": 1.7e9,
        "version": 12.0,
        "ray_job_id": "slipstream-a-1",
        "pools": {"generators": 2, "rollout_workers": 4, "trainers": 1},
        "restarts": {"rollout_workers": 0, "engines": 1, "trainer_pool": 0},
        "loss": float("nan"),
        "mfu": None,
        "a_key_from_long_ago": {"x": 1},
        "total_steps": "many",
    }
    st = decode_status(json.dumps(old))
    assert st.state == "running" and st.version == 12 and st.pools["generators"] == 2
    assert math.isnan(st.loss) and st.mfu is None and st.total_steps is UNSET and st.phase is UNSET
    assert set(status_dict(st)) == set(old) - {"a_key_from_long_ago", "total_steps"}
    again = json.loads(encode_status(st))  # stored as before: NaN stays NaN
    assert math.isnan(again.pop("loss")) and again == {
        k: v for k, v in old.items() if k not in ("loss", "a_key_from_long_ago", "total_steps")
    } | {"version": 12}
    assert decode_status(None) == Status() and status_dict(Status()) == {}


def test_the_desired_hash_an_older_version_stored_still_decodes():
    assert Desired.from_hash({}) == Desired()  # no stop; a stop writes a checkpoint unless told not to
    raw = {b"generators": b"3", b"trainers": b"1", b"stop": b"1", b"stop_checkpoint": b"0", b"old": b"x"}
    want = Desired.from_hash(raw)
    assert want == Desired(generators=3, trainers=1, stop=True, stop_checkpoint=False)
    assert msgspec.to_builtins(want) == {
        "generators": 3,
        "trainers": 1,
        "stop": True,
        "stop_checkpoint": False,
    }
    assert Desired.from_hash(want.to_hash()) == want


def test_the_store_writes_and_reads_typed_records(redis_client, job_id):
    store = JobStore(redis_client)
    store.create(job_id, json.dumps({"name": job_id}), 2, 1, version=4)
    st = store.status(job_id)
    assert (st.state, st.version, st.ray_job_id) == ("submitted", 4, f"slipstream-{job_id}-1")
    assert store.desired(job_id) == Desired(generators=2, trainers=1)
    store.set_desired(job_id, trainers=2)
    store.request_stop(job_id, checkpoint=False, reason="cluster down")
    assert store.desired(job_id) == Desired(
        2, 2, stop=True, stop_checkpoint=False, stop_reason="cluster down"
    )
    store.update_status(job_id, state="running", phase=None, name="never stored")
    raw = json.loads(redis_client.get(f"slipstream:{job_id}:status"))
    assert raw["phase"] is None and "name" not in raw and raw["state"] == "running"
    with pytest.raises(TypeError):
        store.update_status(job_id, no_such_field=1)
    assert store.has_status(job_id) and not store.has_status(job_id + "-none")


def test_the_status_holds_every_step_field_the_driver_copies():
    assert set(STATUS_FIELDS) <= set(Status.__struct_fields__)
    assert set(API_ONLY) <= set(Status.__struct_fields__)


def test_the_status_page_reads_only_status_fields():
    """The status page's script reads the job's status (`st.`) and the job list's entries (`j.`, built
    from status fields by JobControl.list) by these names: each must be a Status field."""
    read = set(re.findall(r"\bst\.(\w+)", APP_JS)) | set(re.findall(r"\bj\.(\w+)", APP_JS))
    assert read and read <= set(Status.__struct_fields__), read - set(Status.__struct_fields__)


def test_the_trainer_result_is_typed():
    res = msgspec.convert({"version": 3, "checkpoint": "/c", "checkpoint_version": 3}, TrainerResult)
    assert res == TrainerResult(version=3, checkpoint="/c", checkpoint_version=3)
    assert (res.restart, res.final_model) == (False, "")


def test_the_status_holds_the_runs_fields_the_driver_copies(redis_client, job_id):
    from replay_buffer import ReplayBuffer

    info = ReplayBuffer(redis_client, job_id).begin_run(resume=False)
    assert info and set(info) <= set(Status.__struct_fields__)
