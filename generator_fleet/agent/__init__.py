"""Multi-turn, tool-using episodes: tool-call parsing, rendering, and the agent loop."""

from __future__ import annotations


def build_agent(spec, tokenizer):
    """The AgentLoop a job spec asks for (spec.agent, spec.tools, spec.rollout.sampling)."""
    from generator_fleet.agent.loop import AgentLoop, Limits
    from generator_fleet.agent.parser import get_parser
    from generator_fleet.tools import build_tools

    a = spec.agent
    tools = build_tools(spec.tools)
    sp = spec.rollout.sampling
    return AgentLoop(
        tokenizer,
        tools,
        get_parser(a.parser),
        Limits(
            max_turns=a.max_turns,
            max_total_tokens=a.max_total_tokens,
            max_new_tokens=sp.max_new_tokens,
            tool_timeout_s=a.tool_timeout_s,
        ),
        {"temperature": sp.temperature, "top_p": sp.top_p},
        system_prompt=a.system_prompt,
    )
