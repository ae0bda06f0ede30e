"""Gemma 4 / Gemma 3 text decoder as pure functions over a params pytree and a frozen config.

One entry point, `forward`, serves both prefill and decode: it appends `T` new tokens per row to a
KV cache that already holds `start[b]` tokens of row b, attending over (cache ∪ new tokens).

The KV cache (`gemmax.model.kv_cache`) holds absolute real positions only; attention masks are
computed from absolute positions (key position <= query position, and > query position - window on
sliding layers), never from slot order. All shapes are static under `jit`; `config`, `precision` and `logits` are static arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from gemmax.model.config import LayerSpec, ModelConfig
from gemmax.model.kv_cache import KVCache, LayerCache, slot_positions
from gemmax.model.linear import linear, lookup
from gemmax.model.moe import moe_block
from gemmax.model.ops import gelu_tanh, opaque, rms_norm
from gemmax.model.params import Params

_MASKED = float(np.finfo(np.float32).min)  # finite: a row with no visible key stays NaN-free


@dataclasses.dataclass(frozen=True)
class Precision:
    """Dtypes actually used in the forward pass (weights carry their own dtype)."""

    activation: Any = jnp.float32
    kv_cache: Any = jnp.float32


# --------------------------------------------------------------------------------------------- pieces


def rope_inv_freq(config: ModelConfig, spec: LayerSpec) -> np.ndarray:
    """Inverse frequencies [hd/2] (float32) for a layer's RoPE type and head dim."""
    rope = config.rope_for(spec.attention_type)
    d = spec.head_dim
    if rope.rope_type == "proportional":
        n_rot = int(rope.partial_rotary_factor * d // 2)
        rotated = 1.0 / (rope.theta ** (np.arange(0, 2 * n_rot, 2, dtype=np.float32) / d))
        inv = np.concatenate([rotated, np.zeros(d // 2 - n_rot, np.float32)])
    else:  # default, linear
        inv = 1.0 / (rope.theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    return (inv / rope.factor).astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, 1, d] in fp32 for positions [B, T] (half-split layout: each frequency twice)."""
    freqs = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [B, T, d/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    return jnp.cos(emb), jnp.sin(emb)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Half-split (NeoX) rotation of x [B, T, n, d] by `rope_tables`, applied in x.dtype."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """x [B, T, n, d] rotated for positions [B, T]."""
    return rotate(x, *rope_tables(positions, inv_freq))


def _visible(q_pos: jax.Array, k_pos: jax.Array, k_valid: jax.Array, window: int | None) -> jax.Array:
    """[B, Tq, Tk] mask: causal by absolute position, inside the window on sliding layers."""
    q, k = q_pos[:, :, None], k_pos[:, None, :]
    mask = k_valid[:, None, :] & (k <= q)
    if window is not None:
        mask &= k > q - window
    return mask


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """q [B, T, nh, hd], k/v [B, S, nkv, hd], mask [B, T, S] -> [B, T, nh, hd]; softmax in fp32."""
    B, T, nh, hd = q.shape
    nkv = k.shape[2]
    q = q.reshape(B, T, nkv, nh // nkv, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    # p.v as one batched matmul over (b, k) with the groups' queries as rows: XLA:CPU lowers the
    # einsum's five-index form to a transpose of v per step (13% of a batch-8 decode at 600 cached
    # tokens); this form reads v where it lies
    out = jax.lax.dot_general(probs.reshape(B, nkv, -1, probs.shape[-1]), v, (((3,), (1,)), ((0, 1), (0, 2))))
    return out.reshape(B, nkv, nh // nkv, T, hd).transpose(0, 3, 1, 2, 4).reshape(B, T, nh, hd)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Keys:
    """Keys and values a query may attend, with each one's absolute position."""

    k: jax.Array  # [B, S, nkv, hd]
    v: jax.Array  # [B, S, nkv, hd]
    key_pos: jax.Array  # [B, S]
    key_valid: jax.Array  # [B, S] holds a real position

    def slice(self, lo: int, hi: int) -> Keys:
        return Keys(self.k[:, lo:hi], self.v[:, lo:hi], self.key_pos[:, lo:hi], self.key_valid[:, lo:hi])


QUERY_BLOCK = 128  # chunk queries per block of `attend_chunk` (each reads only the chunk keys it can see)


def _join(a: Keys | None, b: Keys) -> Keys:
    """a's keys then b's (a None: a chunk with no past, b alone)."""
    if a is None:
        return b
    return Keys(*(jnp.concatenate([x, y], axis=1) for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b),
                                                                   strict=True)))


def attend_chunk(q: jax.Array, q_pos: jax.Array, past: Keys | None, own: Keys, window: int | None,
                 scale: float) -> jax.Array:
    """Attention of a chunk's queries q [B, Tq, nh, hd] (positions q_pos [B, Tq]) over the cached
    keys read before the chunk wrote them (`past`; None for a decode step, whose `own` is the cache
    read after its write, and for a chunk with nothing cached) and the chunk's own keys `own` [B, T, ...]:
    per query, `attend`'s softmax over every key it can see, so every path (decode, prefill, verify) sums
    the same terms in the same form. When the queries are the chunk's own tokens (Tq = T, a multiple of
    QUERY_BLOCK above it), query block i reads only the own keys from its window's start to its end: a
    512-token chunk computes 10 of the 16 128 x 128 own-key score blocks, with no extra compiled shape."""
    Tq = q.shape[1]
    blocked = Tq == own.k.shape[1] and Tq > QUERY_BLOCK and Tq % QUERY_BLOCK == 0
    if not blocked:
        keys = _join(past, own)
        return attend(q, keys.k, keys.v, _visible(q_pos, keys.key_pos, keys.key_valid, window), scale)
    outs = []
    for lo in range(0, Tq, QUERY_BLOCK):
        hi = lo + QUERY_BLOCK
        first = 0 if window is None else max(0, lo - window + 1)  # keys before it are out of every query's window
        keys = _join(past, own.slice(first, hi))
        outs.append(attend(q[:, lo:hi], keys.k, keys.v, _visible(q_pos[:, lo:hi], keys.key_pos, keys.key_valid,
                                                                  window), scale))
    return jnp.concatenate(outs, axis=1)


# --------------------------------------------------------------------------------------------- forward


@dataclasses.dataclass
class _Batch:
    """Per-forward position bookkeeping (not a pytree: lives only while tracing)."""

    start: jax.Array  # [B] tokens already cached per row
    new_pos: jax.Array  # [B, T] absolute positions of the new tokens
    new_valid: jax.Array  # [B, T] real (not padding) new tokens
    q_pos: jax.Array  # [B, Tq] positions of the queries still being computed
    # static: attention reads only cache slots [0, kv_len) where kv_len < slots; a tuple of bounds
    # (one-token steps, chunks written into their rows): per layer the smallest that holds every
    # row, chosen at run time (`kv_index`, `past_index`)
    kv_len: int | tuple[int, ...] | None = None
    kv_index: jax.Array | None = None  # [] i32: which of a tuple kv_len's bounds this step reads
    past_index: jax.Array | None = None  # [] i32: and which of past_bounds(kv_len) a chunk's past (0: none)
    rows: jax.Array | None = None  # [B]: the cache row of each row (None: row b)
    tables: dict = dataclasses.field(default_factory=dict)  # rope_tables per (positions, frequencies)

    def rope(self, positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
        """`rope_tables`, computed once per forward for each positions array and frequency set (per
        layer, the trigonometry was 5% of a 512-token prefill on CPU)."""
        if positions.shape[1] == 1:  # decode: B values, nothing to share
            return rope_tables(positions, inv_freq)
        key = (id(positions), inv_freq.tobytes())
        if key not in self.tables or self.tables[key][0] is not positions:
            # `opaque`: XLA would otherwise fuse, and so recompute, the trigonometry into each
            # consumer in every layer.
            tables = opaque(jnp.all(positions >= 0), rope_tables, positions, inv_freq)
            self.tables[key] = (positions, *tables)
        return self.tables[key][1:]


def _attention(
    layer: dict[str, Any],
    x: jax.Array,
    spec: LayerSpec,
    config: ModelConfig,
    batch: _Batch,
    cache_entry: LayerCache | None,
    shared: dict[int, LayerCache | tuple[Keys | None, Keys]],  # per donor layer: its cache, or (past, own)
    layer_index: int,
):
    """Returns (attention output [B, Tq, H], updated cache entry or None)."""
    B, Tq, _ = x.shape
    nh, hd, nkv = config.num_attention_heads, spec.head_dim, spec.num_kv_heads
    inv_freq = rope_inv_freq(config, spec)
    q = linear(x, layer["q"]).reshape(B, Tq, nh, hd)
    q = rotate(rms_norm(q, layer["q_norm"], config.rms_norm_eps), *batch.rope(batch.q_pos, inv_freq))

    new_entry = None
    if spec.owns_kv:
        k_raw = linear(x, layer["k"]).reshape(B, Tq, nkv, hd)
        v = k_raw if spec.k_eq_v else linear(x, layer["v"]).reshape(B, Tq, nkv, hd)
        k = rotate(rms_norm(k_raw, layer["k_norm"], config.rms_norm_eps), *batch.rope(batch.new_pos, inv_freq))
        if config.use_v_norm:
            v = rms_norm(v, None, config.rms_norm_eps)
        # A chunk's queries see its own K/V as the cache holds them (bf16 bits, int8), as a decode
        # step's query sees its own token's, read back after the write: every path attends to the
        # same values, so a prompt's chunking, a verify step and one-token steps draw alike. With the
        # values unrounded, a bf16 cache flipped a tiny random model's greedy token (logit 0.46 ->
        # 0.22) between a speculative verify and plain decode (tests/test_model_parity.py).
        # (A decode step attends to the cache after its write, so its `own` is unused and compiled away.)
        own = Keys(cache_entry.as_read(k), cache_entry.as_read(v), batch.new_pos, batch.new_valid)
        ring = bool(spec.sliding_window)
        if Tq == 1:
            # Decode: write the new position first, then attend over the cache. Attending over the
            # old cache while updating it in place makes XLA keep a copy of the whole cache (two
            # copies per array per step on CPU). On a sliding ring the write overwrites position
            # p - window, which query p no longer sees.
            new_entry = cache_entry.write(k, v, batch.new_pos, batch.new_valid, ring=ring, rows=batch.rows)
            keys = new_entry
        elif batch.rows is not None:
            # A chunk written into its cache rows in place attends, as the plain chunk below does, to
            # its rows' past (the slots below its start) and to its own keys (`own`). A full
            # layer writes first (slots start and above) and reads the past from the written cache.
            # A ring can overwrite slots its own earlier queries still see: its rows are read out
            # first, as a buffer of their own, and the write takes its row indices from that read,
            # so XLA orders the read before the in-place write. (Passed through unchanged, the
            # indices would be forwarded around the conditional, and XLA copied every ring twice;
            # clamped into range inside it, they are its result.)
            if ring:
                past, rows = opaque(jnp.all(batch.rows >= 0),
                                    lambda e, r: (e.take(r), jnp.clip(r, 0, e.k.shape[0] - 1)), cache_entry, batch.rows)
                new_entry = cache_entry.write(k, v, batch.new_pos, batch.new_valid, ring=True, rows=rows)
                keys = (_RowsPast(past, None), own)
            else:
                new_entry = cache_entry.write(k, v, batch.new_pos, batch.new_valid, ring=False, rows=batch.rows)
                keys = (_RowsPast(new_entry, batch.rows), own)
        else:  # a chunk can overwrite ring slots its own earlier queries still see: read, then write
            keys = (_RowsPast(cache_entry, None), own)
            new_entry = cache_entry.write(k, v, batch.new_pos, batch.new_valid, ring=ring)
        shared[layer_index] = keys
    else:
        keys = shared[spec.kv_donor]
    if isinstance(keys, LayerCache):  # a one-token step: the cache after its write
        out = _attend_step(q, keys, batch, spec.sliding_window, config.attention_scale)
    else:  # a chunk: its past and its own keys
        out = _attend_past(q, *keys, batch, spec.sliding_window, config.attention_scale)
    return linear(out.reshape(B, Tq, nh * hd), layer["o"]), new_entry


def _attend_step(q: jax.Array, entry: LayerCache, batch: _Batch, window: int | None, scale: float) -> jax.Array:
    """One-token queries q [B, 1, nh, hd] over a layer's cache `entry` after the step's write, reading
    each row's cache row (`batch.rows`) up to the step's KV bound. With a tuple of bounds, one branch
    per distinct bound (a ring's slots cap it) under `lax.switch` on `batch.kv_index`: one program
    reads what the context needs, where a static bound needs a program per bound."""
    cached = batch.start + jnp.sum(batch.new_valid, axis=1)

    def within(size: int) -> jax.Array:
        visible = entry.visible(size).take(batch.rows)
        keys = Keys(visible.read("k", q.dtype), visible.read("v", q.dtype), *slot_positions(cached, size))
        return attend_chunk(q, batch.q_pos, None, keys, window, scale)

    return _switch(batch.kv_len, batch.kv_index, entry.slots, within)


@dataclasses.dataclass(frozen=True)
class _RowsPast:
    """Where a chunk reads its past, the slots below its start (not a pytree: lives only while
    tracing): rows `rows` of `entry` (None: every row of `entry`, row b the chunk's row b)."""

    entry: LayerCache
    rows: jax.Array | None


def _attend_past(q: jax.Array, past: _RowsPast, own: Keys, batch: _Batch, window: int | None,
                 scale: float) -> jax.Array:
    """A chunk's queries over its rows' past and its own keys (`attend_chunk`), the past read up to
    the static KV bound or, from a tuple, the one that holds every row's start, chosen on the device
    (`batch.past_index`) as `_attend_step` chooses its own. With a tuple, a chunk with nothing cached
    (every real row's start 0: a prompt's first chunk) takes a branch that reads no past
    (`past_bounds`): the smallest bound's slots would all be masked, and on the built-in model they
    cost 15% of a 521-token TTFT (docs/measurements.md, "A first chunk that reads no past, ..."). A ring's past is
    read out before the chunk's write (`_attention`), so no branch reads what the write changed."""

    def within(size: int) -> jax.Array:
        if size == 0:
            return attend_chunk(q, batch.q_pos, None, own, window, scale)
        visible = past.entry.visible(size).take(past.rows)
        keys = Keys(visible.read("k", q.dtype), visible.read("v", q.dtype), *slot_positions(batch.start, size))
        return attend_chunk(q, batch.q_pos, keys, own, window, scale)

    return _switch(past_bounds(batch.kv_len), batch.past_index, past.entry.slots, within)


def past_bounds(kv_len: int | tuple[int, ...] | None) -> int | tuple[int, ...] | None:
    """The bounds a chunk's past is read within: a tuple of KV bounds gains 0, a past of no slots."""
    return (0, *kv_len) if isinstance(kv_len, tuple) else kv_len


def _switch(kv_len: int | tuple[int, ...] | None, index: jax.Array | None, slots: int, within) -> jax.Array:
    """within(size) for the bound `index` picks among kv_len's (a bound, or a tuple: one branch per
    distinct size, a cache's `slots` capping each) under `lax.switch`; one bound needs no switch."""
    bounds = kv_len if isinstance(kv_len, tuple) else (kv_len,)
    sizes = [slots if bound is None else min(bound, slots) for bound in bounds]
    distinct = sorted(set(sizes))
    if len(distinct) == 1:
        return within(distinct[0])
    branch = jnp.asarray([distinct.index(size) for size in sizes], jnp.int32)[index]
    return jax.lax.switch(branch, [functools.partial(within, size) for size in distinct])


def kv_bound_index(bounds: tuple[int, ...], start: jax.Array, num_new: jax.Array, past_only: bool = False) -> jax.Array:
    """[] i32: the index of the first of `bounds` (ascending) that holds every real row's cache after a
    step writes num_new [B] tokens after start [B] cached ones (`past_only`: the start[B] cached
    before it); rows with num_new 0 (idle) do not count, and with none real it is 0."""
    needed = jnp.max(jnp.where(num_new > 0, start + (0 if past_only else num_new), 0))
    return jnp.sum(needed > jnp.asarray(bounds[:-1], jnp.int32)).astype(jnp.int32)


def _decoder_layer(layer, h, ple_l, spec, config, batch, cache_entry, shared, layer_index):
    eps = config.rms_norm_eps
    with jax.named_scope("attention"):
        a, new_entry = _attention(
            layer, rms_norm(h, layer["input_norm"], eps), spec, config, batch, cache_entry, shared, layer_index
        )
    h = h + rms_norm(a, layer["post_attn_norm"], eps)
    with jax.named_scope("mlp"):
        x = rms_norm(h, layer["pre_ffn_norm"], eps)
        m = linear(gelu_tanh(linear(x, layer["gate"])) * linear(x, layer["up"]), layer["down"])
    if config.has_moe:  # the dense MLP and the experts side by side, each normed, then summed
        with jax.named_scope("moe"):
            experts = moe_block(layer, h, config)
        m = rms_norm(m, layer["post_ffn_norm_1"], eps) + rms_norm(experts, layer["post_ffn_norm_2"], eps)
    h = h + rms_norm(m, layer["post_ffn_norm"], eps)
    if ple_l is not None:
        with jax.named_scope("per_layer_input"):
            g = gelu_tanh(linear(h, layer["ple_gate"])) * ple_l
            h = h + rms_norm(linear(g, layer["ple_proj"]), layer["ple_post_norm"], eps)
    if config.use_layer_scalar:
        h = h * layer["layer_scalar"].astype(h.dtype)
    return h, new_entry


def embed(params: Params, tokens: jax.Array, config: ModelConfig, dtype: Any) -> jax.Array:
    """Emb[ids] * sqrt(H), the scale rounded to the table's dtype first (as HF does) -> [B, T, H]."""
    table = params["embed"]
    table_dtype = _storage_dtype(table)
    scale = jnp.asarray(math.sqrt(config.hidden_size), table_dtype)
    return (lookup(table, tokens, table_dtype) * scale).astype(dtype)


def per_layer_inputs(params: Params, tokens: jax.Array, x: jax.Array, config: ModelConfig) -> jax.Array:
    """PLE: ((norm(x W_plmp^T / sqrt(H)) + PLE[ids] * sqrt(P)) / sqrt(2)) -> [B, T, L, P]."""
    B, T, H = x.shape
    L, P = config.num_layers, config.hidden_size_per_layer_input
    table = params["ple_embed"]
    table_dtype = _storage_dtype(table)
    token_part = lookup(table, tokens, table_dtype) * jnp.asarray(math.sqrt(P), table_dtype)
    token_part = token_part.astype(x.dtype).reshape(B, T, L, P)
    context = (linear(x, params["ple_proj"]) * H**-0.5).reshape(B, T, L, P)
    context = rms_norm(context, params["ple_norm"], config.rms_norm_eps)
    return (context + token_part) * 2**-0.5


def _storage_dtype(table) -> Any:
    return getattr(table, "compute_dtype", None) or table.dtype


def lm_head(params: Params, h: jax.Array, config: ModelConfig) -> jax.Array:
    """Final norm, tied head (or a separate `lm_head` form of it), softcap -> float32 logits."""
    return head(params, rms_norm(h, params["final_norm"], config.rms_norm_eps), config)


def head(params: Params, h: jax.Array, config: ModelConfig) -> jax.Array:
    """The head of final-normed hidden states: tied head (or its `lm_head` form), softcap -> float32."""
    logits = linear(h, params.get("lm_head", params["embed"])).astype(jnp.float32)
    logits = gather_vocab(logits)
    if config.final_logit_softcapping:
        cap = config.final_logit_softcapping
        logits = cap * jnp.tanh(logits / cap)
    return logits


def gather_vocab(logits: jax.Array) -> jax.Array:
    """Under a mesh (`jax.set_mesh`, gemmax.engine.mesh): the vocab-split logits [..., V] gathered whole
    on every tp device, rows left split over dp, so sampling (top-k, argmax) runs on local rows. With
    no mesh (one device) it is the identity and adds nothing to the program."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return logits
    dp, tp = mesh.shape.get("dp", 1), mesh.shape.get("tp", 1)
    rows = "dp" if dp > 1 and logits.shape[0] % dp == 0 else None
    middle = [None] * (logits.ndim - 2)
    if tp > 1 and logits.shape[-1] % tp == 0:  # each device's vocab slice first: gather logits, not the table
        logits = jax.lax.with_sharding_constraint(logits, PartitionSpec(rows, *middle, "tp"))
    return jax.lax.with_sharding_constraint(logits, PartitionSpec(rows, *middle, None))


def forward(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,
    start: jax.Array,
    num_new: jax.Array,
    *,
    config: ModelConfig,
    precision: Precision = Precision(),
    logits: Literal["last", "all"] = "last",
    kv_len: int | tuple[int, ...] | None = None,
    hidden: bool = False,
    head_on: jax.Array | None = None,
    rows: jax.Array | None = None,
) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, jax.Array]:
    """Append tokens [B, T] (row b: its first num_new[b] are real, the rest padding) after start[b]
    cached tokens. `kv_len` (static) bounds the cache slots read (full layers, and sliding rings that
    have not wrapped yet), so attention costs what the context uses, not max_len: it must be at least
    every start[b], and for steps written before attending start[b] + num_new[b]. `kv_len` may be a
    tuple of ascending bounds ending at max_len: the step reads the smallest that holds every row's cache
    after its write (a chunk: that holds every row's start, its past; none when nothing is cached), chosen
    at run time (one program for every context length). `rows` [B] names the cache row of each row, so a
    group of a larger cache, or one slot's prefill chunk, writes and reads its own rows in place (None:
    row b is cache row b). A chunk (T > 1) takes the tuple only with `rows`; it attends to its past and
    its own keys as the plain chunk does, reading a full layer's past after its write and a ring's
    rows before it (a chunk can overwrite ring slots its own earlier queries still see).
    Returns (logits, new cache): logits [B, V] at each row's last real token (`logits="last"`; rows
    with num_new 0 get garbage) or [B, T, V] (`"all"`). `hidden` (static): also return the last
    hidden state after the final norm, [B, H] or [B, T, H] like the logits (what an MTP assistant
    reads: gemmax.model.assistant). `head_on` (traced [] bool, None: always): compute the head only
    where it holds, in a conditional (zero logits otherwise): a prefill chunk before a prompt's last
    needs no logits, and the head reads the whole embedding table (on the built-in model 11 ms of
    a 32-token chunk's 62 ms; `gemmax profile --prefill`)."""
    B, T = tokens.shape
    t = jnp.arange(T)[None, :]
    new_pos = start[:, None] + t
    if T > 1 and isinstance(kv_len, tuple) and rows is None:
        raise ValueError("a chunk reads a tuple of KV bounds only when written into its cache rows (`rows`)")
    kv_index = past_index = None
    if isinstance(kv_len, tuple):
        slots = max(layer.slots for layer in cache.layers if layer is not None)
        if list(kv_len) != sorted(set(kv_len)) or kv_len[-1] < slots:
            raise ValueError(f"KV bounds {kv_len} must ascend and end at the cache's {slots} slots or more")
        if T == 1:
            kv_index = kv_bound_index(kv_len, start, num_new)
        else:
            past_index = kv_bound_index(past_bounds(kv_len), start, num_new, past_only=True)
    batch = _Batch(start=start, new_pos=new_pos, new_valid=t < num_new[:, None], q_pos=new_pos, kv_len=kv_len,
                   kv_index=kv_index, past_index=past_index, rows=rows)

    h = embed(params, tokens, config, precision.activation)
    ple = per_layer_inputs(params, tokens, h, config) if config.hidden_size_per_layer_input else None
    last = jnp.maximum(num_new - 1, 0)[:, None]  # [B, 1] index of each row's last real token

    shared: dict[int, Any] = {}
    new_cache = list(cache.layers)
    for i, spec in enumerate(config.layers):
        if logits == "last" and spec.kv_mode == "reuse" and batch.q_pos.shape[1] > 1:
            # Reuse layers write no cache and their outputs only feed the same position onward, so
            # from here only each row's last real token needs computing (HF does the same in prefill).
            h = jnp.take_along_axis(h, last[:, :, None], axis=1)
            ple = None if ple is None else jnp.take_along_axis(ple, last[:, :, None, None], axis=1)
            batch = dataclasses.replace(batch, q_pos=jnp.take_along_axis(new_pos, last, axis=1))
        with jax.named_scope(f"layer_{i}"):
            h, new_cache[i] = _decoder_layer(
                params["layers"][i],
                h,
                None if ple is None else ple[:, :, i, :],
                spec,
                config,
                batch,
                cache.layers[i],
                shared,
                i,
            )
    if logits == "last":
        if h.shape[1] > 1:
            h = jnp.take_along_axis(h, last[:, :, None], axis=1)
        h = h[:, 0]
    normed = rms_norm(h, params["final_norm"], config.rms_norm_eps)
    if head_on is None:
        out = head(params, normed, config)
    else:
        shape = jax.eval_shape(lambda x: head(params, x, config), normed)
        out = jax.lax.cond(head_on, lambda x: head(params, x, config),
                           lambda x: jnp.zeros(shape.shape, shape.dtype), normed)
    if hidden:
        return out, KVCache(tuple(new_cache)), normed
    return out, KVCache(tuple(new_cache))


# The jitted forward for callers that do not wrap it in a larger jitted function.
forward_jit = jax.jit(forward, static_argnames=("config", "precision", "logits", "kv_len", "hidden"))
