"""Rendering multi-turn conversations as tokens turn by turn equals rendering them whole (ChatML on a
tiny character-level tokenizer; SmolLM2's real template is checked in
tests/system/trainer/test_pretrained_smollm2.py)."""

from __future__ import annotations

import string

import pytest

from generator_fleet.agent.render import TemplateNotPrefixStable, render_delta, render_prompt
from model_zoo.tiny import build_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347 * 29"}}\n</tool_call>'
CONVERSATION = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "A farmer has 347 crates with 29 apples each. How many apples?"},
    {"role": "assistant", "content": TOOL_CALL},
    {"role": "tool", "content": "10063"},
    {"role": "assistant", "content": "The answer is 10063."},
]


def chatml_tokenizer(template: str = CHATML):
    alphabet = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")
    tok = build_tokenizer(alphabet, [alphabet])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def tok():
    return chatml_tokenizer()


def turn_suffix(tok) -> list[int]:
    """What the template puts after the stop token of an assistant turn (ChatML: "\\n")."""
    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    ids = render_prompt(tok, msgs, add_generation_prompt=False)
    return ids[len(ids) - ids[::-1].index(tok.eos_token_id) :]


def build_like_the_agent(tok, messages) -> list[int]:
    """Prompt tokens, then per assistant turn its 'sampled' tokens (content + stop token), per other
    turn the template's suffix of the previous turn plus render_delta, as the agent loop does."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = render_prompt(tok, messages[:first])
    for k in range(first, len(messages)):
        if messages[k]["role"] == "assistant":
            ids += tok(messages[k]["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        else:
            next_is_model = k + 1 < len(messages) and messages[k + 1]["role"] == "assistant"
            ids += turn_suffix(tok) + render_delta(tok, messages[:k], [messages[k]], next_is_model)
    return ids + turn_suffix(tok)


def test_delta_chain_equals_whole_rendering(tok):
    ids = render_prompt(tok, CONVERSATION[:1], add_generation_prompt=False)
    for k in range(1, len(CONVERSATION)):
        ids += render_delta(tok, CONVERSATION[:k], [CONVERSATION[k]], add_generation_prompt=False)
    assert ids == render_prompt(tok, CONVERSATION, add_generation_prompt=False)


def test_delta_of_several_messages_ends_with_generation_prompt(tok):
    delta = render_delta(tok, CONVERSATION[:3], CONVERSATION[3:4] + [{"role": "user", "content": "sure?"}])
    whole = render_prompt(tok, CONVERSATION[:3] + CONVERSATION[3:4] + [{"role": "user", "content": "sure?"}])
    assert render_prompt(tok, CONVERSATION[:3], add_generation_prompt=False) + delta == whole
    assert tok.decode(delta).endswith("<|im_start|>assistant\n")
    assert tok.decode(delta).startswith("<|im_start|>tool\n10063<|im_end|>\n")


def test_agent_style_incremental_tokens_equal_retokenizing(tok):
    assert build_like_the_agent(tok, CONVERSATION) == render_prompt(
        tok, CONVERSATION, add_generation_prompt=False
    )


def test_template_that_rewrites_earlier_turns_is_refused():
    counting = "<|im_start|>system\nturns: {{ messages | length }}<|im_end|>\n" + CHATML
    with pytest.raises(TemplateNotPrefixStable, match="not prefix-stable"):
        render_delta(chatml_tokenizer(counting), CONVERSATION[:3], CONVERSATION[3:4])


def test_missing_template_and_empty_delta_are_errors(tok):
    with pytest.raises(ValueError, match="no chat template"):
        render_prompt(chatml_tokenizer(template=None), CONVERSATION)
    with pytest.raises(ValueError, match="at least one new message"):
        render_delta(tok, CONVERSATION, [])
