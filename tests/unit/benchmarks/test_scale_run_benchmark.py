"""Scale-run benchmark arguments and job: the cuda job (4 GPUs: built-in engine actors with a GPU each, cuda
trainer ranks, NCCL bus, multi-turn tool rollouts) passes job-spec validation at every size, and the phases
fit four GPUs and name their engines."""

import pytest

from benchmarks.scale_run import job_spec, parse_args


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
