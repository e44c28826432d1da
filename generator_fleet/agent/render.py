"""Chat-template rendering as token ids, whole (`render_prompt`) or as the delta that new messages add
(`render_delta`), so a multi-turn episode grows by appending tokens instead of re-tokenizing.

Appending deltas is only correct when the template is prefix-stable: rendering a conversation extends
the rendering of every shorter prefix of it. ChatML templates (SmolLM2, Qwen2.5) are; templates that
rewrite earlier turns (e.g. dropping past reasoning, or a system line that counts the turns) are not,
and `render_delta` refuses them rather than build sequences the model never sees at inference.
"""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]


class TemplateNotPrefixStable(ValueError):
    """The chat template renders a conversation's earlier turns differently once more turns follow."""


def _render_text(
    tokenizer, messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool
) -> str:
    if not tokenizer.chat_template:
        raise ValueError(f"{type(tokenizer).__name__} has no chat template; set tokenizer.chat_template")
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )


def _tokenize(tokenizer, text: str) -> list[int]:
    # The template writes every special token itself (no BOS added on top), as apply_chat_template does.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render_prompt(
    tokenizer, messages: list[Message], tools: list[dict] | None = None, *, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template, by default ending with the
    generation prompt (e.g. `<|im_start|>assistant\\n`). `tools` are OpenAI-style function schemas for
    templates with a tools section; templates without one ignore them (put tool instructions in the
    system prompt instead)."""
    return _tokenize(tokenizer, _render_text(tokenizer, messages, tools, add_generation_prompt))


def render_delta(
    tokenizer,
    history_messages: list[Message],
    new_messages: list[Message],
    add_generation_prompt: bool = True,
    *,
    tools: list[dict] | None = None,
) -> list[int]:
    """Tokens to append to `render_prompt(history_messages, add_generation_prompt=False)` to get
    `render_prompt(history_messages + new_messages, add_generation_prompt=...)`.

    When `history_messages` ends with a sampled assistant turn, the caller's tokens stop at the stop
    token (`<|im_end|>`), while the template's rendering of that turn may go on (ChatML adds "\\n"):
    the caller appends those template tokens before this delta.

    Raises TemplateNotPrefixStable when the longer rendering does not start with the shorter one.
    """
    if not new_messages:
        raise ValueError("render_delta needs at least one new message")
    history_text = _render_text(tokenizer, history_messages, tools, False)
    full_text = _render_text(tokenizer, history_messages + new_messages, tools, add_generation_prompt)
    roles = [m.get("role") for m in new_messages]
    if not full_text.startswith(history_text):
        at = next(
            (i for i, (a, b) in enumerate(zip(history_text, full_text, strict=False)) if a != b),
            len(full_text),
        )
        raise TemplateNotPrefixStable(
            f"chat template is not prefix-stable: adding {roles} to {len(history_messages)} messages rewrites "
            f"the earlier rendering at character {at} ({history_text[at : at + 30]!r} became "
            f"{full_text[at : at + 30]!r}); multi-turn episodes cannot be built by appending tokens"
        )
    history, full = _tokenize(tokenizer, history_text), _tokenize(tokenizer, full_text)
    if full[: len(history)] != history:
        raise TemplateNotPrefixStable(
            f"adding {roles} to {len(history_messages)} messages re-tokenizes the end of the earlier rendering "
            f"({history_text[-30:]!r}): the template joins turns without a special token between them"
        )
    return full[len(history) :]
