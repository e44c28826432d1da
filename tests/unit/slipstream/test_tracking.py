"""Experiment tracking in one process: TensorBoard event files and W&B offline runs in a job's output_dir,
read back with TensorBoard's EventAccumulator and from W&B's offline run file; steps keyed by version, never
duplicated across restarts and resumed attempts; evaluation records become eval scalars, also through the
driver's progress stream on a real Redis; a writer failure never raises; bad tracking keys name their path."""

import json
import subprocess
import sys

import pytest
from tracking_files import tb_events, tracking_spec, wandb_history

import jobspec
from slipstream.job.tracking import Tracker


def _steps(acc, tag):
    return [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]


def _rec(version, reward, attempt=1):
    return {"step": version, "version": version, "attempt": attempt, "run_id": "r1", "pool_id": "p",
            "reward_mean": reward, "loss": -reward, "staleness_max": 0, "mfu": None, "samples": 8}  # fmt: skip


def test_progress_eval_and_config_go_to_tensorboard_and_wandb(tmp_path):
    t = Tracker(tracking_spec(tmp_path), {"run_id": "r1", "attempt": 1})
    t.log_config()
    for v in (1, 2, 3):
        t.log_progress(_rec(v, 0.1 * v))
    t.log_scalars({"accuracy": 0.5, "note": "not a number"}, version=2)
    t.close()
    assert t.status()["errors"] == {} and t.status()["writes"] == {"tensorboard": 4, "wandb": 4}

    acc = tb_events(tmp_path)
    tags = acc.Tags()["scalars"]
    assert {
        "train/reward_mean",
        "train/loss",
        "train/staleness_max",
        "train/samples",
        "eval/accuracy",
    } <= set(tags)
    assert "train/mfu" not in tags and "train/version" not in tags  # null, and the x-axis itself
    assert _steps(acc, "train/reward_mean") == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert _steps(acc, "eval/accuracy") == [(2, 0.5)]
    assert "config/spec/text_summary" in acc.Tags()["tensors"]
    text = acc.Tensors("config/spec/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"name": "trk"' in text
    hp = acc.summary_metadata  # the hparams plugin's experiment and session summaries
    assert any(m.plugin_data.plugin_name == "hparams" for m in hp.values())

    rows = wandb_history(tmp_path)
    assert [(r["_step"], round(r["train/reward_mean"], 6)) for r in rows if "train/reward_mean" in r] == [
        (1, 0.1), (2, 0.2), (3, 0.3)
    ]  # fmt: skip
    assert [r["eval/accuracy"] for r in rows if "eval/accuracy" in r] == [0.5]


TB_WITHOUT_TORCH = """
import sys
from slipstream.job.tracking import Tracker
from tracking_files import tracking_spec
t = Tracker(tracking_spec(sys.argv[1], wandb=False), {"run_id": "r1", "attempt": 1})
t.log_config()
t.log_progress({"step": 1, "version": 1, "attempt": 1, "reward_mean": 0.5})
t.close()
assert t.status()["errors"] == {}, t.status()
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_tensorboard_events_are_written_without_torch_and_the_hparams_keep_their_types(tmp_path):
    """A job's driver writes its events without importing torch (slipstream/job/tb_events.py): the
    scalars, the spec's text and the hparams plugin's experiment and session, its values typed."""
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    env_path = [str(p) for p in sys.path if p]
    out = subprocess.run(
        [sys.executable, "-c", TB_WITHOUT_TORCH, str(tmp_path)],
        capture_output=True, text=True, timeout=120, env={"PYTHONPATH": ":".join(env_path), "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"  # no torch module loaded
    acc = tb_events(tmp_path)
    assert _steps(acc, "train/reward_mean") == [(1, 0.5)]
    assert '"name": "trk"' in acc.Tensors("config/spec/text_summary")[0].tensor_proto.string_val[0].decode()
    data = {
        tag: plugin_data_pb2.HParamsPluginData.FromString(m.plugin_data.content)
        for tag, m in acc.summary_metadata.items()
        if m.plugin_data.plugin_name == "hparams"
    }
    assert set(data) == {"_hparams_/experiment", "_hparams_/session_start_info", "_hparams_/session_end_info"}
    types = {
        i.name: api_pb2.DataType.Name(i.type) for i in data["_hparams_/experiment"].experiment.hparam_infos
    }
    values = data["_hparams_/session_start_info"].session_start_info.hparams
    assert types["name"] == "DATA_TYPE_STRING" and values["name"].string_value == "trk"
    assert (
        types["algorithm.total_steps"] == "DATA_TYPE_FLOAT64"
        and values["algorithm.total_steps"].number_value > 0
    )
    assert (
        types["tracking.wandb.enabled"] == "DATA_TYPE_BOOL"
        and values["tracking.wandb.enabled"].bool_value is False
    )
    status = data["_hparams_/session_end_info"].session_end_info.status
    assert api_pb2.Status.Name(status) == "STATUS_SUCCESS"


def _uid_about_to_gain_a_digit() -> None:
    """TensorBoard's per-process counter that ends each events file's name, moved (only forward) to the
    last number of its width: the next writer's file ends in 9…9, the one after it in 10…0, which sorts
    before it as text."""
    from tensorboard.summary.writer import event_file_writer

    counter = event_file_writer._global_uid
    with counter._lock:
        counter._value = 10 ** len(str(counter._value)) - 1


def test_restarts_and_resumed_attempts_write_each_version_once(tmp_path):
    spec = tracking_spec(tmp_path, wandb=False)
    _uid_about_to_gain_a_digit()  # the restart's events file is made in the same second as the first one
    t = Tracker(spec, {"run_id": "r1", "attempt": 1})
    t.log_config()
    for v in (1, 2, 3, 4):
        t.log_progress(_rec(v, v))
    # the trainer pool restarted from the checkpoint at version 2: versions 3 and 4 are trained again
    t.log_progress(_rec(3, 30))
    t.close()
    assert _steps(tb_events(tmp_path), "train/reward_mean") == [(1, 1), (2, 2), (3, 30)]

    # a resumed attempt of the run (a new driver process): it reads the earlier attempt's records again,
    # then its trainer resumes from the checkpoint at version 2 (its events files sort after the others)
    t = Tracker(spec, {"run_id": "r1", "attempt": 2})
    t.log_config()  # written by the first attempt's driver already: not again
    t.log_scalars({"accuracy": 0.9}, version=2)  # an eval result before any step of this attempt
    for v, r in ((1, 1), (2, 2), (3, 30)):
        t.log_progress(_rec(v, r, attempt=1))
    for v in (3, 4, 5):
        t.log_progress(_rec(v, 100 * v, attempt=2))
    t.close()
    assert _steps(tb_events(tmp_path), "train/reward_mean") == [(1, 1), (2, 2), (3, 300), (4, 400), (5, 500)]
    assert json.loads((tmp_path / "tracking.json").read_text())["version"] == 5
    assert _steps(tb_events(tmp_path), "eval/accuracy") == [(2, 0.9)]
    assert len(tb_events(tmp_path).Tensors("config/spec/text_summary")) == 1

    # a new run of the job (not a resumption) starts its curves afresh
    t = Tracker(spec, {"run_id": "r2", "attempt": 1})
    t.log_progress(_rec(1, 7))
    t.close()
    assert _steps(tb_events(tmp_path), "train/reward_mean") == [(1, 7)]


def _eval_rec(version, accuracy, attempt=1):
    """An evaluator's record as generator_fleet/evaluation.py writes it to the progress stream."""
    scores = {"accuracy": accuracy, "pass@4": min(1.0, 2 * accuracy), "problems": 64.0, "duration_s": 2.5}
    return {"kind": "eval", "version": version, "version_max": version, "eval": scores,
            "elapsed_s": float(version), "attempt": attempt}  # fmt: skip


def test_evaluation_records_become_eval_scalars_once_per_run(tmp_path):
    spec = tracking_spec(tmp_path, wandb=False)
    t = Tracker(spec, {"run_id": "r1", "attempt": 1})
    t.log_progress(_eval_rec(0, 0.25))  # version 0 is evaluated before the first step
    for v in (1, 2):
        t.log_progress(_rec(v, v))
    t.log_progress(_eval_rec(2, 0.5))
    t.close()
    acc = tb_events(tmp_path)
    assert _steps(acc, "eval/accuracy") == [(0, 0.25), (2, 0.5)]
    assert _steps(acc, "eval/pass@4") == [(0, 0.5), (2, 1.0)]
    assert {"eval/problems", "eval/duration_s"} <= set(acc.Tags()["scalars"])
    assert "eval/version" not in acc.Tags()["scalars"] and "eval/attempt" not in acc.Tags()["scalars"]
    assert _steps(acc, "train/reward_mean") == [(1, 1), (2, 2)]  # the steps' curves are untouched
    assert json.loads((tmp_path / "tracking.json").read_text())["eval_version"] == 2

    # a resumed attempt's driver reads the earlier attempt's evaluations again: not written twice
    t = Tracker(spec, {"run_id": "r1", "attempt": 2})
    for rec in (_eval_rec(0, 0.25), _rec(1, 1), _rec(2, 2), _eval_rec(2, 0.5)):
        t.log_progress({**rec, "attempt": 1})
    t.log_progress(_rec(3, 3, attempt=2))
    t.log_progress(_eval_rec(3, 0.75, attempt=2))
    t.close()
    assert _steps(tb_events(tmp_path), "eval/accuracy") == [(0, 0.25), (2, 0.5), (3, 0.75)]


def test_the_driver_tracks_the_evaluations_in_its_progress_stream(
    tmp_path, redis_server, redis_client, job_id
):
    """The driver's own path: records in a real Redis progress stream, read by JobDriver.read_progress
    (no pools started), land in TensorBoard as train/* and eval/* (evaluations were once dropped)."""
    from slipstream.job.driver import JobDriver
    from slipstream.job.store import JobStore

    spec = jobspec.from_dict({"name": job_id, "output_dir": str(tmp_path)})
    store = JobStore(redis_client)
    store.create(job_id, jobspec.to_json(spec), 1, 1)
    driver = JobDriver(spec, redis_server.url, store)
    driver.begin_run()
    stream = driver.buffer.keys.progress
    step = {"reward_mean": 0.5, "staleness_mean": 0.0, "staleness_max": 0, "loss": 0.1, "samples": 4,
            "response_tokens": 16, "run_id": driver.run_info["run_id"], "attempt": 1}  # fmt: skip
    for rec in (_eval_rec(0, 0.25), {**step, "step": 1, "version": 1, "elapsed_s": 1.0}, _eval_rec(1, 0.5)):
        redis_client.xadd(stream, {"j": json.dumps(rec)})
    driver.read_progress(block_ms=0)
    driver.tracker.close()
    assert driver.last_eval["version"] == 1
    acc = tb_events(tmp_path)
    assert _steps(acc, "eval/accuracy") == [(0, 0.25), (1, 0.5)]
    assert _steps(acc, "train/reward_mean") == [(1, 0.5)]


def test_a_failing_writer_is_counted_and_logged_once_and_never_raises(tmp_path, caplog):
    (tmp_path / "tensorboard").write_text("a file where the event directory should be")
    t = Tracker(
        tracking_spec(tmp_path, wandb=False, trainer={"resume_from": "latest"}),
        {"run_id": "r1", "attempt": 1},
    )
    for v in (1, 2, 3):
        t.log_progress(_rec(v, v))
    t.close()
    assert t.status()["errors"]["tensorboard"] >= 1
    assert len([r for r in caplog.records if "tracking: tensorboard failed" in r.getMessage()]) == 1


@pytest.mark.parametrize("bad", [{"mode": "upload"}, {"project": "no spaces"}, {"enable": True}])
def test_bad_tracking_keys_name_their_path(bad):
    with pytest.raises(jobspec.JobSpecError, match=r"\$\.tracking\.wandb\.(mode|project|enable)"):
        jobspec.from_dict({"tracking": {"wandb": bad}})
