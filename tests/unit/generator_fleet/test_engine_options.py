"""EngineOptions as the one statement of the built-in engine's options: the command line's flags come from
its fields (help from their docstrings, bounds checked), EngineServer takes it or its fields by name, and
a job spec's generators section maps onto it."""

from __future__ import annotations

import argparse

import msgspec
import pytest

import jobspec
from generator_fleet.engine import EngineServer
from generator_fleet.engine.options import CLI_DEFAULTS, EngineOptions, add_arguments, field_docs, from_args


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engine", exit_on_error=False)
    add_arguments(p)
    return p


def test_every_field_is_a_documented_flag():
    p = _parser()
    dests = {a.dest: a for a in p._actions if a.dest != "help"}
    docs = field_docs(EngineOptions)
    for f in msgspec.structs.fields(EngineOptions):
        assert f.name in dests, f.name
        assert docs.get(f.name), f"{f.name} has no docstring"
        assert docs[f.name] in dests[f.name].help


def test_flags_parse_into_options_with_the_struct_defaults():
    opts = from_args(_parser().parse_args(["--model", "/m"]))
    defaults = EngineOptions(model_path="/m")
    assert opts == msgspec.structs.replace(defaults, **CLI_DEFAULTS)
    opts = from_args(
        _parser().parse_args(
            ["--model-path", "/m", "--dtype", "float16", "--disable-cuda-graph", "--max-batch-size", "8"]
        )
    )
    assert (opts.model_path, opts.dtype, opts.disable_cuda_graph, opts.max_batch_size) == (
        "/m",
        "float16",
        True,
        8,
    )


@pytest.mark.parametrize(
    "args, field",
    [
        (["--max-batch-size", "0"], "max_batch_size"),
        (["--port", "70000"], "port"),
        (["--fatal-exit-grace-s", "-1"], "fatal_exit_grace_s"),
        (["--max-requests-per-call", "0"], "max_requests_per_call"),
    ],
)
def test_flags_outside_their_bounds_are_refused(args, field):
    with pytest.raises(ValueError, match=field):
        from_args(_parser().parse_args(["--model", "/m", *args]))


def test_engine_server_takes_options_or_fields_by_name():
    opts = EngineOptions(model_path="/m", context_length=64)
    server = EngineServer(opts, max_batch_size=4)
    assert server.options == msgspec.structs.replace(opts, max_batch_size=4)
    assert EngineServer("/m", context_length=64).options == opts
    with pytest.raises(ValueError, match="no_such_option"):
        EngineServer("/m", no_such_option=1)
    with pytest.raises(ValueError, match="max_batch_size"):
        EngineServer("/m", max_batch_size=0)


def test_a_job_spec_maps_its_generators_section_onto_engine_options():
    spec = jobspec.loads(
        "model: {path: /models/p}\ngenerators: {max_batch_size: 12, torch_threads: 3, gpus_per_engine: 1}\n"
    )
    opts = jobspec.engine_options(spec)
    assert opts == EngineOptions(model_path="/models/p", max_batch_size=12, torch_threads=3, device="cuda")
    cpu = jobspec.engine_options(jobspec.loads("model: {path: /models/p}\n"))
    assert cpu.device == "cpu" and cpu.torch_threads == 1
    assert cpu.max_batch_size == EngineOptions(model_path="x").max_batch_size
    with pytest.raises(jobspec.JobSpecError, match="max_batch_size"):
        jobspec.loads("generators: {max_batch_size: 0}\n")


def test_mem_fraction_static_is_sglangs_flag_and_a_builtin_generators_key():
    opts = from_args(_parser().parse_args(["--model", "/m", "--mem-fraction-static", "0.4"]))
    assert opts.mem_fraction_static == 0.4
    assert EngineOptions(model_path="/m").mem_fraction_static is None  # null: the pool as before
    for bad in ("0", "1", "1.5"):
        with pytest.raises(ValueError, match="mem_fraction_static"):
            from_args(_parser().parse_args(["--model", "/m", "--mem-fraction-static", bad]))
    spec = jobspec.loads("model: {path: /p}\ngenerators: {mem_fraction_static: 0.3, gpus_per_engine: 1}\n")
    assert jobspec.engine_options(spec).mem_fraction_static == 0.3
    # SGLang servers take theirs in the sglang section; the error names the key's path.
    with pytest.raises(
        jobspec.JobSpecError, match=r"sglang\.mem_fraction_static.*at `\$\.generators\.mem_fraction_static`"
    ):
        jobspec.loads("generators: {engine: sglang, mem_fraction_static: 0.3}\n")
    with pytest.raises(
        jobspec.JobSpecError,
        match=r"enable_memory_saver.*at `\$\.generators\.sglang\.enable_weights_cpu_backup`",
    ):
        jobspec.loads("generators: {engine: sglang, sglang: {enable_weights_cpu_backup: true}}\n")
    spec = jobspec.loads(
        "generators: {engine: sglang, sglang: {enable_memory_saver: true, enable_weights_cpu_backup: true}}\n"
    )
    assert spec.generators.sglang.enable_memory_saver and spec.generators.sglang.enable_weights_cpu_backup


def test_the_prefix_cache_is_on_unless_sglangs_flag_or_the_job_turns_it_off():
    assert not EngineOptions(model_path="/m").disable_radix_cache
    assert from_args(_parser().parse_args(["--model", "/m", "--disable-radix-cache"])).disable_radix_cache
    assert not jobspec.engine_options(jobspec.loads("model: {path: /p}\n")).disable_radix_cache
    spec = jobspec.loads("model: {path: /p}\ngenerators: {prefix_cache: false}\n")
    assert jobspec.engine_options(spec).disable_radix_cache
    with pytest.raises(jobspec.JobSpecError, match=r"generators\.prefix_cache"):
        jobspec.loads("generators: {prefix_cache: 3}\n")
