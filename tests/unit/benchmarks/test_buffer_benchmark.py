"""Smoke test of the buffer benchmark: a tiny run against a real redis-server writes a result file in
the result-file format (benchmarks/README.md) with the headline names. No timing thresholds: timings belong to the benchmark."""

import json

from benchmarks.buffer import main

HEADLINE_METRICS = ("put_p99_ms", "put_p50_ms", "get_p99_ms", "get_p50_ms", "record_bytes")


def test_tiny_run_writes_result_file_with_headline_names(tmp_path, capsys):
    argv = ["--records", "40", "--samples", "2", "--tokens", "32", "--prompt-tokens", "8"]
    argv += ["--concurrency", "4", "--batch", "8", "--warmup", "8", "--quiet", "--out", str(tmp_path)]
    result = main(argv)

    [path] = tmp_path.glob("buffer-cpu-*.json")
    on_disk = json.loads(path.read_text())
    assert on_disk == json.loads(json.dumps(result))
    assert {"benchmark", "device", "date", "command", "config", "metrics", "ratios"} <= on_disk.keys()
    assert on_disk["benchmark"] == "buffer" and on_disk["device"] == "cpu"
    assert path.name == f"buffer-cpu-{on_disk['date'].replace('-', '')}.json"
    assert on_disk["config"]["records"] == 40
    for name in HEADLINE_METRICS:
        assert on_disk["metrics"][name] > 0, name
    for name in ("put_vs_raw", "get_vs_raw"):
        assert on_disk["ratios"][name] > 0, name
    assert capsys.readouterr().out.startswith("buffer put_vs_raw=")
