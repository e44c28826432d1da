"""Translation between SGLang's /generate JSON and the runner: a request body becomes runner requests
(prompts tokenized, per-item fields resolved, SGLang's checks and messages), and a Completion becomes
SGLang's result object (text with stop trimming, meta_info, logprob triples)."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from generator_fleet.engine.api_types import BadRequest, GenerateReqIn, SamplingParamsIn
from generator_fleet.engine.grammar import KINDS, GrammarError
from generator_fleet.engine.lora import LoraError
from generator_fleet.engine.request import Completion, SamplingParams
from generator_fleet.engine.request import Request as GenRequest
from generator_fleet.engine.runner import Runner

MAX_LOGIT_BIAS = 100.0
"""|logit_bias| bound (OpenAI's range): +-100 already forces or bans a token; more overflows the logits."""
SEED_RANGE = (-(1 << 63), 1 << 64)
"""What torch.Generator.manual_seed takes."""


class Item(msgspec.Struct):
    """One result of a /generate call: the runner request plus what shapes its JSON."""

    req: GenRequest
    sp: SamplingParamsIn
    grammar: tuple[str, str] | None = None
    """(kind, text) of the request's regex / json_schema / ebnf; compiled by `attach_constraints`."""


def per_item(value: Any, i: int, n_items: int, name: str, default: Any) -> Any:
    if isinstance(value, list):
        if len(value) != n_items:
            raise BadRequest(f"{name} has {len(value)} entries for a batch of {n_items}")
        value = value[i]
    return default if value is None else value


def grammar_of(sp: SamplingParamsIn) -> tuple[str, str] | None:
    """The (kind, text) of `sp`'s grammar, None when unconstrained. Empty values mean "unconstrained":
    SGLang's frontend sends the keys empty with every gen. At most one kind (SGLang's check)."""
    if sp.structural_tag:
        raise BadRequest(
            "sampling_params.structural_tag is not supported by the built-in engine "
            "(regex, json_schema and ebnf are)"
        )
    set_ = [(k, getattr(sp, k)) for k in KINDS if getattr(sp, k)]
    if len(set_) > 1:
        raise BadRequest("Only one of regex, json_schema, or ebnf can be set.")
    return set_[0] if set_ else None


def attach_constraints(items: list[Item], runner: Runner) -> None:
    """Compile each constrained item's grammar (cached by text) and give its request a fresh matcher;
    BadRequest with xgrammar's message for an invalid one. Blocking: run it off the event loop."""
    for it in items:
        if it.grammar is not None:
            try:
                it.req.constraint = runner.grammar.constraint(*it.grammar)
            except GrammarError as e:
                raise BadRequest(str(e)) from None


def resolve_sampling(sp: SamplingParamsIn, prompt_len: int, runner: Runner) -> SamplingParams:
    fields = {
        f: getattr(sp, f)
        for f in SamplingParams.__struct_fields__
        if f not in ("stop", "stop_regex", "stop_token_ids", "logit_bias")
        and getattr(sp, f, None) is not None
    }
    if sp.stop is not None:
        fields["stop"] = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop)
    if sp.stop_regex:
        fields["stop_regex"] = (sp.stop_regex,) if isinstance(sp.stop_regex, str) else tuple(sp.stop_regex)
    if sp.stop_token_ids is not None:
        fields["stop_token_ids"] = tuple(sp.stop_token_ids)
    if sp.logit_bias:
        try:
            fields["logit_bias"] = {int(k): float(v) for k, v in sp.logit_bias.items()}
        except ValueError:
            raise BadRequest("logit_bias keys must be token ids") from None
        if any(not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in fields["logit_bias"].values()):
            raise BadRequest(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}].")
    if sp.sampling_seed is not None and not SEED_RANGE[0] <= sp.sampling_seed < SEED_RANGE[1]:
        raise BadRequest(f"sampling_seed must be a 64-bit integer, got {sp.sampling_seed}.")
    # SGLang: an explicit max_new_tokens that does not fit is an error; the default is clamped.
    max_total = runner.context_length - 1
    if sp.max_new_tokens is not None and prompt_len + sp.max_new_tokens > max_total:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {runner.context_length} "
            f"tokens. You requested a total of {prompt_len + sp.max_new_tokens} tokens: {prompt_len} tokens "
            f"from the input messages and {sp.max_new_tokens} tokens for the completion."
        )
    if sp.max_new_tokens is None:
        fields["max_new_tokens"] = max(0, min(SamplingParams().max_new_tokens, max_total - prompt_len))
    params = SamplingParams(**fields)
    try:
        params.verify()
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return params


# Long: a table of SGLang's launch flags and what each becomes
def expand(body: GenerateReqIn, runner: Runner, max_requests: int) -> tuple[list[Item], bool]:
    """Turn a /generate body into runner requests in response order; returns (items, is_batch).
    `max_requests`: most requests (prompts x n) one call may make."""
    for key in ("input_embeds", "image_data", "video_data", "audio_data", "token_ids_logprob"):
        if getattr(body, key) is not None:
            raise BadRequest(f"{key} is not supported by the built-in engine")
    if (body.text is None) == (body.input_ids is None):
        raise BadRequest("Either text or input_ids should be provided.")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        prompts = [runner.tokenizer.encode(t) for t in texts]
        is_batch = not isinstance(body.text, str)
    else:
        ids = body.input_ids
        if not ids:
            raise BadRequest("input_ids cannot be empty.")
        if all(isinstance(x, int) for x in ids):
            prompts, is_batch = [list(ids)], False
        elif all(isinstance(x, list) for x in ids):
            prompts, is_batch = [list(x) for x in ids], True
        else:
            raise BadRequest("input_ids must be a list of ints or a list of lists of ints.")
    if not prompts:
        raise BadRequest("the batch is empty.")
    for p in prompts:
        if not p:
            raise BadRequest("input_ids cannot be empty.")
        if len(p) >= runner.context_length:
            raise BadRequest(
                f"The input ({len(p)} tokens) is longer than the model's context length ({runner.context_length} tokens)."
            )
        if min(p) < 0 or max(p) >= runner.vocab_size:
            raise BadRequest(
                f"The input_ids {p} contain values outside the vocabulary (size {runner.vocab_size})."
            )

    sps = body.sampling_params
    if isinstance(sps, list) and not is_batch:
        raise BadRequest("sampling_params is a list but the request is not a batch.")
    sps_by_prompt = [
        per_item(sps, i, len(prompts), "sampling_params", SamplingParamsIn()) for i in range(len(prompts))
    ]
    ns = {sp.n if sp.n is not None else 1 for sp in sps_by_prompt}
    if len(ns) != 1:
        raise BadRequest("The parallel sample number n must be the same across a batch.")
    n = ns.pop()
    if n < 1:
        raise BadRequest(f"n must be at least 1, got {n}.")
    if len(prompts) * n > max_requests:
        raise BadRequest(
            f"the call asks for {len(prompts)} prompt(s) x n={n} = {len(prompts) * n} requests; "
            f"the engine takes at most {max_requests} per call."
        )
    rids = body.rid
    if isinstance(rids, list) and len(rids) != len(prompts):
        raise BadRequest("The rid list must match the batch size.")
    if isinstance(rids, list) and len(set(rids)) != len(rids):
        raise BadRequest("Duplicate rids in one batch.")
    lora_names = lora_paths(body.lora_path, len(prompts), is_batch, runner)
    is_batch = is_batch or n > 1

    items: list[Item] = []
    for i, (prompt, sp) in enumerate(zip(prompts, sps_by_prompt, strict=True)):
        params = resolve_sampling(sp, len(prompt), runner)
        grammar = grammar_of(sp)
        return_logprob = bool(per_item(body.return_logprob, i, len(prompts), "return_logprob", False))
        start = int(per_item(body.logprob_start_len, i, len(prompts), "logprob_start_len", -1))
        top_k = int(per_item(body.top_logprobs_num, i, len(prompts), "top_logprobs_num", 0))
        for _ in range(n):
            if n > 1 or rids is None:
                rid = uuid.uuid4().hex  # SGLang gives parallel samples fresh rids
            elif isinstance(rids, list):
                rid = rids[i]
            else:
                rid = f"{rids}_{i}" if is_batch else rids
            req = GenRequest(
                rid,
                prompt,
                params,
                return_logprob=return_logprob,
                logprob_start_len=start,
                top_logprobs_num=top_k,
                priority=body.priority or 0,
                lora_name=lora_names[i],
            )
            items.append(Item(req, sp, grammar))
    return items, is_batch


def lora_paths(value: Any, n_prompts: int, is_batch: bool, runner: Runner) -> list[str | None]:
    """Each prompt's LoRA adapter from /generate's `lora_path` (SGLang: an adapter name, or a list of one
    per prompt; null = the base model); 400 for an adapter that is not loaded."""
    if value is None:
        return [None] * n_prompts
    if isinstance(value, list):
        if not is_batch and len(value) == 1:
            names = value
        elif len(value) != n_prompts:
            raise BadRequest(f"lora_path has {len(value)} entries for a batch of {n_prompts}")
        else:
            names = value
    else:
        names = [value] * n_prompts
    for name in names:
        if name is not None and not isinstance(name, str):
            raise BadRequest(f"lora_path entries are adapter names (strings) or null, got {name!r}")
        try:
            runner.check_lora(name)
        except LoraError as e:
            raise BadRequest(str(e)) from None
    return list(names)


def render(c: Completion, item: Item, tokenizer, return_text_in_logprobs: bool) -> dict[str, Any]:
    """SGLang's non-streaming /generate result for one request."""
    sp, req = item.sp, item.req
    skip = sp.skip_special_tokens is not False
    spaces = sp.spaces_between_special_tokens is not False
    text_ids = c.output_ids
    matched = c.finish_reason.get("matched")
    if isinstance(matched, int) and not sp.no_stop_trim and text_ids:
        text_ids = text_ids[:-1]  # SGLang trims the matched stop token from text (not from output_ids)
    text = tokenizer.decode(text_ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    if isinstance(matched, str) and not sp.no_stop_trim:
        cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    meta: dict[str, Any] = {
        "id": c.rid,
        "finish_reason": c.finish_reason or None,  # null in intermediate stream events
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": len(c.output_ids),
        "cached_tokens": c.cached_tokens,
        "reasoning_tokens": 0,
        "weight_version": c.weight_version,
        "num_retractions": c.num_retractions,
    }
    if len(c.weight_versions) > 1:
        meta["weight_versions"] = c.weight_versions
    if req.return_logprob:

        def tok_text(t: int) -> str | None:
            return tokenizer.decode([t]) if return_text_in_logprobs else None

        meta["output_token_logprobs"] = [
            [lp, t, tok_text(t)] for lp, t in zip(c.output_logprobs, c.output_ids, strict=True)
        ]
        meta["output_token_logprobs_length"] = len(c.output_ids)
        if c.input_logprobs is not None:
            prompt = req.prompt_ids[len(req.prompt_ids) - len(c.input_logprobs) :]
            meta["input_token_logprobs"] = [
                [lp, t, tok_text(t)] for lp, t in zip(c.input_logprobs, prompt, strict=True)
            ]
        else:
            meta["input_token_logprobs"] = []
        if c.output_top_logprobs is not None:
            meta["output_top_logprobs"] = [
                [[lp, t, tok_text(t)] for lp, t in pos] for pos in c.output_top_logprobs
            ]
            meta["input_top_logprobs"] = None
    meta["e2e_latency"] = c.e2e_latency
    return {"text": text, "output_ids": c.output_ids, "meta_info": meta}
