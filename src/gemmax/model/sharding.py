"""Logical axes -> mesh axes: how the params pytree and the KV cache lie on a `jax.sharding.Mesh`.

Each parameter declares the logical axis of each dim once, in `params.param_specs` (`ParamSpec.axes`);
one rules table maps them onto the mesh axes `dp` (data: decode slots), `tp` (tensor) and `ep`
(experts):

    heads, kv_heads, ffn, vocab -> tp        experts -> ep        batch (cache rows, slots) -> dp

and everything else is replicated. A dim is split only when its units divide evenly over the mesh
axis: query heads by `num_attention_heads`, KV projections and the KV cache by the layer's KV heads
(E2B's single KV head, or 31B's 4 global KV heads on tp=8, stay replicated), FFN hidden units, the
vocabulary and the experts by their count. With column-split q/k/v/gate/up and row-split o/down,
each layer costs one all-reduce after the attention output and one after the MLP; the LM head's
vocab-split logits are gathered once (see docs/mesh.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gemmax.model.config import ModelConfig
from gemmax.model.kv_cache import KVCache, LayerCache
from gemmax.model.params import Params, ParamSpec, param_specs, tree_from_leaves

MESH_AXES = ("dp", "tp", "ep")
RULES: Mapping[str, str] = {"heads": "tp", "kv_heads": "tp", "ffn": "tp", "vocab": "tp", "experts": "ep",
                            "batch": "dp"}


def _units(axis: str, dim: int, spec: ParamSpec, config: ModelConfig) -> int:
    """How many indivisible units a dim holds: heads for head axes (a head is never split)."""
    if axis == "heads":
        return config.num_attention_heads
    if axis == "kv_heads":
        return config.layers[spec.path[1]].num_kv_heads
    return dim


def _mesh_axis(logical: str | None, units: int, mesh: Mesh) -> str | None:
    if logical is None:
        return None
    axis = RULES[logical]
    size = mesh.shape.get(axis, 1)
    return axis if size > 1 and units % size == 0 else None


def param_partition(spec: ParamSpec, config: ModelConfig, mesh: Mesh) -> PartitionSpec:
    if not spec.axes:
        return PartitionSpec()
    return PartitionSpec(*(_mesh_axis(a, _units(a, d, spec, config) if a else d, mesh)
                           for a, d in zip(spec.axes, spec.shape, strict=True)))


def param_shardings(config: ModelConfig, mesh: Mesh) -> Params:
    """A NamedSharding per parameter, the params pytree's structure (plain arrays only)."""
    return tree_from_leaves(config, {s.path: NamedSharding(mesh, param_partition(s, config, mesh))
                                     for s in param_specs(config)})


def kv_partition(num_kv_heads: int, ndim: int, mesh: Mesh) -> PartitionSpec:
    """A cache array [B, S, nkv, hd] (or its scales [B, S, nkv]): rows on dp, KV heads on tp."""
    heads = _mesh_axis("kv_heads", num_kv_heads, mesh)
    return PartitionSpec(_mesh_axis("batch", 0, mesh), None, heads, *([None] * (ndim - 3)))


def cache_shardings(cache: KVCache, mesh: Mesh) -> KVCache:
    """NamedShardings for `cache` (any batch divisible by dp), the same pytree structure."""

    def layer(entry: LayerCache | None) -> Any:
        if entry is None:
            return None
        nkv = entry.k.shape[2]
        return jax.tree.map(lambda a: NamedSharding(mesh, kv_partition(nkv, a.ndim, mesh)), entry)

    return KVCache(tuple(layer(entry) for entry in cache.layers))


def rows_sharding(leaf: Any, rows: int, mesh: Mesh) -> NamedSharding:
    """Per-slot state ([rows, ...]) split over dp; anything else replicated."""
    split = leaf.ndim >= 1 and leaf.shape[0] == rows and rows % mesh.shape.get("dp", 1) == 0
    return NamedSharding(mesh, PartitionSpec("dp") if split and mesh.shape.get("dp", 1) > 1 else PartitionSpec())
