"""Smoke test of the weight-bus benchmark: a --quick CPU run (tiny shape, gloo, a real engine process and a
raw peer process) writes a result file in the BENCHMARKS.md format with the headline names, and every
timed publish reached the engine with all the bytes (the benchmark checks it and records errors). No timing
thresholds: timings belong to the benchmark."""

import json

from benchmarks.weight_bus import QUICK, SHAPES, main


def test_quick_run_writes_result_file_with_headline_names(tmp_path, capsys):
    result = main(["--quick", "--device", "cpu", "--out-dir", str(tmp_path)])

    [path] = tmp_path.glob("weight_bus-cpu-*.json")
    on_disk = json.loads(path.read_text())
    assert on_disk == json.loads(json.dumps(result))
    assert on_disk["errors"] == []
    assert {"benchmark", "device", "date", "command", "config", "metrics", "ratios"} <= on_disk.keys()
    assert on_disk["benchmark"] == "weight_bus" and on_disk["device"] == "cpu"
    assert path.name == f"weight_bus-cpu-{on_disk['date'].replace('-', '')}.json"
    cfg, m, r = on_disk["config"], on_disk["metrics"], on_disk["ratios"]
    assert cfg["models"] == ["tiny"] and cfg["headline_model"] == "tiny" and cfg["backend"] == "gloo"
    shape = SHAPES["tiny"]
    embed = shape["vocab_size"] * shape["hidden_size"] * 2  # bf16, tied: sent once
    assert m["tiny_bytes"] > embed and m["tiny_buckets"] >= 2  # the embedding alone, then the rest
    assert len(m["tiny_raw_ms_all"]) == len(m["tiny_bus_publish_ms_all"]) == QUICK["repeats"]
    assert r["bus_vs_raw_broadcast"] == r["tiny_bus_vs_raw_broadcast"] > 0
    assert m["pause_ms"] >= m["transfer_ms"] > 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("weight_bus bus_vs_raw_broadcast=")
