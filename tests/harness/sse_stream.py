"""Reading a streaming /generate (SGLang's SSE framing) in the engine's HTTP tests."""

from __future__ import annotations

import json

import http_calls


def stream_objects(url: str, body: dict, api_key: str, timeout: float = 120) -> list[dict]:
    """POST /generate with `body` (which asks to stream) and return its events' JSON objects in order,
    the closing `data: [DONE]` left out."""
    with http_calls.stream(
        "POST", url + "/generate", json=body, headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout
    ) as r:
        return [
            json.loads(line[len("data:") :])
            for line in r.iter_lines()
            if line.startswith("data:") and line.strip() != "data: [DONE]"
        ]
