"""Prefix cache of the built-in engine: the K/V of finished (and retracted) requests stays in the paged pool,
indexed by its tokens one full block at a time, and a new request whose tokens start the same way takes
those blocks instead of computing them again. In a multi-turn RL episode every turn's prompt is the previous
turn's prompt, its response and a tool's output, so the next turn prefills only the new tokens (SGLang's
radix cache does the same at token granularity; this one shares whole blocks, the last partial block is
computed again).

A tree per adapter: each node is one full block (its `block_size` tokens and the pool block holding their
K/V), children keyed by their tokens. A running request that took a chain of nodes holds a reference on each,
so a node with no reference has none below it either: those are the evictable ones, freed least recently
used first when the pool runs short. K/V is only valid for the weights it was computed with: `flush()`
empties the tree at every weight change, and requests admitted before it do not put their blocks back
(their `epoch` is older); referenced nodes are freed when the last request holding them lets go.

Used by the scheduler thread under the runner's lock only (engine/runner_steps.py).
"""

from __future__ import annotations

import heapq
import itertools

from generator_fleet.engine.kv_cache import PagedKVCache

EVICT_FRACTION = 64
"""An eviction frees at least 1/EVICT_FRACTION of the pool (when the cache holds that much): finding the
least recently used leaves walks the tree, so a full pool pays that walk once per many allocations
instead of once per block."""


class Node:
    __slots__ = ("block", "children", "key", "parent", "refs", "used", "detached")

    def __init__(self, parent: Node | None, key: tuple[int, ...], block: int) -> None:
        self.parent = parent
        self.key = key
        self.block = block
        self.children: dict[tuple[int, ...], Node] = {}
        self.refs = 0
        """Running requests whose block tables hold this node's block."""
        self.used = 0
        """When it was last matched or inserted (the cache's clock): eviction takes the oldest first."""
        self.detached = False
        """Flushed out of the tree while referenced: its block is freed when the last reference goes."""


class PrefixCache:
    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.bs = cache.block_size
        self.roots: dict[str | None, Node] = {}
        self.epoch = 0
        """Bumped by every flush: a request's K/V goes back into the tree only if admitted in this epoch."""
        self.cached_blocks = 0
        """Blocks the tree holds (referenced or not)."""
        self.evictable = 0
        """Blocks of nodes no running request references: free for the taking."""
        self.evicted_blocks_total = 0
        self._clock = itertools.count(1)

    def match(self, adapter: str | None, tokens: list[int], limit: int) -> list[Node]:
        """The longest chain of cached full blocks that `tokens` starts with, at most `limit` tokens long;
        each node gets a reference (give it back with `unref`)."""
        node, chain, bs = self.roots.get(adapter), [], self.bs
        while node is not None and (len(chain) + 1) * bs <= limit:
            start = len(chain) * bs
            node = node.children.get(tuple(tokens[start : start + bs]))
            if node is not None:
                chain.append(node)
        now = next(self._clock)
        for n in chain:
            if n.refs == 0:
                self.evictable -= 1
            n.refs += 1
            n.used = now
        return chain

    def unref(self, chain: list[Node]) -> None:
        """Give back the references `match` took (a request finished, was retracted or not admitted)."""
        for n in chain:
            n.refs -= 1
            if n.refs == 0:
                if n.detached:
                    self.cache.release([n.block])
                else:
                    self.evictable += 1

    def insert(
        self, adapter: str | None, tokens: list[int], blocks: list[int], chain: list[Node]
    ) -> list[int]:
        """A request lets go of its K/V: `tokens` (those with K/V written, in order) in `blocks` (its block
        table), of which the first len(chain) came from `match`. Its further full blocks join the tree (or
        are duplicates of nodes another request put there meanwhile); the chain's references are given
        back. Returns the blocks the tree did not take, for the caller to release."""
        full = len(tokens) // self.bs
        node = chain[-1] if chain else self.roots.setdefault(adapter, Node(None, (), -1))
        now = next(self._clock)
        rest: list[int] = []
        for i in range(len(chain), len(blocks)):
            if i >= full or node.detached:
                rest.append(blocks[i])
                continue
            key = tuple(tokens[i * self.bs : (i + 1) * self.bs])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = Node(node, key, blocks[i])
                self.cached_blocks += 1
                self.evictable += 1
            else:
                rest.append(blocks[i])  # the same tokens' K/V is cached already
            child.used = now
            node = child
        self.unref(chain)
        return rest

    def evict(self, n: int) -> int:
        """Free `n` blocks or more (EVICT_FRACTION), as far as the cache has unreferenced ones, least
        recently used leaves first; returns how many."""
        if n <= 0 or not self.evictable:
            return 0
        n = max(n, self.cache.capacity_blocks // EVICT_FRACTION)
        leaves = [(x.used, id(x), x) for x in self._nodes() if not x.children and x.refs == 0]
        heapq.heapify(leaves)
        freed: list[int] = []
        while leaves and len(freed) < n:
            _, _, x = heapq.heappop(leaves)
            parent = x.parent
            del parent.children[x.key]
            freed.append(x.block)
            if parent.parent is not None and not parent.children and parent.refs == 0:
                heapq.heappush(leaves, (parent.used, id(parent), parent))
        n = len(freed)
        self.cache.release(freed)  # (empties the list)
        self.cached_blocks -= n
        self.evictable -= n
        self.evicted_blocks_total += n
        return n

    def flush(self) -> int:
        """Empty the tree (the weights changed): unreferenced blocks are freed now, referenced ones when
        their requests let go. Returns the blocks freed now."""
        free: list[int] = []
        for x in self._nodes():
            if x.refs == 0:
                free.append(x.block)
            else:
                x.detached = True
        n = len(free)
        self.cache.release(free)
        self.roots.clear()
        self.cached_blocks = self.evictable = 0
        self.epoch += 1
        return n

    def _nodes(self):
        stack = [c for root in self.roots.values() for c in root.children.values()]
        while stack:
            x = stack.pop()
            yield x
            stack.extend(x.children.values())
