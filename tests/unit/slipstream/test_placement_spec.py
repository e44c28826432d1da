"""`placement: colocated` in the job spec: what a valid colocated spec resolves to (the ipc bus, the
schedule from max_staleness, the trainer's config), and every refusal failing at submit, with the path of
the key at fault."""

import json

import pytest
from cluster_helpers import control_without_ray

import jobspec
from slipstream.cluster.control import ControlError

CUDA = {"trainer": {"device": "cuda"}, "generators": {"gpus_per_engine": 1}}


def test_disaggregated_is_the_default_and_unchanged():
    spec = jobspec.from_dict({})
    assert spec.placement == "disaggregated" and spec.schedule is None
    assert spec.bus.backend == "gloo" and spec.trainer_config().schedule is None


def test_colocated_defaults_to_the_ipc_bus_and_the_schedule_follows_staleness():
    spec = jobspec.from_dict({"placement": "colocated", "buffer": {"max_staleness": 0}})
    assert spec.bus.backend == "ipc" and spec.schedule == "sync"
    assert spec.trainer_config().schedule == "sync"
    # other bus keys given: the backend still defaults to ipc
    spec = jobspec.from_dict(
        {"placement": "colocated", "bus": {"timeout_s": 30}, "buffer": {"max_staleness": 2}}
    )
    assert spec.bus.backend == "ipc" and spec.bus.timeout_s == 30 and spec.schedule == "async"
    # an explicit schedule wins over max_staleness
    spec = jobspec.from_dict({"placement": "colocated", "colocation": {"schedule": "async"}})
    assert spec.buffer.max_staleness == 1 and spec.schedule == "async"
    spec = jobspec.from_dict(
        {"placement": "colocated", "colocation": {"schedule": "async"}, "buffer": {"max_staleness": 0}}
    )
    assert spec.schedule == "async"
    # an explicit ipc is accepted too, and the saved JSON form loads back the same
    spec = jobspec.from_dict({"placement": "colocated", "bus": {"backend": "ipc"}})
    assert jobspec.from_dict(json.loads(jobspec.to_json(spec))) == spec


def test_colocated_on_cuda_one_engine_per_trainer_gpu():
    spec = jobspec.from_dict({"placement": "colocated", **CUDA, "buffer": {"max_staleness": 0}})
    assert spec.schedule == "sync" and spec.generators.num_engines == spec.trainer.num_trainers == 1
    sg = {"engine": "sglang", "num_engines": 1}
    assert jobspec.from_dict({"placement": "colocated", "trainer": {"device": "cuda"}, "generators": sg})
    # several ranks: each hands the weights to the engine on its own GPU (weight_bus.rank_handoff)
    spec = jobspec.from_dict(
        {
            "placement": "colocated",
            "trainer": {"device": "cuda", "num_trainers": 4},
            "generators": {"num_engines": 4, "gpus_per_engine": 1},
        }
    )
    assert spec.trainer.num_trainers == spec.generators.num_engines == 4


def test_override_sets_colocated_placement(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("buffer: {max_staleness: 0}\n")
    spec = jobspec.load(path, ["placement=colocated"])
    assert spec.placement == "colocated" and spec.bus.backend == "ipc" and spec.schedule == "sync"


@pytest.mark.parametrize(
    "raw, path, words",
    [
        ({"placement": "nearby"}, "$.placement", "nearby"),
        ({"colocation": {"schedule": "sync"}}, "$.colocation", "only with `placement: colocated`"),
        ({"placement": "colocated", "bus": {"backend": "gloo"}}, "$.bus.backend", "not gloo"),
        ({"placement": "colocated", "bus": {"backend": "nccl"}}, "$.bus.backend", "not nccl"),
        (
            {"placement": "colocated", "generators": {"engine": "external", "urls": ["http://127.0.0.1:1"]}},
            "$.generators.engine",
            "not `external`",
        ),
        (
            {"placement": "colocated", "colocation": {"schedule": "sync"}, "buffer": {"max_staleness": 1}},
            "$.colocation.schedule",
            "max_staleness 0",
        ),
        ({"placement": "colocated", "colocation": {"schedule": "later"}}, "$.colocation.schedule", "later"),
        (
            {"placement": "colocated", "generators": {"gpus_per_engine": 1}},
            "$.generators.gpus_per_engine",
            "engines run on the CPU too",
        ),
        (
            {"placement": "colocated", **CUDA, "generators": {"num_engines": 2, "gpus_per_engine": 1}},
            "$.generators.num_engines",
            "one engine per trainer rank's GPU",
        ),
        (
            {"placement": "colocated", **CUDA, "generators": {"num_engines": 1}},
            "$.generators.gpus_per_engine",
            "shares one trainer GPU",
        ),
        (
            {
                "placement": "colocated",
                "trainer": {"device": "cuda"},
                "generators": {"engine": "sglang", "sglang": {"tp_size": 2}},
            },
            "$.generators.sglang.tp_size",
            "tp_size 1",
        ),
        (
            {
                "placement": "colocated",
                "trainer": {"device": "cuda"},
                "generators": {"engine": "sglang", "sglang": {"gpus_per_engine": 0}},
            },
            "$.generators.sglang.gpus_per_engine",
            "shares one trainer GPU",
        ),
    ],
)
def test_bad_colocated_specs_fail_with_their_path(raw, path, words):
    with pytest.raises(jobspec.JobSpecError) as e:
        jobspec.from_dict(raw)
    assert f"at `{path}`" in str(e.value) and words in str(e.value), str(e.value)


@pytest.fixture(scope="module")
def control(tmp_path_factory):
    """The real JobControl over a real Redis, with nothing listening where Ray would be."""
    with control_without_ray(tmp_path_factory.mktemp("home")) as control:
        yield control


def test_submit_refuses_a_bad_colocated_spec_and_scale_refuses_a_colocated_job(control):
    with pytest.raises(ControlError) as e:
        control.submit("name: colo-bad\nplacement: colocated\nbus: {backend: gloo}\n", [], None)
    assert e.value.status == 422 and "`$.bus.backend`" in str(e.value), str(e.value)
    # a valid colocated spec passes every check and reaches Ray's job submission (not there: 503)
    with pytest.raises(ControlError, match="Ray job submission failed") as e:
        control.submit("name: colo\nplacement: colocated\nbuffer: {max_staleness: 0}\n", [], None)
    assert e.value.status == 503
    control.store.update_status("colo", state="running")
    before = control.store.desired("colo")
    for kw in ({"generators": 2}, {"trainers": 2}):
        with pytest.raises(ControlError, match="placement colocated") as e:
            control.scale("colo", **kw)
        assert e.value.status == 422
    assert control.store.desired("colo") == before


def test_the_colocated_example_loads():
    from pathlib import Path

    spec = jobspec.load(Path(__file__).resolve().parents[3] / "examples" / "colocated.yaml")
    assert spec.placement == "colocated" and spec.schedule == "sync" and spec.bus.backend == "ipc"


def test_status_shows_the_colocated_schedule_and_the_release_resume_times():
    from rich.console import Console

    from slipstream.cli.jobs import render_status

    def text(st: dict) -> str:
        console = Console(width=200, record=True)
        console.print(render_status({"name": "j", "state": "running", **st}))
        return console.export_text()

    out = text({"schedule": "sync", "release_s": 0.0123, "resume_s": 0.0456})
    assert "colocated, sync schedule, engines release 0.012 s / resume 0.046 s per step" in out
    assert "colocated, async schedule" in text({"schedule": "async"})
    assert "colocated" not in text({"schedule": None})  # disaggregated: no placement line
