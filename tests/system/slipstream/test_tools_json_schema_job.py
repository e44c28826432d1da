"""examples/tools_json_schema.yaml (agent.constrain_tool_calls): the warmed-up tiny tool model's episodes,
built from the example's own sections against a real engine, make only tool calls that parse and fit the
calculator's schema; and the example itself runs briefly as a job (Redis, Ray, engines, trainer, bus),
its logged trajectories' calls checked the same way."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

import jobspec
from generator_fleet.agent import build_agent
from generator_fleet.agent.parser import HermesParser
from generator_fleet.tools.base import ToolContext
from models.tokenizers import load_tokenizer

pytestmark = pytest.mark.usefixtures("shared_ray")  # run_job on the session's Ray

EXAMPLE = "examples/tools_json_schema.yaml"
API_KEY = "json-schema-job-key"


def check_calls(text: str) -> int:
    """Every `<tool_call>` block of an assistant turn's `text` parses and is a calculator call whose
    arguments are exactly {"expression": <string>} (the tool's parameters schema); returns how many. A
    turn that the token budget (max_new_tokens, agent.max_total_tokens) cut off may end inside its last
    call: that unfinished call is left out, nothing before it."""
    last_open, last_close = text.rfind("<tool_call>"), text.rfind("</tool_call>")
    if last_open > last_close:  # cut off by the budget mid-call: only ever the turn's end
        text = text[:last_open]
    parsed = HermesParser().parse(text)
    assert not parsed.errors, (parsed.errors, text)
    for call in parsed.calls:
        assert call.name == "calculator", text
        assert set(call.arguments) == {"expression"} and isinstance(call.arguments["expression"], str), text
    assert text.count("<tool_call>") == len(parsed.calls), text
    return len(parsed.calls)


def test_every_call_of_the_examples_episodes_fits_the_schema(tools_model_dir):
    from generator_fleet.client import EngineClient
    from generator_fleet.engine import EngineServer
    from generator_fleet.tasks.word_problems import WordProblemTask

    spec = jobspec.load(EXAMPLE, [f"model.path={tools_model_dir}", "model.build=null"])
    assert spec.agent.constrain_tool_calls
    tok = load_tokenizer(tools_model_dir)
    agent = build_agent(spec.agent, spec.tools, spec.rollout.sampling, tok)
    problems = WordProblemTask(6, seed=5, difficulty="easy").problems
    server = EngineServer(str(tools_model_dir), api_key=API_KEY, context_length=512).start()

    async def run_all():
        async with EngineClient(server.url, api_key=API_KEY) as client:
            groups = []
            for p in problems:
                ctx = ToolContext(prompt_id=p.prompt_id, answer=str(p.answer))
                groups.append(await agent.run_group(client.generate_batch, p.prompt, ctx, 4))
            return groups

    try:
        groups = asyncio.run(run_all())
    finally:
        server.stop()
    calls = 0
    for episodes in groups:
        for ep in episodes:
            for m in ep.messages:
                if m["role"] == "assistant":
                    calls += check_calls(m["content"])
    assert calls > 0  # the warmed-up model calls the calculator on some problems


def test_the_example_job_runs_and_its_trajectories_calls_fit_the_schema(tmp_path, tools_model_dir):
    from slipstream.job.local import run_job

    spec = jobspec.load(
        EXAMPLE,
        [
            f"model.path={tools_model_dir}",
            "model.build=null",
            f"output_dir={tmp_path / 'run'}",
            "dataset.num_problems=40",
            "rollout.group_size=4",
            "rollout.concurrency=4",
            "algorithm.groups_per_step=2",
            "algorithm.total_steps=2",
        ],
    )
    result = run_job(spec)
    assert result.version == 2
    progress = [json.loads(line) for line in (tmp_path / "run" / "progress.jsonl").read_text().splitlines()]
    steps = [p for p in progress if p.get("kind") != "eval"]
    assert [p["version"] for p in steps] == [1, 2]
    assert sum(p["tool_calls_mean"] for p in steps) > 0
    # Each logged trajectory: the model's segments (assistant turns) hold only well-formed calls.
    text = (tmp_path / "run" / "samples.txt").read_text()
    model_segments = re.findall(
        r"^\[model\] (.*?)(?=^\[(?:model|context|prompt)\] |^=== |\Z)", text, re.M | re.S
    )
    assert model_segments
    for seg in model_segments:
        check_calls(seg.replace("<|im_end|>", "").strip())
