"""The built-in engine's HTTP shapes: request bodies as SGLang's native API sends them (msgspec Structs,
decoded straight from the raw body) and the JSON answers in SGLang's shapes (errors, control results)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import Response

# ---- request bodies ------------------------------------------------------------------------------


class SamplingParamsIn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`sampling_params` as sent: SGLang's keys only (others are a 400); null means the default."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    # Detokenization only: they shape `text`, never the tokens.
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    # Accepted and ignored: SGLang also ignores custom_params without a custom logit processor.
    custom_params: dict[str, Any] | None = None
    # Grammar-constrained decoding (xgrammar): one of json_schema / regex / ebnf per request; null and ""
    # mean unconstrained. structural_tag is refused when non-empty (ignoring it would silently change what
    # the policy generates). stop_regex stops at a match in the output.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    stop_regex: str | list[str] | None = None


class GenerateReqIn(msgspec.Struct, kw_only=True):
    """POST /generate body (unknown top-level fields are ignored, as SGLang's dataclass does)."""

    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    input_embeds: list[Any] | None = None
    sampling_params: SamplingParamsIn | list[SamplingParamsIn] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int | list[int]] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    lora_path: Any = None
    priority: int | None = None
    """Queue priority (SGLang's, with its default order): a larger value is admitted first; null = 0."""


class StartProfile(msgspec.Struct, kw_only=True):
    """SGLang's /start_profile body (its other fields, e.g. profile_by_stage, are accepted and ignored)."""

    output_dir: str | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    record_shapes: bool = False
    with_stack: bool = False


class PauseGeneration(msgspec.Struct, kw_only=True):
    mode: str = "abort"


class ContinueGeneration(msgspec.Struct, kw_only=True):
    torch_empty_cache: bool = False


class AbortRequest(msgspec.Struct, kw_only=True):
    rid: str = ""
    abort_all: bool = False


class GetWeightsByName(msgspec.Struct, kw_only=True):
    """POST /get_weights_by_name (SGLang's GetWeightsByNameReqInput): the first `truncate_size` rows of
    the weight `name` (HF name), as nested lists of numbers."""

    name: str
    truncate_size: int = 100


class UpdateWeightVersion(msgspec.Struct, kw_only=True):
    new_version: str
    abort_all_requests: bool = False


class UpdateWeightsFromDisk(msgspec.Struct, kw_only=True):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


T = TypeVar("T")


class BadRequest(Exception):
    """A handler's ValueError-class failure, rendered as {"error": {"message"}} (SGLang)."""


# ---- responses -----------------------------------------------------------------------------------


def json_response(obj: Any, status_code: int = 200) -> Response:
    """`obj` as a JSON response, encoded by msgspec."""
    return Response(msgspec.json.encode(obj), status_code=status_code, media_type="application/json")


def validation_error(message: str) -> Response:
    """A body that does not decode: SGLang's 400 shape."""
    return json_response(
        {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}, 400
    )


def http_error(code: int, message: str) -> Response:
    """SGLang's error object for HTTP status `code`."""
    body = {
        "object": "error",
        "message": message,
        "type": HTTPStatus(code).phrase,
        "param": None,
        "code": code,
    }
    return json_response(body, code)


def value_error(message: str, code: int = 400) -> Response:
    """A request SGLang rejects with a ValueError: {"error": {"message"}}."""
    return json_response({"error": {"message": message}}, code)


def control(success: bool, message: str, **extra: Any) -> Response:
    """A control endpoint's {"success", "message"} answer: 200, or 400 when it failed."""
    return json_response({"success": success, "message": message, **extra}, 200 if success else 400)


async def decode(request: Request, typ: type[T]) -> T:
    """Decode the body into `typ`; an empty body means all defaults (SGLang's control endpoints accept it)."""
    body = await request.body()
    return msgspec.json.decode(body or b"{}", type=typ)
