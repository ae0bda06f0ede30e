"""Weights in the fastest stored form for the device, and a check of the compiled decode step.

On CPU, decode at batch 1 is one matrix-vector product per weight matrix, and XLA:CPU streams a
bf16 weight at near memory bandwidth only in one fused form (`copy_dot_fusion`: the weight's convert
and transpose fused into a vector-matrix dot) and only while the vector is under 16 KiB in f32
(`linear.GEMV_MAX_IN` = 4095 inputs). Every other spelling makes XLA materialise an f32 copy of the
weight on every step, 20x slower (docs/cpu_decode.md). So `prepare_params` stores each matrix with
more inputs than that as a tuple of column blocks, and `linear.linear` sums per-block products.
Embedding tables are never split: they are gathered by row, and the tied LM head reads the table
with in = hidden size.

The fusion is a heuristic of the XLA version that compiled it, so `decode_weight_reads` reads the
compiled HLO of a decode step (gemmax.engine.hlo) and classifies how every weight matrix is read; `check_decode_hlo`
turns that into a list of problems (empty when every matrix is read once by a fused dot). Tests run
it on the real decode step so a jax upgrade that breaks the fusion fails a test instead of silently
making decode 20x slower, and the engine can run it at warm-up.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax

from gemmax.engine.hlo import HloIndex, Instr
from gemmax.model.config import ModelConfig
from gemmax.model.linear import GEMV_MAX_IN, column_blocks
from gemmax.model.params import Params, map_params


def split_columns(w: jax.Array, widths: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """W [out, in] -> column blocks ([out, widths[0]], ...), each its own contiguous array."""
    blocks, start = [], 0
    for width in widths:
        blocks.append(w[:, start : start + width])
        start += width
    return tuple(blocks)


def prepare_params(params: Params, config: ModelConfig, policy, max_in: int = GEMV_MAX_IN) -> Params:
    """Loaded params -> the stored form `linear` reads fastest on `policy.platform`.

    CPU: matrices with more than `GEMV_MAX_IN` inputs become tuples of column blocks (down
    projections of width 6144/12288, o projections of full-attention layers with 8x512 inputs, ...).
    GPU / TPU: unchanged (cuBLAS / the TPU MXU read [out, in] weights directly).
    Already-split matrices are left as they are, so preparing twice is harmless. Works on arrays and,
    under `jax.eval_shape`, on ShapeDtypeStructs.
    """
    if policy.platform != "cpu":
        return params
    def split(spec, value):
        if spec.kind == "matrix" and not isinstance(value, tuple) and value.shape[-1] > max_in:
            return split_columns(value, column_blocks(value.shape[-1], max_in))
        return value

    return map_params(params, config, split)  # a separate "lm_head" form (quantiser) is kept as is


# ------------------------------------------------------------------------------- compiled HLO check

GEMV = "gemv"  # kLoop fusion whose root is a dot: XLA:CPU's fused matrix-vector product
GEMM = "gemm"  # a library GEMM fusion (YNNPACK on CPU) reading the weight as stored, as its right operand
GEMM_LEFT = "gemm, weight on the left"  # the same with the weight as its left operand (streamed, not repacked)
GATHER = "gather"  # rows gathered (embedding lookup)
COPY = "copy"  # anything else: a converted / transposed copy of the weight, a plain dot, ...
# A fused matrix-vector dot whose vector is an [h, d] array reshaped inside the fusion: it indexes the
# vector in its inner loop and runs ~10x slower (gemmax.model.linear.flat_vector prevents it).
GEMV_RESHAPED_VECTOR = "gemv on a reshaped vector"

_INDEX_TYPES = ("pred", "s32", "s64", "u32", "u64")  # token ids, positions: never weights


def _classify(index: HloIndex, user: Instr, weight: str, computed: Mapping[str, Instr]) -> str:
    if user.opcode in ("gather", "dynamic-slice"):
        return GATHER
    if user.opcode != "fusion":
        return COPY
    body, root = index.fused(user)
    if user.backend_fusion == "__ynn_fusion":
        # The weight is the fusion's operand i, parameter(i) inside; is it the dot's left operand?
        params = {instr.name: instr.parameter for instr in body if instr.opcode == "parameter"}
        dot = next((instr for instr in body if instr.opcode == "dot"), None)
        left = params.get(dot.operands[0]) if dot is not None and dot.operands else None
        return GEMM_LEFT if left == user.operands.index(weight) else GEMM
    ops = {instr.opcode for instr in body}
    if user.fusion_kind == "kLoop" and root is not None and root.opcode == "dot" and sum(i.opcode == "dot" for i in body) == 1:
        vectors = [computed[operand] for operand in user.operands if operand != weight and operand in computed]
        if any(sum(d > 1 for d in vector.dims) > 1 for vector in vectors):
            return GEMV_RESHAPED_VECTOR
        return GEMV
    if ops & {"gather", "dynamic-slice"} and "dot" not in ops:
        return GATHER
    return COPY


def decode_weight_reads(hlo: str | HloIndex) -> dict[str, tuple[str, ...]]:
    """{argument path (e.g. "params['layers'][0]['down'][1]"): how each reader of it reads it}, for every
    entry parameter of rank 2 (weight matrices, their column blocks, embedding tables).

    The kinds: GEMV (fused matrix-vector dot), GEMV_RESHAPED_VECTOR (the same, reading a vector
    computed as a wider array: 10x slower), GEMM / GEMM_LEFT (library GEMM with the weight as its right /
    left operand), GATHER (row gather), COPY (a
    materialised converted/transposed copy or an unfused dot: the slow path).
    """
    index = HloIndex.read(hlo)
    instrs = index.computations[index.entry].values()
    # What the entry computes (not its parameters: a second weight read by the same fusion).
    computed = {instr.name: instr for instr in instrs if instr.opcode != "parameter"}
    readers: dict[str, list[Instr]] = {}
    for instr in instrs:
        for operand in instr.operands:
            readers.setdefault(operand, []).append(instr)
    reads = {}
    for instr in instrs:
        if instr.opcode != "parameter":
            continue
        if instr.dtype is None or instr.dtype in _INDEX_TYPES or len(instr.dims) != 2:
            continue
        key = instr.op_name or instr.name
        reads[key] = tuple(sorted(_classify(index, user, instr.name, computed) for user in readers.get(instr.name, [])))
    return reads


def check_decode_hlo(hlo: str | HloIndex, batch: int) -> list[str]:
    """Problems with the weight reads of a compiled decode step (empty list: all fast).

    Batch 1: every weight matrix (and column block, and the tied LM head) is read by exactly one
    fused matrix-vector dot; tables may also be gathered. Batch > 1: no weight is read through a
    materialised copy or an unfused dot.
    """
    problems = []
    for name, kinds in decode_weight_reads(hlo).items():
        products = [k for k in kinds if k != GATHER]
        if batch == 1 and products and products != [GEMV]:
            problems.append(f"{name}: read as {', '.join(products)} (want exactly one fused matrix-vector dot)")
        elif batch > 1 and COPY in products:
            problems.append(f"{name}: read as {', '.join(products)} (a materialised copy or unfused dot)")
    return problems


IN_PLACE = ("scatter", "dynamic-update-slice")  # the HLO updates that write a cache array in place


def cache_rewrites(hlo: str | HloIndex, cache_shapes: list[tuple[int, ...]]) -> list[str]:
    """Instructions of a compiled step that produce a whole KV-cache array other than by updating
    it in place (a scatter or dynamic-update-slice, or a fusion rooted in one): copies, dtype
    conversions, re-materialisations. Each one streams the whole cache on every step (XLA:CPU widens
    bf16 cache updates to float32, and keeps a copy when the old cache is read after the update)."""
    wanted = {tuple(shape) for shape in cache_shapes}
    index = HloIndex.read(hlo)
    problems = []
    for instr in index.computations[index.entry].values():
        if instr.dims not in wanted or instr.opcode in ("parameter", "bitcast", "get-tuple-element"):
            continue
        _, root = index.fused(instr)
        if instr.opcode in IN_PLACE or (instr.opcode == "fusion" and root is not None and root.opcode in IN_PLACE):
            continue
        problems.append(f"{instr.name} = {instr.shape} {instr.opcode}")
    return problems
