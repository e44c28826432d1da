"""The `generators` section for real SGLang and external engines: what a valid spec says, and bad
combinations failing before anything starts, with the path of the key at fault."""

import pytest

import jobspec


def test_sglang_and_external_specs_resolve():
    spec = jobspec.from_dict(
        {
            "generators": {
                "engine": "sglang",
                "num_engines": 2,
                "router_url": "http://127.0.0.1:30000",
                "sglang": {
                    "tp_size": 2,
                    "dtype": "bfloat16",
                    "extra_args": ["--attention-backend", "triton"],
                },
            }
        }
    )
    assert spec.generators.sglang.tp_size == 2 and spec.generators.sglang.enable_metrics
    spec = jobspec.from_dict({"generators": {"engine": "external", "router_url": "http://r:30000"}})
    assert spec.generators.urls == []  # the workers come from the router
    spec = jobspec.from_dict({})
    assert spec.generators.engine == "builtin" and spec.generators.sglang == jobspec.SGLangSpec()


def test_overrides_reach_the_new_keys(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("generators: {engine: external}\n")
    spec = jobspec.load(
        path, ["generators.urls=[http://h:1, http://h:2]", "generators.api_key_env=ENGINE_KEY"]
    )
    assert spec.generators.urls == ["http://h:1", "http://h:2"]


@pytest.mark.parametrize(
    "generators, path, words",
    [
        ({"engine": "external"}, "$.generators.urls", "needs `urls`"),
        ({"engine": "external", "urls": ["h:1"]}, "$.generators.urls[0]", "http(s)://"),
        ({"engine": "external", "urls": ["http://h:1", "http://h:1/"]}, "$.generators.urls[1]", "twice"),
        (
            {"engine": "external", "urls": ["http://h:1"], "num_engines": 2},
            "$.generators.num_engines",
            "urls",
        ),
        ({"urls": ["http://h:1"]}, "$.generators.urls", "only for engine `external`"),
        ({"engine": "sglang", "api_key_env": "K"}, "$.generators.api_key_env", "only for engine `external`"),
        ({"sglang": {"tp_size": 2}}, "$.generators.sglang", "only for engine `sglang`"),
        ({"router_url": "http://r:1"}, "$.generators.router_url", "fronts `sglang` or `external`"),
        ({"engine": "sglang", "router_url": "r:1"}, "$.generators.router_url", "http(s)://"),
        ({"engine": "sglang", "sglang": {"dtype": "fp8"}}, "$.generators.sglang.dtype", "fp8"),
        (
            {"engine": "sglang", "sglang": {"mem_fraction_static": 1.5}},
            "$.generators.sglang.mem_fraction_static",
            "",
        ),
        ({"engine": "vllm"}, "$.generators.engine", "vllm"),
        (
            {"engine": "sglang", "fp32_lm_head": True},
            "$.generators.fp32_lm_head",
            "sglang.enable_fp32_lm_head",
        ),
    ],
)
def test_bad_engine_combinations_fail_with_their_path(generators, path, words):
    with pytest.raises(jobspec.JobSpecError) as e:
        jobspec.from_dict({"generators": generators})
    assert str(e.value).endswith(f"- at `{path}`") and words in str(e.value)


def test_fp32_lm_head_reaches_the_builtin_engines_options():
    from generator_fleet.config import engine_options

    spec = jobspec.from_dict({"generators": {"fp32_lm_head": True}})
    assert engine_options(spec.model, spec.generators).fp32_lm_head
    assert not engine_options(spec.model, jobspec.from_dict({}).generators).fp32_lm_head


@pytest.mark.parametrize(
    "raw, on",
    [
        ({}, False),
        ({"generators": {"fp32_lm_head": True}}, True),
        ({"generators": {"engine": "sglang", "sglang": {"enable_fp32_lm_head": True}}}, True),
        ({"generators": {"engine": "sglang"}}, False),
        ({"generators": {"engine": "external", "urls": ["http://127.0.0.1:1"]}}, False),
        (
            {
                "generators": {"engine": "external", "urls": ["http://127.0.0.1:1"]},
                "trainer": {"fp32_lm_head": True},
            },
            True,
        ),
        ({"generators": {"fp32_lm_head": True}, "trainer": {"fp32_lm_head": False}}, False),
        ({"generators": {"fp32_lm_head": True}, "trainer": {"mixed_precision": "fp32"}}, False),
    ],
)
def test_trainer_fp32_lm_head_follows_the_engines_unless_set(raw, on):
    """trainer.fp32_lm_head null: the engines' fp32 head drives the trainer's; set: it decides."""
    spec = jobspec.from_dict(raw)
    assert spec.trainer_fp32_lm_head is on
    assert spec.trainer_config().trainer.fp32_lm_head is on


def test_trainer_fp32_lm_head_on_fp32_compute_fails_with_its_path():
    with pytest.raises(jobspec.JobSpecError) as e:
        jobspec.from_dict({"trainer": {"fp32_lm_head": True, "mixed_precision": "fp32"}})
    assert str(e.value).endswith("- at `$.trainer.fp32_lm_head`") and "mixed_precision fp32" in str(e.value)
