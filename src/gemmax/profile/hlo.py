"""What each compiled op of a step does, read from the optimized HLO module that ran (through the
engine's one HLO reader, gemmax.engine.hlo).

The profiler times ops by the name of their HLO instruction (the `hlo_op` stat of each trace event);
this module says what each such instruction is, from its opcode and the opcodes fused into it, never
from a kernel's name.

An op's *body* is the instruction itself, or for a fusion every instruction of its fused computation
(nested fusions included, reduction regions not: they are scalar combiners). Rules, first match wins:

0. `collective`: an all-reduce, all-gather, reduce-scatter, all-to-all or collective-permute (also
   their async -start / -done halves): the communication of a step on a mesh (`--mesh`).
1. `matmul_fp32` / `matmul_lowp`: the body holds a `dot` or `convolution` (or the op is a GEMM
   `custom-call`) and one of its operands is a weight. A weight is an entry parameter passed under
   `weight_arg` (decode_step's `params`), or the output of an op that only converts and moves a
   weight (a materialised f32 / transposed copy: rule 3 below, applied to a weight). The operand is
   followed inside the fusion back through converts and data movement to the fusion parameter the
   op reads from memory; that parameter's dtype decides: f32 / f64 is `matmul_fp32`, anything
   narrower (bf16, f16, int8, fp8) is `matmul_lowp`. So XLA:CPU's fused `copy_dot_fusion`, which
   reads a bf16 weight and widens it in registers, is a 16-bit matmul; a dot that reads an f32 copy
   of the weight made by an earlier convert op is an fp32 matmul, and that convert op is conversion.
2. `attention`: a `dot` / `convolution` with no weight operand (decode: q.k scores and p.v).
3. `conversion`: the body holds a `convert` and otherwise only data movement (parameter, constant,
   bitcast, reshape, transpose, copy, broadcast, slice, concatenate, pad, reverse, iota, tuple,
   get-tuple-element, bitcast-convert): time spent only changing dtypes (and the layout on the way).
   A convert fused into other work stays with that work; the time of non-matmul ops that fuse a
   convert is reported apart as `fused_convert` (an upper bound of what those converts cost).
   Weights carried into a `while` loop or a `conditional` stay weights in its body or branches
   (through the tuple it passes), and in a loop a `dynamic-slice` of one is a tile of it
   (quant.int8's tiled GEMM): its converted tile is conversion, the dot that reads it a matmul.
4. `scatter`: a `scatter` or `dynamic-update-slice` (KV cache writes, with the `dynamic-slice` that
   reads the slot's old value fused in).
5. `gather`: a `gather` or `dynamic-slice` (embedding and PLE rows).
6. `reduce`: `reduce`, `reduce-window`, `sort` (norms, softmax, sampling).
7. `copy`: data movement only (layout copies, concatenations).
8. `elementwise`: anything else that computes (arithmetic, compare / select, transcendentals).
9. `control`: the own time of `conditional`, `while` and `call` (their bodies are timed as ops).
"""

from __future__ import annotations

import dataclasses
import re

from gemmax.engine.hlo import HloIndex, Instr

# The categories, in the order reports list them.
CATEGORIES = ("conversion", "matmul_fp32", "matmul_lowp", "attention", "gather", "scatter", "reduce", "copy",
              "elementwise", "control", "collective")

DATA_MOVEMENT = frozenset({
    "parameter", "constant", "bitcast", "reshape", "transpose", "copy", "broadcast", "slice", "concatenate",
    "pad", "reverse", "iota", "tuple", "get-tuple-element", "bitcast-convert", "copy-start", "copy-done",
})
_MOVES_OR_CONVERTS = DATA_MOVEMENT | {"convert"}
_DOTS = frozenset({"dot", "convolution", "ragged-dot", "scaled-dot"})
_GATHERS = frozenset({"gather", "dynamic-slice"})
_SCATTERS = frozenset({"scatter", "dynamic-update-slice"})
_REDUCES = frozenset({"reduce", "reduce-window", "sort"})
_COLLECTIVES = frozenset(f"{op}{half}" for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                                                  "collective-permute", "collective-broadcast")
                         for half in ("", "-start", "-done"))
_CONTROL = frozenset({"conditional", "while", "call", "async-start", "async-done"})
_FP32 = frozenset({"f32", "f64"})


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """What one timed op is."""

    category: str
    opcodes: tuple[str, ...]  # the distinct opcodes of its body, data movement left out
    read_dtype: str | None = None  # matmul: the dtype the weight is read in
    fused_convert: bool = False  # not a conversion op, but a convert is fused into it
    op_name: str = ""


_BODY = re.compile(r"body=%([\w.\-]+)")
_INDEX = re.compile(r"index=(\d+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRUE = re.compile(r"true_computation=%([\w.\-]+)")
_FALSE = re.compile(r"false_computation=%([\w.\-]+)")


def _pure_conversion(body: list[Instr]) -> bool:
    ops = {i.opcode for i in body}
    return "convert" in ops and ops <= _MOVES_OR_CONVERTS


def _read_parameters(index: HloIndex, fusion: Instr, operand: str) -> list[Instr]:
    """The fusion parameters that `operand` (an instruction of the fused computation) is read from,
    following converts and data movement back (through nested fusions' outputs too)."""
    comp = index.computations.get(fusion.calls or "", {})
    found, todo, seen = [], [operand], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in comp:
            continue
        seen.add(name)
        instr = comp[name]
        if instr.opcode == "parameter":
            found.append(instr)
        elif instr.opcode in _MOVES_OR_CONVERTS or (instr.calls is not None and _pure_conversion(index.body(instr))):
            todo.extend(instr.operands)
    return found


class Classifier:
    """Classifies the timed ops of one module (see the module docstring for the rules)."""

    def __init__(self, index: HloIndex, weight_arg: str = "params"):
        self.index = index
        self.weight_arg = weight_arg
        self._weight: dict[str, bool] = {}
        self._cache: dict[str, OpInfo] = {}
        # Computations that get their inputs as one tuple -> (the op calling them, which operand): a
        # while body (a loop over weight tiles, quant.int8's prefill GEMM, carries the weight and slices
        # one tile per iteration) and a conditional's branches (the LM head on a prompt's last chunk).
        self._callers: dict[str, tuple[Instr, int]] = {}
        self._loops: set[str] = set()
        for instr in index.instrs.values():
            if instr.opcode == "while" and (body := _BODY.search(instr.attrs)):
                self._callers[body.group(1)] = (instr, 0)
                self._loops.add(body.group(1))
            elif instr.opcode == "conditional":
                branches = _BRANCHES.search(instr.attrs)
                names = (re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else
                         [m.group(1) for m in (_TRUE.search(instr.attrs), _FALSE.search(instr.attrs)) if m])
                self._callers.update({name: (instr, 1 + i) for i, name in enumerate(names)})

    def _carried(self, instr: Instr) -> str | None:
        """For a get-tuple-element of the tuple parameter of a while body or conditional branch: the
        caller's input it carries (None otherwise, or where the input is not a plain tuple)."""
        caller = self._callers.get(self.index.home[instr.name])
        source = self.index.instrs.get(instr.operands[0]) if instr.operands else None
        index = _INDEX.search(instr.attrs)
        if caller is None or source is None or source.opcode != "parameter" or index is None:
            return None
        op, position = caller
        packed = self.index.instrs.get(op.operands[position]) if position < len(op.operands) else None
        if packed is None or packed.opcode != "tuple" or int(index.group(1)) >= len(packed.operands):
            return None
        return packed.operands[int(index.group(1))]

    def _moves(self, instr: Instr, ops: set[str]) -> bool:
        """Whether an op only converts and moves its input; in a loop body, slicing a tile counts."""
        allowed = _MOVES_OR_CONVERTS | ({"dynamic-slice"} if self.index.home[instr.name] in self._loops else set())
        return ops <= allowed

    def is_weight(self, name: str) -> bool:
        """An entry parameter under `weight_arg`, or a convert / data-movement op of one."""
        if name not in self._weight:
            instr = self.index.instrs.get(name)
            if instr is None:
                result = False
            elif instr.opcode == "parameter":
                result = instr.op_name == self.weight_arg or instr.op_name.startswith(
                    (f"{self.weight_arg}[", f"{self.weight_arg}."))
            elif instr.opcode == "get-tuple-element" and (carried := self._carried(instr)) is not None:
                result = self.is_weight(carried)
            else:
                moves = self._moves(instr, {i.opcode for i in self.index.body(instr)})
                result = moves and any(self.is_weight(o) for o in instr.operands)
            self._weight[name] = result
        return self._weight[name]

    def _weight_read(self, instr: Instr, body: list[Instr]) -> str | None:
        """The dtype a dot-bearing op reads its weight operand in, or None when no operand is a weight."""
        if instr.calls is None:  # a bare dot / GEMM custom-call: operands are what it reads
            dtypes = [self.index.instrs[o].dtype for o in instr.operands
                      if o in self.index.instrs and self.is_weight(o)]
            return _narrowest(dtypes)
        dtypes = []
        for dot in (i for i in body if i.opcode in _DOTS):
            for operand in dot.operands:
                for param in _read_parameters(self.index, instr, operand):
                    outer = instr.operands[param.parameter] if param.parameter < len(instr.operands) else None
                    if outer is not None and self.is_weight(outer):
                        dtypes.append(param.dtype)
        return _narrowest(dtypes)

    def classify(self, name: str) -> OpInfo:
        if name in self._cache:
            return self._cache[name]
        instr = self.index.instrs[name]
        body = self.index.body(instr)
        ops = {i.opcode for i in body}
        gemm_call = instr.opcode == "custom-call" and bool(re.search(r"gemm|matmul", instr.target or "", re.I))
        read = None
        if ops & _COLLECTIVES:
            category = "collective"
        elif ops & _DOTS or gemm_call:
            read = self._weight_read(instr, body)
            category = "attention" if read is None else ("matmul_fp32" if read in _FP32 else "matmul_lowp")
        elif _pure_conversion(body) or ("convert" in ops and self._moves(instr, ops) and self.is_weight(name)):
            category = "conversion"  # the second: a weight tile sliced and converted in a loop
        elif ops & _SCATTERS:
            category = "scatter"
        elif ops & _GATHERS:
            category = "gather"
        elif ops & _REDUCES:
            category = "reduce"
        elif ops & _CONTROL:
            category = "control"
        elif ops <= DATA_MOVEMENT:
            category = "copy"
        else:
            category = "elementwise"
        info = OpInfo(
            category=category,
            opcodes=tuple(sorted(ops - DATA_MOVEMENT)),
            read_dtype=read,
            fused_convert=category not in ("conversion", "matmul_fp32", "matmul_lowp") and "convert" in ops,
            op_name=instr.op_name,
        )
        self._cache[name] = info
        return info


def _narrowest(dtypes: list[str | None]) -> str | None:
    """The dtype the weights of one op are read in; if it reads several, a 16-bit / int8 one wins."""
    known = [d for d in dtypes if d]
    if not known:
        return None
    return min(known, key=lambda d: (d in _FP32, d))
