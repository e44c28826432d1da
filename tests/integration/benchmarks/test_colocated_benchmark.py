"""Smoke test of the colocated benchmark's publish part: a --quick CPU run (tiny shape, a real engine
process, shared memory) writes a result file in the result-file format with the headline ratio, the
direct handoff of the trainer's own tensors and a ring run beside it. No timing thresholds."""

import json

from benchmarks.colocated import main


def test_quick_publish_run_writes_result_file_with_headline_names(tmp_path):
    main(["--quick", "--parts", "publish", "--out-dir", str(tmp_path)])

    [path] = tmp_path.glob("colocated-cpu-*.json")
    d = json.loads(path.read_text())
    assert d["errors"] == []
    assert {"benchmark", "device", "date", "command", "config", "metrics", "ratios"} <= d.keys()
    assert d["benchmark"] == "colocated" and d["device"] == "cpu"
    tiny = d["metrics"]["publish"]["tiny"]
    assert tiny["handoff"] == "direct" and tiny["buckets"] == 1 and tiny["bytes"] > 0
    assert tiny["engine_ipc_payloads"]["ref"] >= 1  # repeats: references to what the engine mapped before
    rings = [k for k in d["metrics"]["publish"] if k.startswith("tiny-ring-")]
    assert rings and d["metrics"]["publish"][rings[0]]["handoff"] == "ring"
    assert d["ratios"]["publish_vs_d2d_copy"] == tiny["publish_vs_d2d_copy"] > 0
