"""Scale-run benchmark, a --quick CPU run: one real job scales 1+1 -> 2+1 -> 2+2 while it trains and writes a
result file whose stages were observed at those sizes (registry, the engines' own request counters, the
driver's pools, the trainer's own log), with the trainer resumed at 2 ranks and versions carrying on. No
timing thresholds: timings belong to the benchmark."""

import json

import pytest

from benchmarks.scale_run import STAGES, main

pytestmark = pytest.mark.usefixtures("shared_ray")  # its jobs (LocalJob) on the session's Ray


def test_quick_run_scales_one_job_and_writes_result_file(tmp_path, capsys):
    result = main(["--quick", "--out-dir", str(tmp_path), "--work-dir", str(tmp_path)])

    [path] = tmp_path.glob("scale_run-cpu-*.json")
    on_disk = json.loads(path.read_text())
    assert on_disk == json.loads(json.dumps(result))
    assert on_disk["errors"] == []
    assert {"benchmark", "device", "date", "command", "config", "metrics", "ratios"} <= on_disk.keys()
    assert on_disk["benchmark"] == "scale_run" and on_disk["device"] == "cpu"
    assert path.name == f"scale_run-cpu-{on_disk['date'].replace('-', '')}.json"
    cfg, m, r = on_disk["config"], on_disk["metrics"], on_disk["ratios"]
    gps, steps = cfg["groups_per_step"], cfg["steps_timed"]
    stages = m["stages"]
    assert list(stages) == list(STAGES)

    # each stage ran at its size, as observed (not as requested)
    for label, engines, ranks in (("1+1", 1, 1), ("2+1", 2, 1), ("2+2", 2, 2)):
        o = stages[label]["observed"]
        assert o["engines_served_since_start"] == engines, (label, stages[label]["engines"])
        assert 1 <= o["engines_with_traffic"] <= engines, (label, stages[label]["engines"])
        assert o["live_engines"] == [engines, engines] and o["joining_engines_end"] == 0, (label, o)
        assert o["status_pools"]["generators"] == engines and o["status_pools"]["trainers"] == ranks, (
            label,
            o,
        )
        assert o["driver_trainer_ranks"] == ranks
        assert stages[label]["samples_per_s"] > 0 and stages[label]["tokens_per_s"] > 0
        # the stage's histogram counts the groups of the steps between its two reads, within the bound
        s = stages[label]
        assert s["staleness_histogram_groups"] == s["staleness_histogram_steps"] * gps
        assert abs(s["staleness_histogram_steps"] - steps) <= 1, s["staleness_histogram_steps"]
        assert all(int(k) <= cfg["max_staleness_scaled_job"] for k in s["staleness_histogram"])
    # the new engine got the weights through the bus: it generates with the trainer's current version
    [new] = [e for e in stages["2+1"]["engines"] if e != "engine-0"]
    assert stages["2+1"]["engines"][new]["weight_version_end"] >= stages["2+1"]["versions"][0]

    # the trainer resumed at 2 ranks from the checkpoint and the versions carried on, none repeated or lost
    ops = m["scale_ops"]["trainers_1_to_2"]
    assert m["trainer_ready"] == [
        {"ranks": 1, "version": 0},
        {"ranks": 2, "version": ops["resumed_after_version"]},
    ]
    assert stages["2+2"]["versions"][0] == ops["first_version_new_pool"] == ops["resumed_after_version"] + 1
    assert {p["pool"] for p in stages["2+2"]["progress"]} == {1}
    assert {p["pool"] for p in stages["2+1"]["progress"]} == {0}
    assert m["versions"]["consecutive"] and m["versions"]["trainer_pools"] == 2
    assert m["scale_ops"]["generators_1_to_2"]["scale_s"] > 0 and ops["scale_s"] > 0

    # async vs sync, two jobs that start at 2+2
    ab = m["async_vs_sync_2p2"]
    assert set(ab) == {"0", "2"}
    for run in ab.values():
        o = run["observed"]
        assert o["engines_served_since_start"] == 2 and o["live_engines"] == [2, 2], o
        assert o["driver_trainer_ranks"] == 2 and o["status_pools"]["trainers"] == 2, o
        assert run["trainer_ready"] == [{"ranks": 2, "version": 0}]
        assert run["samples_per_s"] > 0
    assert set(ab["0"]["staleness_histogram"]) == {"0"}  # synchronous: every group on-policy
    assert all(int(k) <= 2 for k in ab["2"]["staleness_histogram"])

    base = stages["1+1"]["samples_per_s"]
    assert r["samples_per_s_2p1_vs_1p1"] == stages["2+1"]["samples_per_s"] / base
    assert r["samples_per_s_2p2_vs_1p1"] == stages["2+2"]["samples_per_s"] / base
    assert r["async_vs_sync_2p2"] == ab["2"]["samples_per_s"] / ab["0"]["samples_per_s"]
    assert "weight_bus.py --engines 2" in cfg["bus_vs_raw_broadcast_2_engines"]
    assert capsys.readouterr().out.splitlines()[-1].startswith("scale_run samples_per_s_2p1_vs_1p1=")
