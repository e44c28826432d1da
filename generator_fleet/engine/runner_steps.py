"""One step of the built-in engine's generation thread: prefill admitted requests, or decode one token
for every running one (growing their KV blocks, retracting the newest when the pool runs out), record the
tokens and check what finished. A mixin of engine/runner.py's Runner, whose state it uses."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import torch

from generator_fleet.engine.kv_cache import OutOfBlocks, blocks_for
from generator_fleet.engine.model import DecodeInputs
from generator_fleet.engine.request import Request
from generator_fleet.engine.sampler import Choice, sample

log = logging.getLogger(__name__)


PREFILL_BATCH_FRACTION = 8
"""With a nearly full batch, a prefill waits for 1/PREFILL_BATCH_FRACTION of the batch to be free (or the
whole queue to fit, or prefill_wait_steps decode steps)."""


class RunnerSteps:
    """The Runner's admission, prefill and decode steps (engine/runner.py holds the state they use)."""

    def _admit(self) -> list[Request]:
        """Move queued requests into the running set for one prefill step (caller holds _cv): in queue order
        (priority, then FIFO), while the batch has room, the padded prefill fits the token budget and the
        pool has blocks for the prompt plus the first decoded token. Prefill and decode steps alternate
        while both have work, and while the running batch is nearly full a prefill waits (`_prefill_due`)
        so that it takes several requests instead of the one or two that finished last step."""
        if not self._queue or (self._last_was_prefill and self._running):
            self._last_was_prefill = False
            return []
        if self._running and not self._prefill_due():
            return []
        admitted: list[Request] = []
        width = 0
        bs = self.cache.block_size
        while self._queue and len(self._running) < self.max_batch_size:
            r = self._queue[0]
            fill = fill_tokens(r)
            n = len(fill)
            need = blocks_for(n + 1, bs)
            if need > self.cache.capacity_blocks:
                self._queue.popleft()
                self._finish(
                    r,
                    abort_reason(
                        f"request needs {n + 1} KV slots; the engine's pool holds {self.max_total_num_tokens}"
                    ),
                )
                continue
            chain = self._match_prefix(r, fill)
            w = max(width, n - len(chain) * bs)
            if (admitted and w * (len(admitted) + 1) > self.max_prefill_tokens) or (
                need - len(chain) > self.cache.free_blocks + self._evictable()
            ):
                if chain:
                    self.prefix.unref(chain)
                break  # the next step takes it, or it waits for running requests to free blocks
            self._queue.popleft()
            r.blocks = [x.block for x in chain] + self._allocate(need - len(chain))
            r.prefix = chain
            r.prefix_epoch = self.prefix.epoch if self.prefix is not None else -1
            self._running.append(r)
            admitted.append(r)
            width = w
        self._last_was_prefill = bool(admitted)
        if admitted:
            self._decodes_since_prefill = 0
        return admitted

    def _match_prefix(self, r: Request, fill: list[int]) -> list:
        """The prefix cache's blocks that `fill` starts with (referenced), leaving at least its last token
        to compute (its hidden state gives the first sampled token) and every token whose input logprob
        the request asked for."""
        if self.prefix is None:
            return []
        limit = len(fill) - 1
        if not r.output_ids and r.return_logprob and r.logprob_start_len >= 0:
            limit = min(limit, max(r.logprob_start_len - 1, 0))
        return self.prefix.match(r.lora_name, fill, limit)

    def _evictable(self) -> int:
        return self.prefix.evictable if self.prefix is not None else 0

    def _allocate(self, n: int) -> list[int]:
        """`n` free blocks, evicting the prefix cache's least recently used first when the pool is short."""
        if (short := n - self.cache.free_blocks) > 0 and self.prefix is not None:
            self.prefix.evict(short)
        return self.cache.allocate(n)

    def _prefill_due(self) -> bool:
        """Whether queued requests join a running batch now: once the free batch slots take the whole queue
        or an eighth of the batch, or after `prefill_wait_steps` decode steps. A prefill is a whole forward
        pass, so with a full batch under a steady stream of requests (an RL fleet's), admitting each
        finished slot's successor alone would spend every other step on a prefill of one or two rows."""
        free = self.max_batch_size - len(self._running)
        if free <= 0:
            return False
        enough = min(len(self._queue), max(1, self.max_batch_size // PREFILL_BATCH_FRACTION))
        return free >= enough or self._decodes_since_prefill >= self.prefill_wait_steps

    def _prefill(self, rows: list[Request], version: str) -> None:
        t0 = time.monotonic()
        self._prefill_rows(rows, version)
        self.stats.num_prefill_steps_total += 1
        self.stats.prefill_rows_total += len(rows)
        self.stats.prefill_seconds_total += time.monotonic() - t0

    def _prefill_rows(self, rows: list[Request], version: str) -> None:
        fills = [fill_tokens(r) for r in rows]
        bs = self.cache.block_size
        past = [len(r.prefix) * bs for r in rows]  # tokens whose K/V came from the prefix cache
        # A GRPO group's samples share their prompt: a fresh prompt seen earlier in this step (same tokens,
        # same adapter, same cached prefix) is computed once; its copies take its K/V (one pool-to-pool
        # copy per layer) and its hidden states. A retracted request (output so far in its fill) is its own.
        first: dict[tuple, int] = {}
        src = [
            first.setdefault((r.lora_name, p, *f) if not r.output_ids else (id(r),), i)
            for i, (r, p, f) in enumerate(zip(rows, past, fills, strict=True))
        ]
        computed = [i for i, j in enumerate(src) if i == j]
        row_slots = [self.cache.slots(r.blocks, p, len(f)) for r, p, f in zip(rows, past, fills, strict=True)]
        slots = [s for i in computed for s in row_slots[i]]
        hidden = self.fwd.prefill(
            [fills[i][past[i] :] for i in computed],
            torch.tensor(slots, dtype=torch.long, device=self.device),
            self._lora_slots([rows[i] for i in computed]),
            [self.cache.slots(rows[i].blocks, 0, past[i]) for i in computed] if any(past) else None,
        )
        end_of = dict(
            zip(computed, itertools.accumulate(len(fills[i]) - past[i] for i in computed), strict=True)
        )
        ends = [end_of[j] for j in src]  # where each row's tokens end in `hidden` (a copy: its source's)
        if copies := [i for i, j in enumerate(src) if i != j]:
            dev = self.device
            self.cache.copy_slots(
                torch.tensor([s for i in copies for s in row_slots[src[i]]], dtype=torch.long, device=dev),
                torch.tensor([s for i in copies for s in row_slots[i]], dtype=torch.long, device=dev),
            )
            self.stats.prefill_shared_tokens_total += sum(len(fills[i]) - past[i] for i in copies)
        self.stats.prefix_cached_tokens_total += sum(past)
        for r, f, p in zip(rows, fills, past, strict=True):
            r.kv_len = len(f)
            if not r.output_ids:  # its first prefill (a retracted request's next one computes its output too)
                r.cached_tokens = p
        self.stats.prompt_tokens_total += sum(len(f) for f in fills)
        fresh = [i for i, r in enumerate(rows) if not r.output_ids]
        if any(rows[i].return_logprob and rows[i].logprob_start_len >= 0 for i in fresh):
            self._input_logprobs(rows, fills, past, hidden, ends)
        for i in fresh:
            if rows[i].params.max_new_tokens == 0:  # prefill only
                self._finish(rows[i], {"type": "length", "length": 0})
        to_sample = [i for i in fresh if not rows[i].done]
        if to_sample:
            last = torch.tensor([ends[i] - 1 for i in to_sample], device=self.device)
            logits = self.fwd.logits(hidden[last]).float()
            picked = [rows[i] for i in to_sample]
            self.grammar.mask([r.constraint for r in picked], logits)
            self._record(picked, sample(picked, logits, self.eos_token_ids), version)

    def _input_logprobs(
        self,
        rows: list[Request],
        fills: list[list[int]],
        past: list[int],
        hidden: torch.Tensor,
        ends: list[int],
    ) -> None:
        """Prompt logprobs from logprob_start_len (the prefix cache computed none of them: _match_prefix)."""
        for r, f, p, end in zip(rows, fills, past, ends, strict=True):
            if r.output_ids or not (r.return_logprob and r.logprob_start_len >= 0):
                continue
            n = len(f)
            lp = torch.log_softmax(self.fwd.logits(hidden[end - (n - p) : end - 1]).float(), dim=-1)
            nxt = torch.tensor(f[p + 1 :], dtype=torch.long, device=self.device)
            got = lp.gather(1, nxt[:, None]).squeeze(1).tolist()
            full: list[float | None] = [None] * (p + 1) + got
            r.input_logprobs = full[min(r.logprob_start_len, n) :]

    def _decode(self, version: str) -> None:
        t0 = time.monotonic()
        rows = self._grow_blocks()
        if not rows:
            return
        ids = [r.output_ids[-1] for r in rows]
        positions = [r.kv_len for r in rows]
        slots = [self.cache.slot(r.blocks, r.kv_len) for r in rows]
        choice = None
        ran = None
        if self.graphs is not None:
            in_graph = all(_graph_sampleable(r, self.vocab_size) for r in rows)
            temps = [0.0 if r.params.greedy else r.params.temperature for r in rows] if in_graph else None
            ran = self.graphs.run(ids, positions, slots, [r.blocks for r in rows], temps)
            if ran is None:
                self.stats.graph_captures_deferred_total += 1
        if ran is not None:
            logits, picked = ran
            if picked is not None:
                choice = Choice(picked[0], picked[1], [None] * len(rows))
        else:  # no graphs, or this bucket's capture has to wait for a weight operation
            width = max(len(r.blocks) for r in rows)
            scratch = self.cache.scratch_block
            dev = self.device
            x = DecodeInputs(
                input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
                positions=torch.tensor(positions, dtype=torch.long, device=dev),
                slots=torch.tensor(slots, dtype=torch.long, device=dev),
                block_tables=torch.tensor(
                    [r.blocks + [scratch] * (width - len(r.blocks)) for r in rows],
                    dtype=torch.long,
                    device=dev,
                ),
                seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.long, device=dev),
            )
            logits = self.fwd.decode(x, self._lora_slots(rows))
        for r in rows:
            r.kv_len += 1
        self.stats.num_decode_steps_total += 1
        self.stats.decode_rows_total += len(rows)
        self._decodes_since_prefill += 1
        constrained = self.grammar.mask([r.constraint for r in rows], logits)
        if constrained and choice is not None:
            # The graph sampled every row from the raw logits: rows with a grammar are sampled again
            # from their masked logits, the others keep the graph's choice.
            sub = sample([rows[i] for i in constrained], logits[constrained], self.eos_token_ids)
            for j, i in enumerate(constrained):
                choice.tokens[i] = sub.tokens[j]
                choice.logprobs[i] = sub.logprobs[j]
        self._record(rows, choice or sample(rows, logits, self.eos_token_ids), version)
        took = time.monotonic() - t0
        self.stats.decode_seconds_total += took
        self.stats.gen_throughput = len(rows) / max(took, 1e-9)

    def _grow_blocks(self) -> list[Request]:
        """Give every running request room for one more token, retracting the newest ones while the
        pool is short. Returns the requests that decode this step."""
        bs = self.cache.block_size
        with self._cv:
            retracted: set[int] = set()
            for r in list(self._running):
                if id(r) in retracted:
                    continue  # retracted below to make room for an older request
                while len(r.blocks) < blocks_for(r.kv_len + 1, bs):
                    try:
                        r.blocks.extend(self._allocate(1))
                    except OutOfBlocks:
                        victim = self._running[-1]
                        self._retract(victim)
                        retracted.add(id(victim))
                        if victim is r:
                            break
            return list(self._running)

    def _retract(self, r: Request) -> None:
        """Free `r`'s KV and put it back at the head of the queue (caller holds _cv, no step in flight)."""
        self._drop(r)
        self._queue.appendleft(r)
        r.num_retractions += 1
        self.stats.num_retractions_total += 1
        log.info("retracted %s (%d tokens so far) to free KV blocks", r.rid, len(r.output_ids))

    def _drop(self, r: Request) -> None:
        if r in self._running:
            self._running.remove(r)
        px = self.prefix
        if px is None:
            self.cache.release(r.blocks)
        else:  # its K/V goes into the prefix cache, unless the weights changed since it was admitted
            if r.prefix_epoch == px.epoch and r.kv_len:
                rest = px.insert(r.lora_name, (r.prompt_ids + r.output_ids)[: r.kv_len], r.blocks, r.prefix)
            else:
                px.unref(r.prefix)
                rest = r.blocks[len(r.prefix) :]
            self.cache.release(rest)
            r.blocks, r.prefix = [], []
        r.kv_len = 0

    def _record(self, rows: list[Request], choice: Choice, version: str) -> None:
        """Record each row's chosen token with its logprob and version, finish rows that are done."""
        now = time.monotonic()
        for i, r in enumerate(rows):
            if r.first_token_at is None:
                r.first_token_at = now
            r.output_logprobs.append(choice.logprobs[i])
            r.versions.append(version)
            if r.top_logprobs_num > 0:
                r.output_top_logprobs.append(choice.top[i] or [])
            r.output_ids.append(choice.tokens[i])  # last: a concurrent progress() reads len(output_ids) first
            self.stats.generation_tokens_total += 1
            if r.constraint is not None and not r.constraint.accept(choice.tokens[i]):
                # The mask lets only allowed tokens through: this is a grammar that no token of the
                # vocabulary can continue (`stuck`), or a safety net.
                kind = r.constraint.kind
                why = (
                    f"no token of the model's vocabulary can continue the {kind}"
                    if r.constraint.stuck
                    else f"token {choice.tokens[i]} is not allowed by the {kind}"
                )
                log.warning("%s: aborted after %d tokens: %s", r.rid, len(r.output_ids) - 1, why)
                r.output_ids.pop()  # the refused token is not part of the output
                r.output_logprobs.pop()
                r.versions.pop()
                if r.top_logprobs_num > 0:
                    r.output_top_logprobs.pop()
                self.stats.generation_tokens_total -= 1
                self._finish(r, abort_reason(why))
                continue
            reason = self._check_finished(r)
            if reason is not None:
                self._finish(r, reason)
            elif r.listener:
                r.listener()

    def _check_finished(self, r: Request) -> dict[str, Any] | None:
        """SGLang's order: length first, then EOS/stop tokens (skipped with ignore_eos), then stop strings."""
        p = r.params
        if len(r.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        last = r.output_ids[-1]
        if not p.ignore_eos and (last in self.eos_token_ids or last in p.stop_token_ids):
            return {"type": "stop", "matched": last}
        if p.stop:
            tail = self.tokenizer.decode(r.output_ids[-(r.stop_max_len + 1) :])
            for s in p.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        if r.stop_regex:
            # SGLang: search the tail that can hold a match; `matched` is the pattern and the text keeps it.
            tail = self.tokenizer.decode(r.output_ids[-(r.stop_regex_max_len + 1) :])
            for pattern, compiled in r.stop_regex:
                if compiled.search(tail):
                    return {"type": "stop", "matched": pattern}
        if r.constraint is not None and r.constraint.terminated:
            return {"type": "stop", "matched": last}  # SGLang: the grammar's stop token ended it
        return None


def _graph_sampleable(r: Request, vocab_size: int) -> bool:
    """Greedy or plain temperature sampling: what the decode graph samples itself."""
    p = r.params
    return (
        p.plain
        and r.generator is None
        and r.top_logprobs_num == 0
        and len(r.output_ids) >= p.min_new_tokens
        and (p.top_k == -1 or p.top_k >= vocab_size)
        and p.top_p >= 1.0
        and p.min_p <= 0.0
    )


def fill_tokens(r: Request) -> list[int]:
    """Tokens a prefill computes K/V for: the prompt of a new request; for a retracted one, the prompt and
    all its output but the last token (which the next decode step feeds)."""
    return r.prompt_ids + r.output_ids[:-1] if r.output_ids else r.prompt_ids


def abort_reason(message: str) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}
