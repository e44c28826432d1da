"""Grammar-constrained decoding with xgrammar: `regex`, `json_schema` and `ebnf` sampling params.

A request's grammar is compiled once (GrammarCompiler over the model's logits width, the engine's EOS ids
as the grammar's stop tokens) in the HTTP handler's worker thread, before the request is queued, so a slow
compile never holds up other requests' steps; compiled grammars are kept in a bounded LRU cache keyed by
(kind, text). Each request (each of n samples) gets its own GrammarMatcher. Every step, the bitmasks of
all constrained rows are filled on the CPU in one batched call and applied to those rows' logits before
sampling, so rows without a grammar pay nothing. As in SGLang's xgrammar backend, the mask comes after the
penalties (masking first gives the same result: penalties keep -inf at -inf), and the reported logprobs
are those of the masked (renormalised) distribution that was sampled from.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence

import torch
import xgrammar as xgr

log = logging.getLogger(__name__)

KINDS = ("json_schema", "regex", "ebnf")
"""The constrained sampling params the engine serves (one per request, as in SGLang)."""
ANY_JSON = "$$ANY$$"
"""SGLang's json_schema value for "any JSON value" (the builtin JSON grammar)."""
DEFAULT_CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""
MAX_GRAMMAR_CHARS = 1 << 20
"""Longest grammar text a request may send (a larger one is refused before compiling)."""
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+?:\d+: ")


class GrammarError(ValueError):
    """A grammar that does not compile; the message is xgrammar's, without its source location."""


def clean_message(exc: BaseException) -> str:
    """xgrammar's error text without the `[hh:mm:ss] file.cc:line: ` prefix."""
    text = str(exc).strip()
    return _XGR_PREFIX.sub("", text).strip()


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of `tokenizer` over `vocab_size` logits. Special tokens (pad, chat markers) other
    than the stop tokens get an empty text, which xgrammar treats as never allowed: otherwise a grammar
    would let `<pad>` stand for its literal text inside a JSON string, and the detokenized output (which
    skips special tokens) would no longer be what the grammar accepted."""
    base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    specials = set(getattr(tokenizer, "all_special_ids", ())) - set(stop_token_ids)
    if not specials:
        return base
    vocab = [""] * vocab_size
    for token, idx in tokenizer.get_vocab().items():
        if idx < vocab_size and idx not in specials:
            vocab[idx] = token
    return xgr.TokenizerInfo(
        vocab,
        vocab_type=base.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=base.add_prefix_space,
    )


class Constraint:
    """One request's grammar state: the matcher advanced by every token the request accepted."""

    __slots__ = ("kind", "matcher", "stuck")

    def __init__(self, kind: str, compiled: xgr.CompiledGrammar) -> None:
        self.kind = kind
        self.matcher = xgr.GrammarMatcher(compiled)
        self.stuck = False
        """No token of the vocabulary can continue the grammar (e.g. a regex over characters the
        tokenizer lacks): the request cannot go on and is aborted."""

    def accept(self, token: int) -> bool:
        """Advance over `token`; False if the grammar does not allow it (the matcher is left unchanged)."""
        if self.matcher.is_terminated():
            return False
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: nothing more may be generated."""
        return bool(self.matcher.is_terminated())


class GrammarBackend:
    """Compiles grammars for one engine's tokenizer and vocabulary, and masks logits with them.
    Thread-safe: compiles run in HTTP worker threads, masks in the generation thread."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        any_whitespace: bool = True,
    ) -> None:
        """`vocab_size`: the model's logits width (may exceed the tokenizer's: padded rows are never
        allowed). `any_whitespace`: JSON grammars allow any whitespace between tokens (SGLang's default);
        False allows the compact and the `json.dumps` default separators only."""
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        """Built on the first compile (a large vocabulary takes a moment to scan)."""
        self.any_whitespace = any_whitespace
        self.cache_size = cache_size
        self._cache: collections.OrderedDict[tuple[str, str], xgr.CompiledGrammar] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._batch = xgr.BatchGrammarMatcher(max_threads=max(1, min(4, os.cpu_count() or 1)))
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.on_compile: list[Callable[[str, float], None]] = []
        """Called with (kind, seconds) after each compile that missed the cache."""
        self.on_compile_error: list[Callable[[str], None]] = []
        """Called with the kind of each grammar that failed to compile."""
        self.on_mask_fill: list[Callable[[float], None]] = []
        """Called (generation thread) with the seconds each step spent filling and applying masks."""

    # ---- compiling (HTTP worker threads) -----------------------------------------------------------

    def compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        """The compiled grammar of `text` (a cache hit, or compiled now); GrammarError if it is invalid."""
        if kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r} (expected one of {', '.join(KINDS)})")
        if len(text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"{kind} is {len(text)} characters, over the {MAX_GRAMMAR_CHARS} limit")
        key = (kind, text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiler = self._get_compiler()
        t0 = time.monotonic()
        try:
            compiled = self._compile(compiler, kind, text, self.any_whitespace)
        except Exception as e:  # xgrammar raises RuntimeError (and subclasses) with its parser message
            message = clean_message(e)
            log.warning("grammar compile failed (%s, %d chars): %s", kind, len(text), message)
            for cb in self.on_compile_error:
                cb(kind)
            raise GrammarError(f"invalid {kind}: {message}") from None
        seconds = time.monotonic() - t0
        for cb in self.on_compile:
            cb(kind, seconds)
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                t0 = time.monotonic()
                try:
                    info = tokenizer_info(self._tokenizer, self.vocab_size, self._stop_token_ids)
                except Exception as e:
                    raise GrammarError(
                        f"the tokenizer is not supported by xgrammar: {clean_message(e)}"
                    ) from None
                # xgrammar's own cache is off: ours is keyed by (kind, text) and bounded by entries.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                log.info(
                    "grammar backend ready: xgrammar over %d logits (%s vocabulary, stop tokens %s) in %.2f s",
                    self.vocab_size,
                    info.vocab_type.name,
                    self._stop_token_ids,
                    time.monotonic() - t0,
                )
            return self._compiler

    @staticmethod
    def _compile(compiler: xgr.GrammarCompiler, kind: str, text: str, any_whitespace: bool = True):
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "ebnf":
            return compiler.compile_grammar(text)
        if text == ANY_JSON:
            return compiler.compile_builtin_json_grammar()
        return compiler.compile_json_schema(text, any_whitespace=any_whitespace)

    def constraint(self, kind: str, text: str) -> Constraint:
        """A fresh matcher for `text` (compiled or from the cache)."""
        return Constraint(kind, self.compile(kind, text))

    @property
    def cached(self) -> int:
        with self._lock:
            return len(self._cache)

    # ---- masking (generation thread) ---------------------------------------------------------------

    def mask(self, constraints: Sequence[Constraint | None], logits: torch.Tensor) -> list[int]:
        """Set to -inf, in place, the logits [B, V] that each row's grammar forbids next (rows whose
        constraint is None are left alone). Returns the masked row indices. A row whose grammar allows
        no token at all is marked `stuck` and left unmasked (an all -inf row cannot be sampled): the
        token it gets is then refused by its matcher and the runner aborts the request."""
        rows = [i for i, c in enumerate(constraints) if c is not None]
        if not rows:
            return rows
        t0 = time.monotonic()
        if self._bitmask.shape[0] < len(constraints):
            self._bitmask = xgr.allocate_token_bitmask(len(constraints), self.vocab_size)
        bitmask = self._bitmask[: len(constraints)]
        self._batch.batch_fill_next_token_bitmask(
            [constraints[i].matcher for i in rows], bitmask, indices=rows
        )
        alive = bitmask[rows].ne(0).any(dim=1).tolist()
        if not all(alive):
            for i, ok in zip(rows, alive, strict=True):
                if not ok:
                    constraints[i].stuck = True
            rows = [i for i, ok in zip(rows, alive, strict=True) if ok]
            if not rows:
                return rows
        if logits.device.type == "cpu":
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
        else:
            xgr.apply_token_bitmask_inplace(
                logits, bitmask.to(logits.device, non_blocking=True), vocab_size=self.vocab_size, indices=rows
            )
        seconds = time.monotonic() - t0
        for cb in self.on_mask_fill:
            cb(seconds)
        return rows
