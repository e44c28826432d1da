"""The prefix cache's bookkeeping on a real (CPU) paged pool: chains of full blocks found by their tokens,
references that keep blocks from eviction, least recently used eviction, and a flush that frees what no
request holds now and the rest when it is let go. After every operation the pool's blocks are either free,
held by a request, or in the tree: none lost, none twice."""

from __future__ import annotations

import torch

from generator_fleet.engine.kv_cache import PagedKVCache
from generator_fleet.engine.prefix_cache import PrefixCache

BS = 4


def pool(blocks: int = 12) -> tuple[PagedKVCache, PrefixCache]:
    cache = PagedKVCache(
        num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=blocks + 1, block_size=BS,
        dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    return cache, PrefixCache(cache)


def finish(cache: PagedKVCache, px: PrefixCache, tokens: list[int], kv_len: int, chain=()) -> list[int]:
    """A request that held `chain` and blocks for `tokens` lets go with `kv_len` tokens' K/V written."""
    blocks = [x.block for x in chain] + cache.allocate(-(-len(tokens) // BS) - len(chain))
    cache.release(px.insert(None, tokens[:kv_len], blocks, list(chain)))
    return blocks


def accounted(cache: PagedKVCache, px: PrefixCache, held: int = 0) -> None:
    assert cache.free_blocks + px.cached_blocks + held == cache.capacity_blocks
    assert px.evictable == sum(1 for x in px._nodes() if x.refs == 0)


def test_full_blocks_are_found_by_their_tokens_and_the_partial_one_is_not_kept():
    cache, px = pool()
    seq = list(range(10, 21))  # 11 tokens: 2 full blocks and 3 tokens
    finish(cache, px, seq, kv_len=11)
    assert px.cached_blocks == 2
    accounted(cache, px)
    chain = px.match(None, seq + [99], limit=len(seq))
    assert [len(x.key) for x in chain] == [BS, BS]
    assert px.match(None, seq[:5] + [0] * 6, limit=11) != []  # the first block matches, the second not
    assert len(px.match(None, seq, limit=7)) == 1  # a limit below two blocks takes one
    assert px.match("adapter", seq, limit=11) == []  # another adapter's tree
    px.unref(chain)


def test_referenced_blocks_are_never_evicted_and_eviction_takes_the_least_recently_used():
    cache, px = pool(blocks=6)
    a, b = list(range(1, 9)), list(range(50, 58))
    finish(cache, px, a, kv_len=8)
    finish(cache, px, b, kv_len=8)
    assert cache.free_blocks == 2 and px.evictable == 4
    held = px.match(None, a + [0], limit=8)  # a is used again (and held)
    assert px.evict(10) == 2  # only b's blocks can go
    assert px.match(None, b + [0], limit=8) == []
    assert px.match(None, a + [0], limit=8) == held
    px.unref(held)
    px.unref(held)
    accounted(cache, px)
    finish(cache, px, b, kv_len=8)
    px.unref(px.match(None, b + [0], limit=8))  # b used after a
    assert px.evict(1) == 1 and len(px.match(None, a + [0], limit=8)) == 1  # a's leaf went first


def test_a_flush_frees_what_no_request_holds_now_and_the_rest_when_let_go():
    cache, px = pool()
    a = list(range(1, 13))
    finish(cache, px, a, kv_len=12)
    chain = px.match(None, a + [0], limit=12)  # a running request holds all three
    other = finish(cache, px, list(range(30, 38)), kv_len=8)
    assert other and px.cached_blocks == 5
    assert px.flush() == 2 and px.epoch == 1
    assert px.match(None, a + [0], limit=12) == []
    assert cache.free_blocks == cache.capacity_blocks - 3
    px.unref(chain)
    assert cache.free_blocks == cache.capacity_blocks
    accounted(cache, px)


def test_a_request_that_extends_a_chain_adds_its_new_blocks_under_it_and_duplicates_go_back():
    cache, px = pool()
    turn1 = list(range(1, 10))  # 2 full blocks
    finish(cache, px, turn1, kv_len=9)
    turn2 = turn1 + list(range(40, 47))  # the next turn: 16 tokens
    chain = px.match(None, turn2, limit=len(turn2) - 1)
    assert len(chain) == 2
    finish(cache, px, turn2, kv_len=16, chain=chain)
    assert px.cached_blocks == 4
    accounted(cache, px)
    finish(cache, px, turn2, kv_len=16)  # the same tokens computed again elsewhere: nothing new is kept
    assert px.cached_blocks == 4
    accounted(cache, px)
