"""Smoke test of the weight-bus benchmark: a --quick CPU run (tiny shape, gloo, a real engine process and a
raw peer process) writes a result file in the result-file format (benchmarks/README.md) with the headline names, and every
timed publish reached the engine with all the bytes (the benchmark checks it and records errors). No timing
thresholds: timings belong to the benchmark."""

import json
import math
from time import perf_counter

import pytest
from bus_engines import ForkedEngine

from benchmarks import weight_bus
from benchmarks.weight_bus import QUICK, SHAPES, main, parse_args


class ForkedBenchEngine(ForkedEngine):
    """The benchmark's engine (its own flags and environment) forked from the test process's preloaded fork
    server instead of started as a new interpreter: the same entry point, without several CPU-seconds of
    imports per engine. The first test runs the benchmark's own `EngineProcess` (a subprocess)."""

    def __init__(self, args, path, log_path, gpu) -> None:
        self.t0 = perf_counter()
        super().__init__(weight_bus.engine_argv(args, path), log_path, weight_bus.child_env(args, gpu))
        self.start_s = math.nan

    def wait_ready(self) -> None:
        super().wait_ready()
        self.start_s = perf_counter() - self.t0

    def stop(self) -> None:
        self.kill()


@pytest.fixture(autouse=True)
def forked_engines(request, monkeypatch):
    if request.node.name != "test_quick_run_writes_result_file_with_headline_names":
        monkeypatch.setattr(weight_bus, "EngineProcess", ForkedBenchEngine)


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
    # timed: streamed updates (the engine's own hold at its step boundary is the pause, inside the
    # transfer), SGLang's per-bucket protocol (paused around the transfer) and staged updates, side by side
    assert m["tiny_stream"] == "arena" and 0 < m["pause_ms"] <= m["transfer_ms"]
    per_bucket, staged = m["tiny_per_bucket"], m["tiny_staged"]
    assert per_bucket["pause_ms"] >= per_bucket["transfer_ms"] > 0 and per_bucket["vs_raw_broadcast"] > 0
    assert 0 < staged["pause_ms"] <= staged["transfer_ms"] and staged["vs_raw_broadcast"] > 0
    assert m["tiny_raw_chunked_ms"] > 0
    assert m["tiny_final_version"] == 1 + 3 * QUICK["repeats"]
    assert capsys.readouterr().out.splitlines()[-1].startswith("weight_bus bus_vs_raw_broadcast=")


def test_two_engines_reach_final_version_beside_raw_broadcast_to_two_peers(tmp_path, capsys):
    result = main(
        ["--quick", "--device", "cpu", "--engines", "2", "--label", "2engines", "--no-variants"]
        + ["--out-dir", str(tmp_path)]
    )

    [path] = tmp_path.glob("weight_bus-*.json")
    assert path.name == f"weight_bus-cpu-2engines-{result['date'].replace('-', '')}.json"
    on_disk = json.loads(path.read_text())
    assert on_disk["errors"] == []
    cfg, m, r = on_disk["config"], on_disk["metrics"], on_disk["ratios"]
    assert cfg["engines"] == 2 and cfg["raw_world_size"] == 3 and cfg["label"] == "2engines"
    assert cfg["engine_gpus"] is None and cfg["backend"] == "gloo"  # CPU: every engine and peer a CPU process
    assert m["tiny_final_version"] == 1 + QUICK["repeats"]
    assert m["tiny_engine_weight_versions"] == [str(1 + QUICK["repeats"])] * 2
    assert len(m["tiny_engine_bucket_phase_ms_per_engine"]) == 2
    assert all(p["receive"] > 0 for p in m["tiny_engine_bucket_phase_ms_per_engine"])
    assert len(m["tiny_raw_ms_all"]) == len(m["tiny_bus_publish_ms_all"]) == QUICK["repeats"]
    assert r["bus_vs_raw_broadcast"] == r["tiny_bus_vs_raw_broadcast"] > 0
    assert r["transfer_vs_raw_broadcast"] > 0 and m["tiny_stream"] == "arena"
    assert "tiny_per_bucket" not in m  # --no-variants: the default publish alone
    assert capsys.readouterr().out.splitlines()[-1].endswith("(model=tiny, engines=2, device=cpu)")


def test_ipc_backend_publishes_through_shared_memory(tmp_path):
    result = main(["--quick", "--device", "cpu", "--bus-backend", "ipc", "--out-dir", str(tmp_path)])

    assert result["errors"] == []
    cfg, m = result["config"], result["metrics"]
    assert cfg["backend"] == "ipc" and cfg["raw_backend"] == "gloo"
    assert m["tiny_engine_weight_versions"] == [str(1 + QUICK["repeats"])]
    assert m["tiny_buckets"] >= 2 and m["pause_ms"] >= m["transfer_ms"] > 0


@pytest.mark.parametrize(
    ("argv", "gpus"),
    [
        ([], [1]),
        (["--engine-gpu", "3"], [3]),
        (["--engines", "2"], [1, 2]),
        (["--engines", "2", "--engine-gpus", "2,3"], [2, 3]),
    ],
)
def test_engine_gpus_one_per_engine(argv, gpus):
    args = parse_args(["--device", "cuda", "--device-kind", "x", *argv])  # no GPU touched: the kind is given
    assert args.engine_gpus == gpus


@pytest.mark.parametrize(
    "argv",
    [
        ["--engines", "2", "--engine-gpu", "1"],  # one GPU for two engines
        ["--engines", "2", "--engine-gpus", "1"],  # too few
        ["--engines", "2", "--engine-gpus", "1,1"],  # shared
        ["--engines", "2", "--engine-gpus", "0,1"],  # the trainer's
        ["--label", "a/b"],
    ],
)
def test_bad_engine_gpus_or_label_refused(argv):
    with pytest.raises(SystemExit):
        parse_args(["--device", "cuda", "--device-kind", "x", *argv])


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_lora_publishes_the_adapter_beside_full_weights(tmp_path, capsys, backend):
    result = main(
        ["--quick", "--device", "cpu", "--lora", "4", "--bus-backend", backend, "--out-dir", str(tmp_path)]
    )

    [path] = tmp_path.glob("weight_bus-cpu-*.json")
    on_disk = json.loads(path.read_text())
    assert on_disk == json.loads(json.dumps(result)) and on_disk["errors"] == []
    cfg, m, r = on_disk["config"], on_disk["metrics"], on_disk["ratios"]
    assert cfg["lora_rank"] == 4 and cfg["backend"] == backend and cfg["headline_model"] == "tiny"
    shape = SHAPES["tiny"]
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    assert m["tiny_adapter_bytes"] > 4 * hidden * 2 * 2 * layers  # at least q_proj's A and B per layer
    assert r["adapter_bytes_fraction"] == m["tiny_adapter_bytes"] / m["tiny_bytes"] < 0.05
    assert m["tiny_adapter_tensors"] == 2 * 7 * layers
    for kind in ("", "adapter_"):
        assert len(m[f"tiny_{kind}publish_ms_all"]) == QUICK["repeats"]
        assert m[f"{kind}pause_ms"] > 0 and m[f"{kind}transfer_ms"] > 0  # gloo: streamed, pause inside
    assert r["adapter_vs_full_publish"] == m["tiny_publish_ms"] / m["tiny_adapter_publish_ms"] > 0
    # both kinds went to the engine, in alternation: it ends on the last version
    assert m["tiny_engine_weight_versions"] == [str(m["tiny_final_version"])]
    assert m["tiny_final_version"] == 2 + 2 * QUICK["repeats"]
    assert capsys.readouterr().out.splitlines()[-1].startswith("weight_bus adapter_vs_full_publish=")


def test_lora_over_ipc_may_share_the_trainers_gpu():
    argv = [
        "--device",
        "cuda",
        "--device-kind",
        "x",
        "--lora",
        "16",
        "--bus-backend",
        "ipc",
        "--engine-gpu",
        "0",
    ]
    assert parse_args(argv).engine_gpus == [0]
    with pytest.raises(SystemExit):
        parse_args(["--device", "cuda", "--device-kind", "x", "--lora", "16", "--engine-gpu", "0"])
