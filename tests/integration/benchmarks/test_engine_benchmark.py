"""Smoke test of the engine benchmark: a --quick CPU run (tiny model, concurrency 1 and 4, 8 new tokens)
writes a result file in the result-file format (benchmarks/README.md) with the headline names for every concurrency, and the
engine produced exactly max_new_tokens per request. No timing thresholds: timings belong to the benchmark."""

import json

from benchmarks.engine import QUICK, main


def test_quick_run_writes_result_file_with_headline_names(tmp_path, capsys):
    result = main(["--quick", "--device", "cpu", "--device-kind", "cpu", "--out-dir", str(tmp_path)])

    [path] = tmp_path.glob("engine-cpu-*.json")
    on_disk = json.loads(path.read_text())
    assert on_disk == json.loads(json.dumps(result))
    assert on_disk["errors"] == []
    assert {"benchmark", "device", "date", "command", "config", "metrics", "ratios"} <= on_disk.keys()
    assert on_disk["benchmark"] == "engine" and on_disk["device"] == "cpu"
    assert path.name == f"engine-cpu-{on_disk['date'].replace('-', '')}.json"
    cfg, m, r = on_disk["config"], on_disk["metrics"], on_disk["ratios"]
    assert cfg["model"] == "tiny" and cfg["model_config"]["vocab_size"] == 151_936
    concurrencies = [int(c) for c in QUICK["concurrency"].split(",")]
    n_new = QUICK["max_new_tokens"]
    assert cfg["concurrency"] == concurrencies and cfg["max_new_tokens"] == n_new
    assert m["memory_bandwidth_bytes_per_s"] > 0 and m["weight_bytes_per_step"] > 0
    for c in concurrencies:
        assert r[f"vs_hf_generate_c{c}"] > 0, c
        assert m[f"roofline_fraction_c{c}"] > 0, c
        for name in ("engine_tokens_per_s", "hf_tokens_per_s", "engine_ttft_p50_s", "hf_ttft_s"):
            assert m[f"{name}_c{c}"] > 0, (name, c)
        assert m[f"engine_output_tokens_min_c{c}"] == m[f"engine_output_tokens_max_c{c}"] == n_new
        assert m[f"engine_finish_types_c{c}"] == ["length"]
    headline = capsys.readouterr().out.strip().splitlines()[-1]
    assert headline.startswith(f"engine vs_hf_generate_c{max(concurrencies)}=")


def test_lora_side_measures_decode_with_an_active_adapter(tmp_path, capsys):
    result = main(
        ["--quick", "--device", "cpu", "--device-kind", "cpu", "--out-dir", str(tmp_path), "--lora", "4"]
    )
    assert not result["errors"], result["errors"]
    m, r = result["metrics"], result["ratios"]
    for c in result["config"]["concurrency"]:
        assert m[f"engine_lora_tokens_per_s_c{c}"] > 0 and m[f"engine_lora_output_tokens_min_c{c}"] == 8
        assert r[f"lora_vs_base_c{c}"] == m[f"engine_lora_tokens_per_s_c{c}"] / m[f"engine_tokens_per_s_c{c}"]
    assert "LoRA rank 4" in capsys.readouterr().out
