"""The SGLang launch command in one process: its flags against SGLang's names, types and choices (the shim's
copy of SGLang's parser, tests/harness/sglang_shim.py, and SGLang's own server_args where it is installed),
a LoRA job's flags, and a LoRA job's untrained adapter, which an in-process built-in engine serves as the
base model."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import http_calls
import pytest
from sglang_shim import parse as shim_parse

from generator_fleet.engine import EngineServer
from generator_fleet.launch import redact, sglang_command
from jobspec import SGLangSpec
from models.config import LoraSpec


def test_command_uses_sglang_flag_names_and_parses_as_sglang_would():
    sg = SGLangSpec(
        python="/opt/sglang/bin/python",
        dtype="bfloat16",
        tp_size=2,
        mem_fraction_static=0.7,
        context_length=8192,
        served_model_name="policy",
        skip_server_warmup=True,
        enable_memory_saver=True,
        enable_weights_cpu_backup=True,
        enable_fp32_lm_head=True,
        extra_args=["--attention-backend", "triton"],
    )
    cmd = sglang_command("/models/qwen", 31000, sg, api_key="s3cret")
    assert cmd == [
        "/opt/sglang/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/qwen",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--dtype",
        "bfloat16",
        "--tp-size",
        "2",
        "--weight-version",
        "0",
        "--api-key",
        "s3cret",
        "--mem-fraction-static",
        "0.7",
        "--context-length",
        "8192",
        "--served-model-name",
        "policy",
        "--skip-server-warmup",
        "--enable-metrics",
        "--enable-memory-saver",
        "--enable-weights-cpu-backup",
        "--enable-fp32-lm-head",
        "--attention-backend",
        "triton",
    ]
    # A colocated engine's flags parse under SGLang's names (the shim's copy of its parser).
    colocated = SGLangSpec(mem_fraction_static=0.5, enable_memory_saver=True, enable_weights_cpu_backup=True)
    args = shim_parse(sglang_command("/m", 30000, colocated)[3:])
    assert shim_parse(
        sglang_command("/m", 30000, SGLangSpec(enable_fp32_lm_head=True))[3:]
    ).enable_fp32_lm_head
    assert (args.mem_fraction_static, args.enable_memory_saver, args.enable_weights_cpu_backup) == (
        0.5,
        True,
        True,
    )
    assert "s3cret" not in redact(cmd) and redact(cmd)[redact(cmd).index("--api-key") + 1] == "***"
    # Options left null are left to SGLang; defaults give a command SGLang's parser accepts as meant.
    minimal = sglang_command("/m", 30000, SGLangSpec())
    assert "--api-key" not in minimal and "--context-length" not in minimal
    args = shim_parse(minimal[3:])
    assert (args.model_path, args.port, args.dtype, args.tp_size, args.weight_version) == (
        "/m",
        30000,
        "auto",
        1,
        "0",
    )
    assert args.enable_metrics and not args.skip_server_warmup and args.mem_fraction_static is None
    assert (
        not args.enable_memory_saver and not args.enable_weights_cpu_backup and not args.enable_fp32_lm_head
    )
    with pytest.raises(SystemExit):  # the shim rejects unknown flags, as SGLang's argparse does
        shim_parse([*minimal[3:], "--no-such-flag"])


def _sglang_lora_args_text() -> str:
    """The source of SGLang's ServerArgs fields (server_args.py, or its `lora` field namespace in newer
    versions); skips the test where SGLang is not installed."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("SGLang is not installed: its server_args cannot be checked")
    srt = Path(spec.origin).parent / "srt"
    return "".join(
        f.read_text()
        for f in (srt / "server_args.py", srt / "arg_groups" / "fields" / "lora.py")
        if f.exists()
    )


def test_lora_job_command_enables_lora_with_sglang_flags():
    lora = LoraSpec(rank=16, alpha=32, target_modules=["q_proj", "v_proj", "down_proj"])
    cmd = sglang_command("/m", 30000, SGLangSpec(), lora=lora)
    i = cmd.index("--enable-lora")
    assert cmd[i:] == [
        "--enable-lora",
        "--max-lora-rank",
        "16",
        "--lora-target-modules",
        "q_proj",
        "v_proj",
        "down_proj",
        "--max-loras-per-batch",
        "2",
    ]
    args = shim_parse(cmd[3:])
    assert (args.enable_lora, args.max_lora_rank, args.lora_target_modules, args.max_loras_per_batch) == (
        True,
        16,
        ["q_proj", "v_proj", "down_proj"],
        2,
    )
    assert "--enable-lora" not in sglang_command("/m", 30000, SGLangSpec())
    # the flags are SGLang's own: its ServerArgs fields (server_args.py, or its `lora` field namespace
    # in newer versions) where SGLang is installed
    text = _sglang_lora_args_text()
    for name in ("enable_lora", "max_lora_rank", "lora_target_modules", "max_loras_per_batch"):
        assert re.search(rf"^\s+{name}\s*:", text, re.M), name


def test_lora_job_starts_sglang_with_its_untrained_adapter(tmp_path, tiny_model_dir):
    """A LoRA job's version 0 on SGLang: a zero PEFT directory loaded at start (--lora-paths NAME=PATH);
    an engine that loads it answers as the base model under the adapter's name."""
    from generator_fleet.launch import write_untrained_adapter

    lora = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "down_proj"], name="pol")
    path = write_untrained_adapter(str(tiny_model_dir), lora, tmp_path / "untrained")
    assert json.loads((path / "adapter_config.json").read_text())["r"] == 4
    cmd = sglang_command("/m", 30000, SGLangSpec(), lora=lora, initial_adapter=str(path))
    assert cmd[-2:] == ["--lora-paths", f"pol={path}"]
    assert shim_parse(cmd[3:]).lora_paths == [f"pol={path}"]
    server = EngineServer(str(tiny_model_dir), torch_threads=1, lora=lora).start()
    try:
        server.runner.load_lora_from_dir("pol", str(path))
        body = {"input_ids": [1, 5, 6, 3], "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
        base = http_calls.post(server.url + "/generate", json=body, timeout=60).json()["output_ids"]
        on_adapter = http_calls.post(
            server.url + "/generate", json={**body, "lora_path": "pol"}, timeout=60
        ).json()
        assert on_adapter["output_ids"] == base
    finally:
        server.stop()
    text = _sglang_lora_args_text()
    assert re.search(r"^\s+lora_paths\s*:", text, re.M)
