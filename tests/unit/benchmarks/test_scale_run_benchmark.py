"""Scale-run benchmark arguments and job: the cuda job (4 GPUs: built-in engine actors with a GPU each, cuda
trainer ranks, NCCL bus, multi-turn tool rollouts) passes job-spec validation at every size, and the phases
fit four GPUs and name their engines."""

import pytest

from benchmarks.scale_run import job_spec, parse_args, splits


@pytest.mark.parametrize(("engines", "trainers"), [(1, 1), (2, 1), (2, 2)])
def test_cuda_spec_validates_with_a_gpu_per_engine_and_rank(tmp_path, engines, trainers):
    args = parse_args(["--device", "cuda", "--device-kind", "nvidia-h200-x4"])
    spec = job_spec(args, tmp_path / "model", "scale", tmp_path / "out", engines, trainers, 2, 100)
    g, t = spec.generators, spec.trainer
    assert (g.engine, g.num_engines, g.num_workers, g.gpus_per_engine) == ("builtin", engines, engines, 1)
    assert (t.device, t.num_trainers, t.fsdp, spec.bus.backend) == ("cuda", trainers, True, "nccl")
    assert g.urls == [] and g.api_key_env is None  # no external engine left over from async_vs_sync's spec
    assert [tool.name for tool in spec.tools] == ["calculator"] and spec.agent.max_turns > 1
    assert spec.dataset.name == "word_problems" and spec.algorithm.groups_per_step == 32
    assert args.model_shape == "qwen2.5-1.5b-shape"


def test_phases_fit_four_gpus_and_name_their_engines():
    cuda = ["--device", "cuda", "--device-kind", "nvidia-h100-x4"]
    assert parse_args([*cuda, "--phase", "generators"]).engines == 3  # 3 engines + 1 rank
    assert parse_args([*cuda]).engines == 2 and parse_args(["--phase", "generators"]).engines == 2
    args = parse_args([*cuda, "--phase", "trainers", "--label", "x4", "--append"])
    assert (args.phase, args.label, args.append) == ("trainers", "x4", True)
    for bad in (["--phase", "generators", "--engines", "4"], ["--engines", "3"]):  # 5 GPUs
        with pytest.raises(SystemExit):
            parse_args([*cuda, *bad])
    with pytest.raises(SystemExit):
        parse_args(["--engines", "1"])


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_colocated_spec_puts_an_engine_on_every_rank_device(tmp_path, ranks):
    args = parse_args(["--device", "cuda", "--phase", "colocated", "--colocated-ranks", "1,2,4"])
    assert args.colocated_ranks == [1, 2, 4]
    spec = job_spec(args, tmp_path / "model", "c", tmp_path / "out", 0, ranks, 0, 10, colocated=True)
    g, t = spec.generators, spec.trainer
    assert spec.placement == "colocated" and spec.bus.backend == "ipc" and spec.buffer.max_staleness == 0
    assert (g.engine, g.num_engines, g.num_workers, g.gpus_per_engine) == ("builtin", ranks, ranks, 1)
    assert (t.device, t.num_trainers) == ("cuda", ranks)
    with pytest.raises(SystemExit):
        parse_args(["--phase", "colocated", "--colocated-ranks", "1,8"])


def test_split_table_and_headline_from_the_phases_measured():
    def st(x: float) -> dict:
        return {"samples_per_s": x}

    m = {
        "stages": {"1+1": st(100.0), "3+1": st(240.0), "2+2": st(300.0)},
        "async_vs_sync_2p2": {"0": st(150.0), "2": st(280.0)},
        "colocated_sync": {"1": st(60.0), "2": st(114.0), "4": st(120.0)},
    }
    r: dict = {}
    splits(m, r)
    t = m["splits"]
    assert t["disaggregated 3:1"] == {"gpus": 4, "samples_per_s": 240.0, "samples_per_s_per_gpu": 60.0}
    assert (
        t["disaggregated 2:2 sync"]["gpus"] == 4 and t["colocated 2 GPUs sync"]["samples_per_s_per_gpu"] == 57
    )
    assert r["colocated_2_vs_1_gpu"] == pytest.approx(1.9) and r["colocated_4_vs_1_gpu"] == pytest.approx(2.0)
    # the best 4-GPU async split (the synchronous 2:2 job is not a candidate) against colocated sync on 4
    assert m["headline_split"] == "disaggregated 2:2"
    assert r["disaggregated_async_vs_colocated_sync_4gpu"] == pytest.approx(2.5)
    m2: dict = {"stages": {"1+1": st(100.0)}}
    splits(m2, r2 := {})
    assert "headline_split" not in m2 and r2 == {}
