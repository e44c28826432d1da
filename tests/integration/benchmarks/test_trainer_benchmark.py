"""Smoke test of the trainer benchmark: a tiny CPU run of the real training step writes a result file in
the result-file format (benchmarks/README.md) with the headline names. No timing thresholds: timings belong to the benchmark."""

import json

import pytest

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


def test_lora_mode_runs_full_and_lora_side_by_side_with_ratios(tmp_path, capsys):
    argv = ["--model", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--lora", "16"]
    argv += ["--micro-batch-tokens", "128", "--micro-batches", "2", "--min-len", "16", "--max-len", "64"]
    argv += ["--out", str(tmp_path)]
    result = main(argv)

    [path] = tmp_path.glob("trainer-cpu-lora16-*.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    full, lora = result["runs"]
    assert (full["mode"], lora["mode"]) == ("full", "lora") and full["model"] == lora["model"] == "tiny"
    assert full["params"] == full["trained_params"]
    # rank 16 on the 7 projections of 2 layers: A [16, in] and B [out, 16] each
    cfg = full["shape"]
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # (in, out): q k v o gate up down
    adapter = cfg["num_hidden_layers"] * sum(16 * (a + b) for a, b in shapes)
    assert lora["trained_params"] == adapter and lora["params"] == full["params"] + adapter
    assert lora["lora"]["rank"] == 16
    # on CPU: tracked fp32 bytes. Full: params, grads and AdamW's two moments (16 B per parameter, plus one
    # step counter per tensor); LoRA: the frozen base's params and 16 B per adapter parameter.
    gib = 2**30
    assert full["peak_mem_gib"] * gib == pytest.approx(16 * full["params"], rel=1e-4)
    assert lora["peak_mem_gib"] * gib == pytest.approx(4 * full["params"] + 16 * adapter, rel=1e-4)
    ratios = result["ratios"]
    assert ratios["lora_vs_full_peak_memory"] == pytest.approx(lora["peak_mem_gib"] / full["peak_mem_gib"])
    assert ratios["lora_vs_full_tokens_per_s"] == pytest.approx(lora["tokens_per_s"] / full["tokens_per_s"])
    assert ratios["lora_vs_full_tokens_per_s_tiny"] == ratios["lora_vs_full_tokens_per_s"]
    # the same data both ways, and the headline metrics are the full run's
    assert lora["tokens_per_step"] == full["tokens_per_step"]
    assert result["metrics"]["tokens_per_s"] == full["tokens_per_s"]
    assert result["metrics"]["tokens_per_s_tiny-lora"] == lora["tokens_per_s"]
    assert "lora_vs_full_tokens_per_s=" in capsys.readouterr().out
