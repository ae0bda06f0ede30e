"""Weights in the fastest stored form for the device, and a check of the compiled decode step.

On CPU, decode at batch 1 is one matrix-vector product per weight matrix, and XLA:CPU streams a
bf16 weight at near memory bandwidth only in one fused form (`copy_dot_fusion`: the weight's convert
and transpose fused into a vector-matrix dot) and only while the vector is under 16 KiB in f32
(`linear.GEMV_MAX_IN` = 4095 inputs). Every other spelling makes XLA materialise an f32 copy of the
weight on every step, 20x slower (docs/cpu_decode.md). So `prepare_params` stores each matrix with
more inputs than that as a tuple of column blocks, and `linear.linear` sums per-block products.
Embedding tables are never split: they are gathered by row, and the tied LM head reads the table
with in = hidden size.

The fusion is a heuristic of the XLA version that compiled it, so `decode_weight_reads` parses the
compiled HLO of a decode step and classifies how every weight matrix is read; `check_decode_hlo`
turns that into a list of problems (empty when every matrix is read once by a fused dot). Tests run
it on the real decode step so a jax upgrade that breaks the fusion fails a test instead of silently
making decode 20x slower, and the engine can run it at warm-up.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import jax

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
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<rest>.*)$")
_COMP = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[\w.\-]+) \(.*\{\s*$")
_SHAPE = re.compile(r"(?P<dtype>\w+)\[(?P<dims>[\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    shape: str
    op: str
    operands: tuple[str, ...]
    args: str  # the text between the parentheses: operands, or a parameter's number
    attrs: str
    root: bool

    @property
    def dtype(self) -> str | None:
        """The element type of an array shape ("f32[1,4,256]{2,1,0}" -> "f32"); None for a tuple."""
        match = _SHAPE.match(self.shape)
        return match.group("dtype") if match else None

    @property
    def dims(self) -> tuple[int, ...]:
        """The dimensions of an array shape ("f32[1,4,256]{2,1,0}" -> (1, 4, 256)); () for a tuple."""
        match = _SHAPE.match(self.shape)
        return tuple(int(d) for d in match.group("dims").split(",") if d) if match else ()


def _closing(text: str, depth: int = 0) -> int:
    """Index of the parenthesis that brings `depth` (open parentheses before text[0]) back to zero."""
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return i
    return len(text)


def _parse_instr(line: str) -> _Instr | None:
    match = _INSTR.match(line)
    if not match:
        return None
    rest = match.group("rest")
    if rest.startswith("("):  # tuple shape: up to the matching parenthesis
        end = _closing(rest)
        shape, rest = rest[: end + 1], rest[end + 2 :]
    else:
        shape, _, rest = rest.partition(" ")
    op, _, rest = rest.partition("(")
    end = _closing(rest, depth=1)
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[:end]))
    return _Instr(match.group("name"), shape, op, operands, rest[:end], rest[end + 1 :], line.lstrip().startswith("ROOT"))


def _computations(hlo_text: str) -> tuple[dict[str, list[_Instr]], str]:
    comps: dict[str, list[_Instr]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        head = _COMP.match(line)
        if head:
            current = head.group("name")
            comps[current] = []
            if head.group("entry"):
                entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None:
            instr = _parse_instr(line)
            if instr is not None:
                comps[current].append(instr)
    if not entry:
        raise ValueError("no ENTRY computation in this HLO text")
    return comps, entry


def _fused_root(instr: _Instr, comps: Mapping[str, list[_Instr]]) -> tuple[list[_Instr], _Instr | None]:
    """(body, root) of the computation a fusion calls; ([], None) for anything else."""
    called = re.search(r"calls=%([\w.\-]+)", instr.attrs)
    body = comps.get(called.group(1), []) if called else []
    return body, next((i for i in body if i.root), None)


def _classify(user: _Instr, comps: Mapping[str, list[_Instr]], weight: str, computed: Mapping[str, _Instr]) -> str:
    if user.op in ("gather", "dynamic-slice"):
        return GATHER
    if user.op != "fusion":
        return COPY
    body, root = _fused_root(user, comps)
    if "__ynn_fusion" in user.attrs:
        # The weight is the fusion's operand i, parameter(i) inside; is it the dot's left operand?
        params = {instr.name: instr.args for instr in body if instr.op == "parameter"}
        dot = next((instr for instr in body if instr.op == "dot"), None)
        left = params.get(dot.operands[0]) if dot is not None and dot.operands else None
        return GEMM_LEFT if left == str(user.operands.index(weight)) else GEMM
    ops = {instr.op for instr in body}
    if "kind=kLoop" in user.attrs and root is not None and root.op == "dot" and sum(i.op == "dot" for i in body) == 1:
        vectors = [computed[operand] for operand in user.operands if operand != weight and operand in computed]
        if any(sum(d > 1 for d in vector.dims) > 1 for vector in vectors):
            return GEMV_RESHAPED_VECTOR
        return GEMV
    if ops & {"gather", "dynamic-slice"} and "dot" not in ops:
        return GATHER
    return COPY


def decode_weight_reads(hlo_text: str) -> dict[str, tuple[str, ...]]:
    """{argument path (e.g. "params['layers'][0]['down'][1]"): how each reader of it reads it}, for every
    entry parameter of rank 2 (weight matrices, their column blocks, embedding tables).

    The kinds: GEMV (fused matrix-vector dot), GEMV_RESHAPED_VECTOR (the same, reading a vector
    computed as a wider array: 10x slower), GEMM / GEMM_LEFT (library GEMM with the weight as its right /
    left operand), GATHER (row gather), COPY (a
    materialised converted/transposed copy or an unfused dot: the slow path).
    """
    comps, entry = _computations(hlo_text)
    instrs = comps[entry]
    # What the entry computes (not its parameters: a second weight read by the same fusion).
    computed = {instr.name: instr for instr in instrs if instr.op != "parameter"}
    readers: dict[str, list[_Instr]] = {}
    for instr in instrs:
        for operand in instr.operands:
            readers.setdefault(operand, []).append(instr)
    reads = {}
    for instr in instrs:
        if instr.op != "parameter":
            continue
        if instr.dtype is None or instr.dtype in _INDEX_TYPES or len(instr.dims) != 2:
            continue
        label = re.search(r'op_name="((?:[^"\\]|\\.)*)"', instr.attrs)
        key = label.group(1).replace("\\'", "'") if label else instr.name
        reads[key] = tuple(sorted(_classify(user, comps, instr.name, computed) for user in readers.get(instr.name, [])))
    return reads


def check_decode_hlo(hlo_text: str, batch: int) -> list[str]:
    """Problems with the weight reads of a compiled decode step (empty list: all fast).

    Batch 1: every weight matrix (and column block, and the tied LM head) is read by exactly one
    fused matrix-vector dot; tables may also be gathered. Batch > 1: no weight is read through a
    materialised copy or an unfused dot.
    """
    problems = []
    for name, kinds in decode_weight_reads(hlo_text).items():
        products = [k for k in kinds if k != GATHER]
        if batch == 1 and products and products != [GEMV]:
            problems.append(f"{name}: read as {', '.join(products)} (want exactly one fused matrix-vector dot)")
        elif batch > 1 and COPY in products:
            problems.append(f"{name}: read as {', '.join(products)} (a materialised copy or unfused dot)")
    return problems


def cache_rewrites(hlo_text: str, cache_shapes: list[tuple[int, ...]]) -> list[str]:
    """Instructions of a compiled decode step that produce a whole KV-cache array other than by
    updating it in place (a fusion rooted in a scatter or dynamic-update-slice): copies, dtype
    conversions, re-materialisations. Each one streams the whole cache on every step (XLA:CPU widens
    bf16 cache updates to float32, and keeps a copy when the old cache is read after the update)."""
    wanted = {tuple(shape) for shape in cache_shapes}
    comps, entry = _computations(hlo_text)
    problems = []
    for instr in comps[entry]:
        if instr.dims not in wanted or instr.op in ("parameter", "bitcast", "get-tuple-element"):
            continue
        _, root = _fused_root(instr, comps)
        if instr.op == "fusion" and root is not None and root.op in ("scatter", "dynamic-update-slice"):
            continue
        problems.append(f"{instr.name} = {instr.shape} {instr.op}")
    return problems
