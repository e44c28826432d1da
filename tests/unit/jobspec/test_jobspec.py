import pytest

import jobspec


def _write(tmp_path, text):
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return p


def test_example_demo_spec_is_valid():
    spec = jobspec.load("examples/demo.yaml")
    assert spec.model.build == "tiny-arith" and spec.buffer.max_staleness == 1


def test_a_spec_of_only_a_name_gets_defaults_that_run(tmp_path):
    spec = jobspec.load(_write(tmp_path, "name: demo\n"))
    assert spec.algorithm.groups_per_step >= 1 and spec.rollout.group_size >= 2


def test_an_empty_spec_file_is_refused(tmp_path):
    with pytest.raises(jobspec.JobSpecError, match="empty spec"):
        jobspec.load(_write(tmp_path, ""))


@pytest.mark.parametrize(
    "text, path",
    [
        ("algorithm: {lr: fast}", "$.algorithm.lr"),
        ("trainer: {nonsense: 1}", "$.trainer.nonsense"),
        ("rollout: {group_size: 1}", "$.rollout.group_size"),
        ("buffer: {max_staleness: -1}", "$.buffer.max_staleness"),
        ("rollout: {sampling: {top_p: 2}}", "$.rollout.sampling.top_p"),
        ("bogus_section: {}", "$.bogus_section"),
        ("supervision: {out_of_memory_restarts: -1}", "$.supervision.out_of_memory_restarts"),
        ("supervision: {max_restarts: 2, disk_full_restarts: 3}", "$.supervision.disk_full_restarts"),
        ("supervision: {restarts: 3}", "$.supervision.restarts"),
        ("generators: {resources: {node_b: 0}}", "$.generators.resources[...]"),
        ("generators: {resources: {CPU: 1}}", "$.generators.resources.CPU"),
        ("trainer: {resources: {GPU: 1}}", "$.trainer.resources.GPU"),
        ("trainer: {resources: [node_a]}", "$.trainer.resources"),
        ("placement: colocated\ngenerators: {resources: {node_b: 1}}", "$.generators.resources"),
    ],
)
def test_bad_keys_fail_with_their_path(tmp_path, text, path):
    with pytest.raises(jobspec.JobSpecError) as e:
        jobspec.load(_write(tmp_path, text))
    assert f"`{path}`" in str(e.value)


def test_supervision_defaults_end_a_repeated_out_of_memory_after_two_restarts_and_a_full_disk_at_once():
    sup = jobspec.loads("").supervision
    assert (sup.max_restarts, sup.out_of_memory_restarts, sup.disk_full_restarts) == (20, 2, 0)
    sup = jobspec.loads("", ["supervision.out_of_memory_restarts=5", "supervision.disk_full_restarts=1"])
    assert (sup.supervision.out_of_memory_restarts, sup.supervision.disk_full_restarts) == (5, 1)


def test_overrides_are_parsed_as_yaml(tmp_path):
    spec = jobspec.load(
        _write(tmp_path, "algorithm: {lr: 0.1}"), ["algorithm.lr=1e-4", "buffer.max_staleness=0", "name=x"]
    )
    assert spec.algorithm.lr == 1e-4 and spec.buffer.max_staleness == 0 and spec.name == "x"


def test_override_into_scalar_is_an_error(tmp_path):
    with pytest.raises(jobspec.JobSpecError, match=r"\$\.name is not a section"):
        jobspec.load(_write(tmp_path, "name: x"), ["name.sub=1"])


def test_override_whose_value_is_not_yaml_names_it(tmp_path):
    with pytest.raises(jobspec.JobSpecError, match=r"override 'algorithm.lr=\[': the value is not YAML"):
        jobspec.load(_write(tmp_path, "name: x"), ["algorithm.lr=["])


def test_resolved_spec_round_trips_through_json():
    import json

    spec = jobspec.load("examples/demo.yaml")
    assert jobspec.from_dict(json.loads(jobspec.to_json(spec))) == spec


def test_cli_reports_bad_key_and_exit_code(tmp_path, capsys):
    from slipstream.cli import main

    assert main(["validate", str(_write(tmp_path, "algorithm: {total_steps: 0}"))]) == 2
    assert "$.algorithm.total_steps" in capsys.readouterr().err


def test_bus_update_every_needs_matching_staleness():
    """Engines lag up to update_every - 1 versions: a tighter staleness bound would starve the trainer."""
    with pytest.raises(jobspec.JobSpecError, match=r"max_staleness >= 2.*at `\$\.bus\.update_every`"):
        jobspec.from_dict({"bus": {"update_every": 3}, "buffer": {"max_staleness": 1}})
    assert (
        jobspec.from_dict({"bus": {"update_every": 3}, "buffer": {"max_staleness": 2}}).bus.update_every == 3
    )


def test_bus_ipc_needs_engines_on_this_host():
    """bus.backend ipc hands weights over by CUDA IPC / shared memory: external engines must be local."""
    ext = {"engine": "external"}
    with pytest.raises(jobspec.JobSpecError, match=r"not on this host.*at `\$\.bus\.backend`"):
        jobspec.from_dict(
            {"bus": {"backend": "ipc"}, "generators": {**ext, "urls": ["http://192.0.2.1:30000"]}}
        )
    with pytest.raises(jobspec.JobSpecError, match=r"generators.urls.*at `\$\.bus\.backend`"):
        jobspec.from_dict(
            {"bus": {"backend": "ipc"}, "generators": {**ext, "router_url": "http://127.0.0.1:30000"}}
        )
    local = {"bus": {"backend": "ipc"}, "generators": {**ext, "urls": ["http://127.0.0.1:30000"]}}
    assert jobspec.from_dict(local).bus.backend == "ipc"
    assert jobspec.from_dict({"bus": {"backend": "ipc"}}).bus.backend == "ipc"  # launched engines


def test_example_dapo_math_recipe_is_valid_and_takes_any_model_path(tmp_path):
    spec = jobspec.load("examples/dapo_math.yaml")
    alg = spec.algorithm
    assert (alg.clip_eps_low, alg.clip_eps_high, alg.loss_agg) == (0.2, 0.28, "token-mean")
    assert alg.ppo_minibatches > 1 and spec.rollout.dynamic_sampling.enabled
    assert 0 < spec.reward.overlong_buffer_len <= spec.response_budget
    assert spec.model.build == "tiny-tools" and spec.trainer.device == "cpu"
    # evaluation of the agent's episodes on a held-out split: greedy accuracy and pass@k, every 10 versions
    ev = spec.eval
    assert ev.every == 10 and ev.dataset is None and 0 < ev.heldout < spec.dataset.num_problems
    assert ev.greedy and ev.k > 1 and ev.n >= ev.k and ev.temperature > 0
    assert ev.max_samples == ev.heldout * ev.per_problem  # every held-out problem, every evaluation
    cfg = spec.eval_config()
    assert cfg.agent == spec.agent and cfg.tools == spec.tools and cfg.reward == spec.reward
    other = jobspec.load("examples/dapo_math.yaml", [f"model.path={tmp_path}", "model.build=null"])
    assert other.model.path == str(tmp_path) and other.model.build is None and other.eval == ev


def test_lora_job_is_accepted_and_reaches_the_trainer_engines_and_rollouts():
    spec = jobspec.from_dict({"model": {"path": "m", "lora": {"rank": 8, "name": "pol"}}})
    assert spec.model.lora.rank == 8
    assert spec.trainer_config().model.lora == spec.model.lora
    assert spec.rollout_config().model.lora.name == "pol"
    from generator_fleet.config import engine_options

    assert engine_options(spec.model, spec.generators).lora == spec.model.lora
    assert jobspec.from_dict({"model": {"path": "m"}}).model.lora is None


def test_lora_job_refuses_external_engines_and_sglang_without_abort_pause():
    lora = {"path": "m", "lora": {"rank": 8}}
    with pytest.raises(jobspec.JobSpecError, match=r"external engines.*\$\.generators\.engine"):
        jobspec.from_dict(
            {"model": lora, "generators": {"engine": "external", "urls": ["http://127.0.0.1:1"]}}
        )
    with pytest.raises(jobspec.JobSpecError, match=r"abort.*\$\.bus\.pause_mode"):
        jobspec.from_dict({"model": lora, "generators": {"engine": "sglang"}})
    spec = jobspec.from_dict(
        {"model": lora, "generators": {"engine": "sglang"}, "bus": {"pause_mode": "abort"}}
    )
    assert spec.model.lora.rank == 8


def test_colocated_lora_job_runs_on_one_trainer_rank():
    lora = {"path": "m", "lora": {"rank": 8}}
    spec = jobspec.from_dict({"model": lora, "placement": "colocated"})
    assert spec.bus.backend == "ipc" and spec.model.lora.rank == 8
    two = {"trainer": {"num_trainers": 2}, "generators": {"num_engines": 2}}
    assert (
        jobspec.from_dict({"model": {"path": "m"}, "placement": "colocated", **two}).trainer.num_trainers == 2
    )
    with pytest.raises(jobspec.JobSpecError, match=r"one trainer rank.*\$\.trainer\.num_trainers"):
        jobspec.from_dict({"model": lora, "placement": "colocated", **two})


def test_pools_can_ask_for_ray_custom_resources():
    """Engines, rollout workers and trainer ranks go to the nodes that have the resources they name."""
    spec = jobspec.from_dict(
        {"generators": {"resources": {"node_b": 0.01}}, "trainer": {"resources": {"node:10.0.0.1": 0.01}}}
    )
    assert spec.generators.resources == {"node_b": 0.01}
    assert spec.trainer_config().trainer.resources == {"node:10.0.0.1": 0.01}
