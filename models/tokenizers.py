"""Loading a model directory's tokenizer the way it was saved.

transformers 5 picks the tokenizer class from the model config's `model_type` (Qwen2 -> Qwen2Tokenizer)
and that class rebuilds its own byte-level pre-tokenizer, ignoring the saved tokenizer.json: our
character-level tokenizers then silently drop every space and newline. A directory whose tokenizer was
saved as a generic fast tokenizer is therefore loaded as exactly that.

AutoTokenizer is imported only for the other directories: its module imports transformers' model
configuration, and with it torch, which a rollout worker does not use (loading a tiny model's tokenizer
takes 0.4 CPU-s instead of 1.7 in a process without torch).
"""

from __future__ import annotations

import json
from pathlib import Path

GENERIC_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def load_tokenizer(path: str | Path):
    cfg = Path(path) / "tokenizer_config.json"
    if cfg.exists() and json.loads(cfg.read_text()).get("tokenizer_class") in GENERIC_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
