"""Memory plan (weights + KV cache + workspace vs device memory) and decode-step traffic.

KV cache: exactly what `gemmax.model.kv_cache.init_cache` allocates (counted from its `jax.eval_shape`). Only layers that own a KV cache store
one (KV-sharing "reuse" layers read their donor's); each stores K and V of [slots, nkv, hd], with
slots = max_len on full-attention layers and a ring of min(window, max_len) on sliding layers. Note
that gemmax's ring keeps `window` slots (512 for Gemma 4 E2B) where transformers keeps window - 1
(511): a step attends over the ring plus its new keys and then writes them, so one slot holds a key
that the step can no longer see (masked by position) and that the write replaces. So for E2B (12 sliding + 3
full producers, bf16) the cache of one row of max_len N >= 512 is

    6144 * N + 12 * 512 * 1024 = 6 KiB per token + 6 MiB fixed,

not the naive 18 KiB per token (that holds only when every producer keeps every token).

Workspace: the transient activations of the largest prefill chunk, dominated by the attention
scores of the widest layer (heads x T x (slots + T) float32, the scores and the probabilities both
live): quadratic in the chunk, which is how a deployment that served 4,105 prompt tokens failed at
5,120. The LM head runs at the last real position only (logits="last"), so the [T, V] logits never
exist. The estimate is calibrated against XLA's own buffer assignment (`compiled.memory_analysis()`,
see tests/test_memory.py) and errs high.

Decode traffic (`bytes_per_decode_step`): the bytes a decode step must read, the numerator of the
bandwidth roofline (`tokens/s <= bandwidth / bytes per step`): every weight matrix once (the tied
LM head reads the embedding table once), only the gathered rows of the embedding and PLE tables,
and the K/V each attention layer can see at this context.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh

from gemmax.engine.mesh import MeshSpec
from gemmax.model.config import ModelConfig
from gemmax.model.kv_cache import cache_bytes, cache_slots, layer_cache_bytes, slot_bytes
from gemmax.model.params import Params, abstract_params, count_bytes, param_specs
from gemmax.model.sharding import MESH_AXES, param_partition
from gemmax.model.stored import StoredWeight

GiB = 1 << 30
MiB = 1 << 20
# The prefix cache's budget when none is given (`serve`, `fit`): the memory the plan leaves free, at
# most this. 1 GiB holds ~58,000 prompt tokens of the built-in model's bf16 KV (18 KiB per token: a
# cached block keeps every KV-owning layer's part).
PREFIX_CACHE_DEFAULT_MAX = GiB


# ------------------------------------------------------------------------------------- KV cache


def kv_cache_bytes(config: ModelConfig, max_len: int, batch: int = 1, dtype: Any = jnp.bfloat16,
                   ring_slack: int = 0) -> int:
    """Bytes of the cache the engine allocates (`init_cache(config, batch, max_len, dtype, ring_slack)`),
    from its `jax.eval_shape` (`kv_cache.cache_bytes`): K and V of every KV-owning layer."""
    return cache_bytes(config, max_len, batch, dtype, ring_slack)


def kv_bytes_per_token(config: ModelConfig, dtype: Any = jnp.bfloat16) -> int:
    """Marginal KV bytes of one more token of max_len once every sliding ring is full: full layers only."""
    return sum(size for spec, size in zip(config.layers, slot_bytes(config, dtype), strict=True)
               if spec.owns_kv and not spec.sliding_window)


def kv_fixed_bytes(config: ModelConfig, dtype: Any = jnp.bfloat16, max_len: int | None = None,
                   ring_slack: int = 0) -> int:
    """KV bytes of the sliding rings (window + ring_slack slots each, fewer when max_len is shorter)."""
    return sum(
        (spec.sliding_window + ring_slack if max_len is None else cache_slots(spec, max_len, ring_slack)) * size
        for spec, size in zip(config.layers, slot_bytes(config, dtype), strict=True)
        if spec.owns_kv and spec.sliding_window
    )


# ------------------------------------------------------------------------------------- weights


def weight_bytes(config: ModelConfig, weight_dtype: Any = jnp.bfloat16) -> int:
    """Bytes of the params pytree in `weight_dtype` (norms float32), from shapes alone (no allocation)."""
    return count_bytes(abstract_params(config, weight_dtype))


def _rows(tree: Any) -> int:
    leaves = jax.tree.leaves(tree)
    return max(leaf.shape[0] for leaf in leaves)


# ------------------------------------------------------------------------------------- workspace


def prefill_workspace_bytes(
    config: ModelConfig, tokens: int, max_len: int, batch: int = 1, activation_dtype: Any = jnp.float32
) -> int:
    """Transient bytes of one prefill of `batch` rows x `tokens` into a cache of `max_len`.

    attention: scores and probabilities (float32) of the widest layer, heads x T x (slots + T), with
               a 12.5% allowance for the mask and the softmax's row statistics;
    per token: gate and up activations of the widest MLP that sees every token (KV-sharing layers
               only run the last token when the logits are wanted at the last position), the
               per-layer inputs [L*P] and a handful of hidden-size vectors.
    """
    act = max(np.dtype(activation_dtype).itemsize, 4)  # attention math and norms run in float32
    keys = max(cache_slots(spec, max_len) for spec in config.layers) + tokens
    scores = config.num_attention_heads * tokens * keys * 4
    every_token = [spec for spec in config.layers if spec.owns_kv] or list(config.layers)
    width = max(spec.intermediate_size for spec in every_token)
    ple = config.num_layers * config.hidden_size_per_layer_input
    heads = config.num_attention_heads * max(spec.head_dim for spec in config.layers)
    per_token = act * (2 * width + ple + 4 * config.hidden_size + 2 * heads)
    return batch * (scores * 9 // 4 + tokens * per_token)


def decode_workspace_bytes(config: ModelConfig, batch: int) -> int:
    """Transient bytes of a decode step: float32 logits [B, V] and the sampler's copies of them."""
    return batch * config.vocab_size * 4 * 4


# ------------------------------------------------------------------------------------- the plan


class MemoryPlanError(RuntimeError):
    """The plan does not fit device memory; the message carries the arithmetic and what would fit."""

    def __init__(self, plan: MemoryPlan):
        self.plan = plan
        super().__init__(plan.explain())


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    model: str
    max_model_len: int
    max_batch: int
    prefill_tokens: int  # the largest prefill chunk the engine compiles
    weight_dtype: str
    kv_dtype: str
    weights: int
    kv_per_token: int  # marginal bytes per token per slot (full-attention layers)
    kv_fixed: int  # sliding rings per slot
    kv_cache: int  # all slots at max_model_len
    workspace: int
    device_memory: int
    reserve: int  # runtime, compiled programs, fragmentation
    largest_max_model_len: int | None  # at max_batch (None: not even 1 token fits)
    largest_batch: int  # at max_model_len (0: not even one slot)
    mesh: str = "1 device"  # every byte figure is per device of this mesh
    prefix_cache: int = 0  # the prefix cache's byte budget (gemmax.engine.prefix_cache; 0: off)
    prefix_cache_auto: bool = False  # the budget is the default: free memory, at most PREFIX_CACHE_DEFAULT_MAX
    ring_slack: int = 0  # extra slots per sliding ring (speculative decoding)
    draft_weights: int = 0  # a draft model's weights (speculative decoding with --draft-model; 0: none)
    draft_kv_cache: int = 0  # its KV cache: one row per slot at max_model_len, rings with the same slack
    weight_copies: int = 0  # of `weights`, the int8 layers' bf16 GEMM copies (gemmax.quant.int8; CPU)

    @property
    def required(self) -> int:
        return self.weights + self.kv_cache + self.workspace + self.prefix_cache + self.draft_weights + self.draft_kv_cache

    @property
    def available(self) -> int:
        return self.device_memory - self.reserve

    @property
    def fits(self) -> bool:
        return self.required <= self.available

    def lines(self) -> list[str]:
        b, n = self.max_batch, self.max_model_len
        verdict = "fits" if self.fits else "DOES NOT FIT"
        out = [
            f"memory plan for {self.model}: max_model_len={n} max_batch={b} on {self.mesh}, per device ({verdict})",
            f"  weights ({self.weight_dtype})        {_fmt(self.weights)}"
            + (f", of which {_fmt(self.weight_copies).strip()} int8 GEMM copies (--no-int8-gemm-copy drops them)"
               if self.weight_copies else ""),
            f"  KV cache ({self.kv_dtype})       {_fmt(self.kv_cache)} = {b} slots x "
            f"({self.kv_per_token:,} B/token x {n:,} tokens + {_fmt(self.kv_fixed)} sliding rings"
            + (f", each window + {self.ring_slack} slots for speculative decoding)" if self.ring_slack else ")"),
            f"  workspace               {_fmt(self.workspace)} (prefill of {self.prefill_tokens:,} tokens, attention scores dominate)",
            f"  prefix cache            {_fmt(self.prefix_cache)} ({self._prefix_note})",
        ]
        if self.draft_weights:
            out += [f"  draft model weights     {_fmt(self.draft_weights)}",
                    f"  draft model KV cache    {_fmt(self.draft_kv_cache)} ({b} slots x {n:,} tokens, its own rings)"]
        out += [
            f"  required                {_fmt(self.required)}",
            f"  device memory           {_fmt(self.device_memory)} - reserve {_fmt(self.reserve)} = {_fmt(self.available)} available",
        ]
        if not self.fits:
            out.append(f"  short by                {_fmt(self.required - self.available)}")
        longest = "none (the weights alone do not fit)" if self.largest_max_model_len is None else f"{self.largest_max_model_len:,}"
        out.append(f"  largest max_model_len at max_batch={b}: {longest}")
        out.append(f"  largest max_batch at max_model_len={n}: {self.largest_batch}")
        return out

    @property
    def _prefix_note(self) -> str:
        if self.prefix_cache_auto:
            return f"default: what the rest leaves free, at most {PREFIX_CACHE_DEFAULT_MAX / GiB:g} GiB; LRU-evicted"
        return "budget, LRU-evicted" if self.prefix_cache else "off"

    def explain(self) -> str:
        return "\n".join(self.lines())

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "required": self.required, "available": self.available, "fits": self.fits}


def _fmt(n: int) -> str:
    return f"{n / GiB:8.3f} GiB ({n:,} B)"


def plan_memory(
    config: ModelConfig,
    max_model_len: int,
    max_batch: int,
    device_memory: int,
    weight_dtype: Any = jnp.bfloat16,
    kv_dtype: Any = jnp.bfloat16,
    activation_dtype: Any = jnp.float32,
    prefill_tokens: int | None = None,
    weights: int | None = None,
    reserve_fraction: float = 0.05,
    model: str = "model",
    mesh: MeshSpec | None = None,
    prefix_cache_bytes: int | None = 0,
    ring_slack: int = 0,
    draft_config: ModelConfig | None = None,
    draft_weights: int = 0,
    weight_copies: int = 0,
) -> MemoryPlan:
    """The arithmetic of one deployment. `prefill_tokens` is the largest prefill chunk (default:
    max_model_len, a whole prompt at once); `weights` overrides the weight bytes (e.g. a quantised
    checkpoint's `Checkpoint.weight_bytes`). With a `mesh`, every figure is per device: each
    parameter divided by the mesh axes its sharding rule splits it over (`model.sharding`), the KV
    cache by dp (slots) and by tp where the KV heads split, the prefill workspace by tp (heads).
    `prefix_cache_bytes`: the prefix cache's budget, held on the device beside the KV cache (None: the
    default, what the rest leaves free up to PREFIX_CACHE_DEFAULT_MAX; it never makes a plan not fit).
    `ring_slack`: extra slots per sliding ring (speculative decoding's k_max, `kv_cache` docstring).
    `draft_config`, `draft_weights`: a draft model (one device only), its weight bytes; its KV cache
    (one row per slot, as the target's) is counted from its config. `weight_copies`: the part of
    `weights` that int8 layers hold again in bf16 for the CPU GEMM (named in the plan, with the flag
    that drops it)."""
    if draft_config is not None and mesh is not None:
        raise ValueError("a draft model runs on one device: it cannot be planned with a mesh")
    if max_model_len < 1 or max_batch < 1:
        raise ValueError(f"max_model_len and max_batch must be >= 1, got {max_model_len} and {max_batch}")
    split = _MeshSplit(config, mesh, ring_slack)
    weights = split.weights(weight_dtype) if weights is None else weights // split.weight_ratio(weight_dtype)
    reserve = int(device_memory * reserve_fraction)

    def draft_kv(n: int, b: int) -> int:
        return 0 if draft_config is None else cache_bytes(draft_config, n, b, kv_dtype, ring_slack)

    def required(n: int, b: int) -> int:
        chunk = n if prefill_tokens is None else min(prefill_tokens, n)
        return (weights + split.kv(n, b, kv_dtype) + split.workspace(chunk, n, b, activation_dtype)
                + (prefix_cache_bytes or 0) + draft_weights + draft_kv(n, b))

    available = device_memory - reserve
    longest = _largest(lambda n: required(n, max_batch) <= available, config.max_position_embeddings)
    widest = split.dp * (_largest(lambda r: required(max_model_len, r * split.dp) <= available, 1 << 16) or 0)
    chunk = max_model_len if prefill_tokens is None else min(prefill_tokens, max_model_len)
    prefix_cache = prefix_cache_bytes
    if prefix_cache is None:
        prefix_cache = min(PREFIX_CACHE_DEFAULT_MAX, max(0, available - required(max_model_len, max_batch)))
    return MemoryPlan(
        model=model,
        max_model_len=max_model_len,
        max_batch=max_batch,
        prefill_tokens=chunk,
        weight_dtype=jnp.dtype(weight_dtype).name,
        kv_dtype=jnp.dtype(kv_dtype).name,
        weights=weights,
        kv_per_token=kv_bytes_per_token(config, kv_dtype),
        kv_fixed=kv_fixed_bytes(config, kv_dtype, max_model_len, ring_slack),
        ring_slack=ring_slack,
        kv_cache=split.kv(max_model_len, max_batch, kv_dtype),
        workspace=split.workspace(chunk, max_model_len, max_batch, activation_dtype),
        device_memory=device_memory,
        reserve=reserve,
        largest_max_model_len=longest,
        largest_batch=widest,
        mesh="1 device" if mesh is None else f"mesh {mesh} ({mesh.size} devices)",
        prefix_cache=prefix_cache,
        prefix_cache_auto=prefix_cache_bytes is None,
        draft_weights=draft_weights,
        draft_kv_cache=draft_kv(max_model_len, max_batch),
        weight_copies=weight_copies // split.weight_ratio(weight_dtype),
    )


class _MeshSplit:
    """Per-device bytes on a mesh (one device: the whole figures)."""

    def __init__(self, config: ModelConfig, mesh: MeshSpec | None, ring_slack: int = 0):
        self.config = config
        self.ring_slack = ring_slack
        self.mesh = mesh
        self.dp = mesh.dp if mesh else 1
        tp = mesh.tp if mesh else 1
        # KV heads split on tp where every KV-owning layer has enough (else that layer is replicated)
        self.kv_tp = [tp if spec.num_kv_heads % tp == 0 else 1 for spec in config.layers]
        self.heads_tp = tp if config.num_attention_heads % tp == 0 else 1

    def weights(self, weight_dtype: Any) -> int:
        if self.mesh is None:
            return weight_bytes(self.config, weight_dtype)
        abstract = AbstractMesh((self.mesh.dp, self.mesh.tp, self.mesh.ep), MESH_AXES)
        total = 0
        for spec in param_specs(self.config):
            parts = math.prod(abstract.shape[a] for a in param_partition(spec, self.config, abstract) if a)
            total += math.prod(spec.shape) * np.dtype(spec.dtype(weight_dtype)).itemsize // parts
        return total

    def weight_ratio(self, weight_dtype: Any) -> int:
        """Whole weights over per-device weights (to scale a measured checkpoint size)."""
        return max(1, weight_bytes(self.config, weight_dtype) // self.weights(weight_dtype))

    def kv(self, max_len: int, batch: int, kv_dtype: Any) -> int:
        if self.mesh is None:
            return kv_cache_bytes(self.config, max_len, batch, kv_dtype, self.ring_slack)
        rows = -(-batch // self.dp)
        per_layer = layer_cache_bytes(self.config, max_len, 1, kv_dtype, self.ring_slack)
        return rows * sum(size // tp for size, tp in zip(per_layer, self.kv_tp, strict=True))

    def workspace(self, chunk: int, max_len: int, batch: int, activation_dtype: Any) -> int:
        prefill = prefill_workspace_bytes(self.config, chunk, max_len, 1, activation_dtype) // self.heads_tp
        return max(prefill, decode_workspace_bytes(self.config, -(-batch // self.dp)))


# Accelerators of `gemmax fit --table`: nominal memory in GB (1e9 B), as sold.
ACCELERATORS: dict[str, int] = {
    "T4 16GB": 16 * 10**9, "L4 24GB": 24 * 10**9, "A100 40GB": 40 * 10**9, "A100 80GB": 80 * 10**9,
    "H100 80GB": 80 * 10**9, "H200 141GB": 141 * 10**9, "TPU v5e 16GB": 16 * 10**9, "TPU v6e 32GB": 32 * 10**9,
}


def mesh_candidates(config: ModelConfig, devices: int, slots: int) -> list[MeshSpec]:
    """Meshes of exactly `devices` devices the engine can run: dp divides the slots, ep divides the
    experts (MoE only); tp first (it splits the weights), then ep, then dp."""
    out = []
    for tp in range(devices, 0, -1):
        for ep in range(devices // tp, 0, -1):
            if devices % (tp * ep):
                continue
            dp = devices // (tp * ep)
            if slots % dp or (ep > 1 and (not config.has_moe or config.num_experts % ep)):
                continue
            out.append(MeshSpec(dp=dp, tp=tp, ep=ep))
    return out


def smallest_mesh(config: ModelConfig, device_memory: int, max_model_len: int = 8192, slots: int = 8,
                  max_devices: int = 64, **plan_options) -> MemoryPlan | None:
    """The plan on the fewest devices (powers of two up to `max_devices`) that serves `slots` x
    `max_model_len`, the mesh with the most room among those; None when none does."""
    devices = 1
    while devices <= max_devices:
        plans = [plan_memory(config, max_model_len, slots, device_memory, mesh=None if devices == 1 else m,
                             **plan_options) for m in mesh_candidates(config, devices, slots)]
        fitting = [p for p in plans if p.fits]
        if fitting:
            return max(fitting, key=lambda p: (p.available - p.required, p.largest_batch))
        devices *= 2
    return None


def fit_table(models: dict[str, ModelConfig], max_model_len: int = 8192, slots: int = 8,
              **plan_options) -> list[dict[str, Any]]:
    """One row per (model, accelerator): the smallest mesh serving slots x max_model_len, and on it the
    largest batch at max_model_len and the largest context at `slots` slots."""
    rows = []
    for name, config in models.items():
        for accelerator, memory in ACCELERATORS.items():
            plan = smallest_mesh(config, memory, max_model_len, slots, model=name, **plan_options)
            rows.append({"model": name, "accelerator": accelerator,
                         "mesh": None if plan is None else plan.mesh,
                         "weights_per_device": None if plan is None else plan.weights,
                         "kv_per_device": None if plan is None else plan.kv_cache,
                         "largest_batch": None if plan is None else plan.largest_batch,
                         "largest_context": None if plan is None else plan.largest_max_model_len})
    return rows


def check_fit(plan: MemoryPlan) -> MemoryPlan:
    """The plan, or MemoryPlanError (arithmetic and what would fit) when it does not fit."""
    if not plan.fits:
        raise MemoryPlanError(plan)
    return plan


def _largest(ok, upper: int) -> int | None:
    """Largest n in [1, upper] with ok(n), for ok monotone (true then false); None if ok(1) is false."""
    if not ok(1):
        return None
    lo, hi = 1, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


# ------------------------------------------------------------------------------------- decode traffic


@dataclasses.dataclass(frozen=True)
class DecodeTraffic:
    """Bytes one decode step reads, by kind."""

    matrices: int  # every layer matrix and the PLE projection, read once per step
    lm_head: int  # the tied embedding table (or a separate lm_head form), read once
    gathered: int  # embedding and PLE rows of the batch's tokens
    norms: int
    kv: int  # K and V visible to every attention layer (KV-sharing layers re-read their donor's)

    @property
    def weights(self) -> int:
        return self.matrices + self.lm_head + self.gathered + self.norms

    @property
    def total(self) -> int:
        return self.weights + self.kv


def decode_traffic(
    config: ModelConfig, params: Params, batch: int, context: int, kv_dtype: Any = jnp.bfloat16,
    rows: int | None = None,
) -> DecodeTraffic:
    """Bytes read by one decode step of `batch` rows at `context` tokens, from params (arrays or
    ShapeDtypeStructs, plain or prepared by `fastpath.prepare_params`). `rows`: the rows each matrix
    multiplies (default `batch`; a verify step's batch x (k + 1)), which decides what a quantised form
    reads (`StoredWeight.bytes_read`: an int8 matrix's bf16 GEMM copy from 8 rows on CPU)."""
    head = params.get("lm_head")
    lm_head = count_bytes(head if head is not None else params["embed"])
    gathered = 0
    for table in ("embed", "ple_embed"):
        if table in params:
            gathered += batch * count_bytes(params[table]) // _rows(params[table])
    matrices = norms = 0
    model_level = {k: v for k, v in params.items() if k not in ("embed", "ple_embed", "lm_head", "layers")}
    for subtree in (model_level, params["layers"]):
        for leaf in jax.tree.leaves(subtree, is_leaf=lambda x: isinstance(x, StoredWeight)):
            if isinstance(leaf, StoredWeight):  # a quantised matrix (its scales included): what the rows read of it
                matrices += leaf.bytes_read(batch if rows is None else rows)
                continue
            size = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
            if len(leaf.shape) >= 2:
                matrices += size
            else:
                norms += size
    kv = 0
    for spec, size in zip(config.layers, slot_bytes(config, kv_dtype), strict=True):  # sharing layers: the donor's
        visible = min(context, spec.sliding_window) if spec.sliding_window else context
        kv += batch * visible * size
    return DecodeTraffic(matrices=matrices, lm_head=lm_head, gathered=gathered, norms=norms, kv=kv)


def bytes_per_decode_step(
    config: ModelConfig, params: Params, batch: int, context: int, kv_dtype: Any = jnp.bfloat16
) -> int:
    """Total bytes one decode step must read (the roofline's numerator); see `decode_traffic`."""
    return decode_traffic(config, params, batch, context, kv_dtype).total


# ------------------------------------------------------------------------------------- bandwidth


def measure_read_bandwidth(size_mib: int = 512, repeats: int = 7, threads: int | None = None) -> float:
    """All-core memory read bandwidth in GB/s (1e9 B/s): median over `repeats` passes of one thread per
    core OR-reducing its share of a `size_mib` buffer (far beyond the last-level cache).

    numpy's reductions release the GIL, so the threads run in parallel; an integer OR is exact,
    vectorised and does too little arithmetic to be compute-bound. The first pass is not counted.
    """
    threads = threads or os.cpu_count() or 1
    # Written, distinct values: an untouched np.zeros buffer maps every page to the kernel's shared zero
    # page, and reading that runs from cache.
    buffer = np.arange(size_mib * MiB // 8, dtype=np.uint64)
    chunks = np.array_split(buffer, threads)
    barrier = threading.Barrier(threads)
    passes = repeats + 1
    spans = [[(0.0, 0.0)] * passes for _ in range(threads)]

    def work(index: int) -> None:
        # Each thread times itself: a separate timing thread would be a third thread on two cores
        # and could start its clock late, overstating the bandwidth.
        for p in range(passes):
            barrier.wait()
            t0 = time.perf_counter()
            np.bitwise_or.reduce(chunks[index])
            spans[index][p] = (t0, time.perf_counter())

    pool = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    seconds = [max(s[p][1] for s in spans) - min(s[p][0] for s in spans) for p in range(passes)]
    return buffer.nbytes / float(np.median(seconds[1:])) / 1e9


# ------------------------------------------------------------------------- memory maps (host JIT)
MAP_SHARE = 0.9  # of the process's limit on memory maps that the declared programs may be projected to hold


class MapLimitError(RuntimeError):
    """Warm-up stopped: the declared programs would hold more memory maps than the process may."""


def memory_maps() -> int | None:
    """The memory maps this process holds (/proc/self/maps); None where /proc does not say."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return None


def max_map_count() -> int | None:
    """The kernel's limit on one process's memory maps (vm.max_map_count); None where /proc does not say."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


@dataclasses.dataclass
class MapBudget:
    """The memory maps of `programs` programs compiled or loaded for one warm-up, against the process's
    limit. XLA:CPU's JIT maps each compiled kernel's code and data on its own: a program of the
    built-in model holds about 800 maps (28,425 for the 35 programs of `serve --speculative ngram`,
    2026-12-06), and at the limit (65,530 by default on Linux) LLVM aborts the whole process with
    "Unable to allocate section memory" (the 59 programs that start used to declare reached 61,291
    maps, then it aborted). `check` as programs become ready refuses first, with the arithmetic.
    `parallel`: programs compiled at once; the ones in flight already hold maps but are not counted
    ready, so the projection waits until that many are ready (before, only the maps now count)."""

    programs: int
    parallel: int = 1
    # read when the budget is made (lambdas: looked up then, so a test can set the limit)
    limit: int | None = dataclasses.field(default_factory=lambda: max_map_count())
    start: int | None = dataclasses.field(default_factory=lambda: memory_maps())
    done: int = dataclasses.field(default=0, init=False)  # programs ready at the last check

    def check(self, done: int | None = None) -> None:
        """`done` of the programs are compiled or loaded (None: one more than at the last check):
        raise MapLimitError when the rest, at the maps each done one added on average, would take
        the process past MAP_SHARE of its limit."""
        self.done = self.done + 1 if done is None else done
        used = memory_maps()
        if self.limit is None or self.start is None or used is None or self.done <= 0:
            return
        per_program = max(used - self.start, 0) / self.done if self.done >= self.parallel else 0.0
        left = max(self.programs - self.done, 0)
        projected = used + per_program * left
        if projected > MAP_SHARE * self.limit:
            raise MapLimitError(
                f"this process would hold about {projected:,.0f} memory maps after the {self.programs} declared "
                f"programs: {used:,} now with {self.done} ready (about {per_program:,.0f} each: XLA's JIT maps "
                f"every compiled kernel) and {left} to go, over {MAP_SHARE:.0%} of its limit of {self.limit:,} "
                f"(vm.max_map_count), at which the compiler aborts the process. Raise the limit "
                f"(sysctl -w vm.max_map_count=262144) or declare fewer shapes (--max-batch, --max-model-len, "
                f"--speculative off)")
