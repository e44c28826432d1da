"""Multi-turn, tool-using episodes: tool-call parsing, rendering, and the agent loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from generator_fleet.config import AgentSpec, SamplingSpec
    from generator_fleet.tools.spec import ToolSpec


def build_agent(agent: AgentSpec, tools: list[ToolSpec], sampling: SamplingSpec, tokenizer):
    """The AgentLoop of a job's `agent`, `tools` and `rollout.sampling` sections."""
    from generator_fleet.agent.loop import AgentLoop, Limits
    from generator_fleet.agent.parser import get_parser
    from generator_fleet.tools import build_tools

    a, sp = agent, sampling
    return AgentLoop(
        tokenizer,
        build_tools(tools),
        get_parser(a.parser),
        Limits(
            max_turns=a.max_turns,
            max_total_tokens=a.max_total_tokens,
            max_new_tokens=sp.max_new_tokens,
            tool_timeout_s=a.tool_timeout_s,
        ),
        {"temperature": sp.temperature, "top_p": sp.top_p},
        system_prompt=a.system_prompt,
        constrain_tool_calls=a.constrain_tool_calls,
    )
