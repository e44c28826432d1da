"""Smoke test of the trainer benchmark: a tiny CPU run of the real training step writes a result file in
the result-file format (benchmarks/README.md) with the headline names. No timing thresholds: timings belong to the benchmark."""

import json

from benchmarks.trainer import main


def test_tiny_cpu_run_writes_result_file_with_headline_names(tmp_path, capsys):
    argv = [
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--micro-batch-tokens",
        "128",
        "--micro-batches",
        "2",
    ]
    argv += ["--min-len", "16", "--max-len", "64", "--peak-tflops", "1", "--out", str(tmp_path)]
    result = main(argv)

    [path] = tmp_path.glob("trainer-cpu-*.json")
    on_disk = json.loads(path.read_text())
    assert on_disk == json.loads(json.dumps(result))
    assert {"benchmark", "device", "date", "command", "config", "metrics", "ratios"} <= on_disk.keys()
    assert on_disk["benchmark"] == "trainer" and on_disk["device"] == "cpu"
    assert path.name == f"trainer-cpu-{on_disk['date'].replace('-', '')}.json"
    [run] = on_disk["runs"]
    # 2 full micro-batches of 128 tokens per step, each step's model FLOPs counted, MFU against the peak given
    assert run["micro_batches_per_rank"] == 2 and run["tokens_per_step"] == 256
    assert run["flops_per_step"] > 6 * run["tokens_per_step"] * 64 * 64
    assert 0 < on_disk["metrics"]["mfu"] == run["mfu"]
    assert capsys.readouterr().out.startswith("trainer mfu=")
