"""Automatic prefix caching: prompt KV computed once is kept on the device and copied into the slot of
any later request whose prompt starts with the same blocks (vLLM's automatic prefix caching, adapted
to gemmax's slot cache, which keeps one contiguous row per request instead of pages).

Blocks and keys. A prompt is cut into blocks of `block` tokens (the smallest prefill bucket: with
buckets that are multiples of it, as every default set is, every chunk but a prompt's last is whole
blocks, so every chunk starts on a block boundary). Block i is keyed by sha256(key of block i - 1,
its tokens), the chain starting from the request's `cache_salt`: a key names the whole prefix up to
and including its block, and two tenants with different salts never share one. Only full blocks are
cached. sha256 rather than Python's `hash`: a collision would hand one prompt another's KV, and a
tenant could search for one.

The store (`pool`) is a `KVCache` of `capacity` entries allocated once on the device, one entry per
block: full layers keep the block's `block` positions; sliding layers keep its last min(block, ring)
positions, the only ones a later window can need. Entries are evicted least recently used under the
byte budget. Device-side, not host-side: a hit is then one on-device gather / scatter at memory
bandwidth with nothing crossing PCIe, and storing a block never waits for the host; on CPU the two
are the same memory anyway.

What a hit of m blocks (n = m * block tokens) needs, and where it goes in the slot's row:
- full layers: positions 0 .. n-1, at slot p;
- sliding layers: only the last window, positions max(0, n - S) .. n-1, at slot p % S (S = ring
  slots); older positions a window can no longer see are neither needed nor written;
- KV-sharing layers have no cache of their own (they read their donor's): nothing to store.
A sliding layer's part of a block can only be saved while the ring still holds it: it is taken right
after the prefill chunk that completes the block, when the ring holds the last S positions written
(`store`). Prefill with the cache on therefore uses chunks no longer than the ring where a bucket
allows (`plan_cached_chunks`), so every block, the last full one included, can keep its sliding
part. A lookup takes the longest chain of cached blocks whose needed sliding parts are all present,
and always leaves at least one prompt token to prefill (its logits give the first generated token).

Compiled shapes: the copies have one shape per block-count bucket (powers of 4: a store of up to
the blocks a prompt can complete, a load of up to max_len / block), declared like the engine's
steps and compiled ahead of time at warm-up (`declared_calls`), through the same executable store,
so the first request that stores or hits blocks of a new count compiles nothing (it used to pay
0.5-2.6 s on the built-in model: measured with `benchmarks/startup.py`). A request that compiled one
anyway reports `uncompiled_shape`. The prefill chunks after a hit use only the warmed prefill
shapes (tested).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gemmax.engine.executables import CompiledSteps
from gemmax.engine.shapes import plan_chunks
from gemmax.model.config import ModelConfig
from gemmax.model.kv_cache import KVCache, cache_slots, init_cache
from gemmax.model.params import count_bytes


def block_keys(tokens, block: int, salt: str | None = None) -> list[bytes]:
    """The key of each full block of `tokens`: sha256 over the previous key and the block's ids, the
    chain rooted at the salt (None and "" are distinct tenants from every named salt)."""
    parent = hashlib.sha256(b"gemmax-prefix\0" + (b"" if salt is None else b"salt\0" + salt.encode())).digest()
    ids = np.asarray(tokens, np.int32)
    keys = []
    for i in range(len(ids) // block):
        parent = hashlib.sha256(parent + ids[i * block : (i + 1) * block].tobytes()).digest()
        keys.append(parent)
    return keys


def plan_cached_chunks(start: int, prompt_len: int, block: int, buckets: tuple[int, ...],
                       ring: int | None) -> list[tuple[int, int]]:
    """[(real tokens, bucket)] prefilling positions start .. prompt_len - 1 (`start` a block boundary),
    each chunk starting on a block boundary with the ring still holding what it must save (module
    docstring). When the smallest sliding ring `ring` holds a block, `plan_chunks` over the buckets
    no longer than it: a chunk of at most `ring` tokens that starts on a block boundary leaves the ring
    holding the kept positions of every block it completes, so the tail may share the last chunk (a
    41-token prompt is one chunk of 64, not 32 + 9 in two). Else chunks of one block end on block
    boundaries, and the tail after the last one is a chunk of its own. (`block` is the smallest
    bucket; with buckets that are multiples of it, every chunk but the last is whole blocks.)"""
    within = tuple(b for b in buckets if ring is None or b <= ring)
    if within:
        return plan_chunks(prompt_len - start, within)
    aligned = prompt_len // block * block
    tail = [(prompt_len - aligned, block)] if prompt_len > aligned else []
    return [(block, block)] * ((aligned - start) // block) + tail


def _bucket(n: int) -> int:
    """The block-count bucket of a copy of n blocks: the next power of 4 (few compiled shapes; a copy
    of padded blocks costs milliseconds against a prefill's hundreds)."""
    size = 1
    while size < n:
        size *= 4
    return size


def _sizes_up_to(n: int) -> tuple[int, ...]:
    """The block-count buckets 1, 4, 16 ... up to `_bucket(n)`."""
    sizes = [1]
    while sizes[-1] < n:
        sizes.append(sizes[-1] * 4)
    return tuple(sizes)


COPY_STEPS = ("store_blocks", "load_blocks")


def _padded(values: list[int], size: int, fill: int) -> jax.Array:
    return jnp.asarray(values + [fill] * (size - len(values)), jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "block"), donate_argnames=("pool",))
def store_blocks(pool: KVCache, cache: KVCache, slot, blocks, entries, sliding_entries, *, config: ModelConfig, block: int):
    """Copy blocks `blocks` [k] (block numbers in the prompt) of row `slot` of `cache` into pool entries
    `entries` [k] (full layers) and `sliding_entries` [k] (sliding layers); an entry out of range
    (capacity) skips that part."""
    layers = []
    for spec, kept, row in zip(config.layers, pool.layers, cache.layers, strict=True):
        if kept is None:
            layers.append(None)
            continue
        width = kept.slots  # positions of a block this layer keeps: its last `width`
        positions = blocks[:, None] * block + (block - width) + jnp.arange(width)[None, :]  # [k, width]
        at = positions % row.slots  # full layers: positions < max_len = slots
        target = sliding_entries if spec.sliding_window else entries
        layers.append(jax.tree.map(lambda p, c: p.at[target].set(c[slot, at], mode="drop"), kept, row))  # noqa: B023
    return KVCache(tuple(layers))


@functools.partial(jax.jit, static_argnames=("config", "block"), donate_argnames=("cache",))
def load_blocks(cache: KVCache, pool: KVCache, slot, entries, sliding_entries, count, *, config: ModelConfig, block: int):
    """Write pool entries `entries` [k] (blocks 0 .. k-1 of a prompt; those from `count` on are
    padding) into row `slot` of `cache` as the prompt's first count * block positions: on full layers
    at slot p, as one contiguous update of slots 0 .. k * block - 1 (k * block <= max_len; the padding
    blocks land past the cached length, where stale slots always are: never read, and overwritten
    by the prefill or decode of those positions before they are); on sliding layers only the last
    ring's worth, scattered to p % S. The contiguous update measured 7 ms against 23 ms for a
    scatter of a 1,504-token hit of the built-in model on CPU."""
    tokens = count * block
    k = entries.shape[0]
    layers = []
    for spec, kept, row in zip(config.layers, pool.layers, cache.layers, strict=True):
        if kept is None:
            layers.append(None)
        elif not spec.sliding_window:
            layers.append(jax.tree.map(
                lambda c, p: lax.dynamic_update_slice(c, p[entries].reshape(1, k * block, *p.shape[2:]),
                                                      (slot,) + (0,) * (c.ndim - 1)), row, kept))
        else:
            width = kept.slots  # the block's last `width` positions
            positions = jnp.arange(k)[:, None] * block + (block - width) + jnp.arange(width)[None, :]  # [k, width]
            wanted = (positions < tokens) & (positions >= tokens - row.slots)
            at = jnp.where(wanted, positions % row.slots, row.slots)  # out of range: dropped
            layers.append(jax.tree.map(lambda c, p: c.at[slot, at].set(p[sliding_entries], mode="drop"),  # noqa: B023
                                       row, kept))
    return KVCache(tuple(layers))


@dataclasses.dataclass
class _Entry:
    index: int  # pool entry
    sliding: bool  # holds the sliding layers' part of the block too


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """The cached prefix of one prompt: its first `blocks` blocks, from these pool entries."""

    blocks: int
    tokens: int
    entries: tuple[int, ...]
    sliding_entries: tuple[int, ...]  # per block; 0 where the block's sliding part is not needed


class PrefixCache:
    """The block index (host) and the pool (device) of one engine. Only the engine thread changes it;
    `stats` and `used_bytes` may be read from any thread (plain int reads)."""

    def __init__(self, config: ModelConfig, max_len: int, block: int, budget_bytes: int, kv_dtype):
        self.config, self.max_len, self.block, self.budget_bytes = config, max_len, block, budget_bytes
        self.steps = CompiledSteps(sys.modules[__name__], COPY_STEPS)  # the engine sets its executable store
        self.block_bytes = count_bytes(jax.eval_shape(lambda: init_cache(config, 1, block, kv_dtype)))
        self.capacity = budget_bytes // self.block_bytes if self.block_bytes else 0
        # Sliding rings, slots per row (a window at least max_len long never wraps; it is a ring all the same).
        self.rings = tuple(cache_slots(spec, max_len) for spec in config.layers if spec.owns_kv and spec.sliding_window)
        self.kv_dtype = kv_dtype
        self.reset()
        self.clear()

    def reset(self) -> None:
        """A new pool, every block forgotten (at start, and after a failed device call that may have
        consumed the pool); the compiled copy steps stay, and so do the counters, which /metrics
        exports as Prometheus counters once warm-up succeeded (`BatchEngine.stats`; warm-up's
        `clear` zeroes its throwaway requests' counts before that): they never go down."""
        self.pool = None
        self.pool = init_cache(self.config, self.capacity, self.block, self.kv_dtype)
        self._forget()

    def clear(self) -> None:
        """Forget every block and zero the counters (the pool's stale values are never read): at
        start, and after warm-up, whose throwaway requests are not a real prompt's."""
        self._forget()
        self.hits = self.misses = self.cached_tokens = self.queried_tokens = self.evicted_bytes = 0

    def _forget(self) -> None:
        self._entries: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()  # oldest first
        self._free = list(range(self.capacity))
        self._held: set[bytes] = set()  # `hold`

    def hold(self, keys: list[bytes]) -> None:
        """Keep these blocks from eviction until `release`: the hits an admission found at its lookups,
        which its prefills copy only after the prompts that arrived earlier have stored theirs (a
        store could otherwise reuse their pool entries, and the hit would copy another prompt's KV)."""
        self._held.update(keys)

    def release(self) -> None:
        self._held.clear()

    @property
    def store_sizes(self) -> tuple[int, ...]:
        """Block counts of the store shapes: a store saves at most the full blocks of a prompt."""
        return _sizes_up_to((self.max_len - 1) // self.block)

    @property
    def load_sizes(self) -> tuple[int, ...]:
        """Block counts of the load shapes: `_load_size` of every hit (at most (max_len - 2) // block
        blocks: a hit leaves a prompt token to prefill)."""
        return tuple(sorted({self._load_size(n) for n in _sizes_up_to((self.max_len - 2) // self.block)}))

    def _load_size(self, blocks: int) -> int:
        """The padded block count of a hit of `blocks` blocks: its bucket, capped so that the padded
        blocks fit the full layers' rows."""
        return min(_bucket(blocks), self.max_len // self.block)

    def _store_args(self, cache: KVCache, slot: int, size: int, blocks=(), entries=(), sliding=()) -> tuple:
        """`store_blocks`' arguments, its index arrays padded to `size` (entries out of range: skipped)."""
        return (self.pool, cache, jnp.int32(slot), _padded(list(blocks), size, 0),
                _padded(list(entries), size, self.capacity), _padded(list(sliding), size, self.capacity))

    def _load_args(self, cache: KVCache, slot: int, size: int, entries=(), sliding_entries=(), count: int = 0) -> tuple:
        """`load_blocks`' arguments, its entry arrays padded to `size` (padding: entry 0, past `count`)."""
        return (cache, self.pool, jnp.int32(slot), _padded(list(entries), size, 0),
                _padded(list(sliding_entries), size, 0), jnp.int32(count))

    @property
    def _statics(self) -> dict:
        return {"config": self.config, "block": self.block}

    def declared_calls(self, cache: KVCache) -> list[tuple[str, tuple, dict]]:
        """(step, args, statics) of every copy shape, from the argument builders `store` and `load`
        use, for `CompiledSteps.compile_all` at warm-up (nothing runs)."""
        return ([("store_blocks", self._store_args(cache, 0, n), self._statics) for n in self.store_sizes]
                + [("load_blocks", self._load_args(cache, 0, n), self._statics) for n in self.load_sizes])

    @property
    def ring(self) -> int | None:
        """The smallest sliding ring (None: no sliding layer owns a cache)."""
        return min(self.rings, default=None)

    @property
    def used_bytes(self) -> int:
        return len(self._entries) * self.block_bytes

    def describe(self) -> dict[str, int]:
        return {"block_tokens": self.block, "budget_bytes": self.budget_bytes, "block_bytes": self.block_bytes,
                "capacity_blocks": self.capacity}

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "cached_tokens": self.cached_tokens,
                "queried_tokens": self.queried_tokens, "evicted_bytes": self.evicted_bytes,
                "used_bytes": self.used_bytes, "budget_bytes": self.budget_bytes, "blocks": len(self._entries)}

    def keys(self, tokens, salt: str | None) -> list[bytes]:
        return block_keys(tokens, self.block, salt)

    def plan(self, start: int, prompt_len: int, buckets: tuple[int, ...]) -> list[tuple[int, int]]:
        return plan_cached_chunks(start, prompt_len, self.block, buckets, self.ring)

    # -------------------------------------------------------------------------------------- lookup
    def _needs_sliding(self, blocks: int) -> range:
        """The blocks whose sliding part a hit of `blocks` blocks needs (the last ring's worth)."""
        if not self.rings:
            return range(0)
        return range(max(0, blocks * self.block - max(self.rings)) // self.block, blocks)

    def lookup(self, keys: list[bytes], prompt_len: int) -> PrefixHit:
        """The longest usable cached prefix (leaving at least one token to prefill); counted by `record`
        once its prompt's prefill starts, not here (a prompt put back in the queue is looked up again)."""
        limit = min(len(keys), (prompt_len - 1) // self.block)
        chain = 0
        while chain < limit and keys[chain] in self._entries:
            chain += 1
        blocks = next((m for m in range(chain, 0, -1)
                       if all(self._entries[keys[i]].sliding for i in self._needs_sliding(m))), 0)
        for key in reversed(keys[:blocks]):  # the chain's first block ends most recently used
            self._entries.move_to_end(key)
        needed = set(self._needs_sliding(blocks))
        return PrefixHit(blocks=blocks, tokens=blocks * self.block,
                         entries=tuple(self._entries[k].index for k in keys[:blocks]),
                         sliding_entries=tuple(self._entries[k].index if i in needed else 0
                                               for i, k in enumerate(keys[:blocks])))

    def record(self, hit: PrefixHit, prompt_len: int) -> None:
        """Count the lookup of a prompt whose prefill starts now with `hit`, its blocks copied (the
        counters /metrics exports: a hit or a miss, the prompt's tokens, the tokens its hit copied)."""
        self.queried_tokens += prompt_len
        self.hits += hit.blocks > 0
        self.misses += hit.blocks == 0
        self.cached_tokens += hit.tokens

    def load(self, cache: KVCache, slot: int, hit: PrefixHit) -> tuple[KVCache, bool]:
        """`cache` with the hit's blocks in row `slot`; and whether that compiled a new copy shape."""
        return self.steps.load_blocks.run(*self._load_args(cache, slot, self._load_size(hit.blocks), hit.entries,
                                                           hit.sliding_entries, hit.blocks), **self._statics)

    # -------------------------------------------------------------------------------------- store
    def _saves_sliding(self, index: int, written: int) -> bool:
        """Whether every ring still holds block `index`'s kept positions once `written` are prefilled."""
        end = (index + 1) * self.block
        return all(end - min(self.block, ring) >= written - ring for ring in self.rings)

    def _allocate(self, pinned: set[bytes]) -> int | None:
        if self._free:
            return self._free.pop()
        victim = next((key for key in self._entries if key not in pinned and key not in self._held), None)
        if victim is None:
            return None
        self.evicted_bytes += self.block_bytes
        return self._entries.pop(victim).index

    def store(self, cache: KVCache, slot: int, keys: list[bytes], written: int) -> bool:
        """Save the blocks of row `slot` complete after `written` prefilled tokens that are not cached
        yet (or lack the sliding part the ring still holds); returns whether a copy shape compiled."""
        blocks, entries, sliding = [], [], []
        pinned = set(keys)  # never evict this prompt's own blocks to make room for its later ones
        for index, key in enumerate(keys[: written // self.block]):
            saves = self._saves_sliding(index, written)
            entry = self._entries.get(key)
            if entry is None:
                place = self._allocate(pinned)
                if place is None:
                    break
                entry = self._entries[key] = _Entry(place, saves)
                blocks.append(index)
                entries.append(place)
                sliding.append(place if saves else self.capacity)
            elif saves and not entry.sliding:
                entry.sliding = True
                blocks.append(index)
                entries.append(self.capacity)
                sliding.append(entry.index)
        for key in reversed(keys[: written // self.block]):
            if key in self._entries:
                self._entries.move_to_end(key)
        if not blocks:
            return False
        self.pool, compiled = self.steps.store_blocks.run(*self._store_args(cache, slot, _bucket(len(blocks)), blocks,
                                                                            entries, sliding), **self._statics)
        return compiled
