"""One reader of compiled HLO, for every check that looks at what XLA made of a step: the policy's
start-up probe and the fast-path audit (gemmax.engine.fastpath), and the profiler (gemmax.profile.hlo).

jaxlib parses the module (`hlo_module_from_text` for the text of `Compiled.as_text()`, or the module
a `Compiled` runs); `HloIndex` keeps, per instruction, what the checks read: opcode, result dtype and
dimensions, operands, the fused computation and fusion kind, the custom-call target, the parameter
number and the JAX-level name in its metadata (an entry parameter's is its argument path, e.g.
"params['layers'][0]['up']").
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxlib import _hlo

_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = ")
_ARRAY = re.compile(r"(?P<dtype>\w+)\[(?P<dims>[\d,]*)\]")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_KIND = re.compile(r"kind=(k\w+)")
_FUSION_CONFIG = re.compile(r'"fusion_config":\{"kind":"([^"]+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_CALLED = re.compile(r"%([\w.\-]+)")
_ENTRY = re.compile(r"^ENTRY %?([\w.\-]+)", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class Instr:
    """One HLO instruction, as much of it as the checks need."""

    name: str
    opcode: str  # HLO text spelling: "fusion", "dynamic-update-slice", ...
    shape: str  # the result shape as HLO prints it: "bf16[8,512]{1,0}", "(f32[2]{0}, s32[])"
    operands: tuple[str, ...]
    calls: str | None  # the fused computation of a fusion
    fusion_kind: str | None  # "kLoop", "kCustom", ... (fusions only)
    backend_fusion: str | None  # the backend's fusion kind in its config: "__ynn_fusion" (XLA:CPU's YNNPACK)
    target: str | None  # custom-call target
    parameter: int | None  # parameter number
    op_name: str  # the JAX-level name in the metadata ("params['layers'][0]['up']", "jit(f)/dot_general")
    attrs: str  # the text after the operands: every other attribute, for the rare check that needs one

    @property
    def dtype(self) -> str | None:
        """The element type of an array result ("f32[1,4,256]{2,1,0}" -> "f32"); None for a tuple."""
        match = _ARRAY.match(self.shape)
        return match.group("dtype") if match else None

    @property
    def dims(self) -> tuple[int, ...]:
        """The dimensions of an array result ("f32[1,4,256]{2,1,0}" -> (1, 4, 256)); () for a tuple."""
        match = _ARRAY.match(self.shape)
        return tuple(int(d) for d in match.group("dims").split(",") if d) if match else ()


def _closing(text: str, depth: int = 0) -> int:
    """Index of the parenthesis that brings `depth` (open parentheses before text[0]) back to zero."""
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return i
    return len(text)


def _instr(hlo_instruction: Any) -> Instr:
    text = hlo_instruction.to_string()
    rest = text[_HEAD.match(text).end() :]
    if rest.startswith("("):  # a tuple shape: up to its matching parenthesis
        end = _closing(rest)
        shape, rest = rest[: end + 1], rest[end + 2 :]
    else:
        shape, _, rest = rest.partition(" ")
    opcode, _, rest = rest.partition("(")
    end = _closing(rest, depth=1)
    args, attrs = rest[:end], rest[end + 1 :]  # the operands (a parameter's number), the attributes
    search = {pattern: pattern.search(attrs) for pattern in (_CALLS, _KIND, _FUSION_CONFIG, _TARGET, _OP_NAME)}
    return Instr(
        name=hlo_instruction.name,
        opcode=opcode,
        shape=shape,
        operands=tuple(o.name for o in hlo_instruction.operands()),
        calls=search[_CALLS].group(1) if search[_CALLS] and opcode == "fusion" else None,
        fusion_kind=search[_KIND].group(1) if search[_KIND] and opcode == "fusion" else None,
        backend_fusion=search[_FUSION_CONFIG].group(1) if search[_FUSION_CONFIG] else None,
        target=search[_TARGET].group(1) if search[_TARGET] else None,
        parameter=int(args) if opcode == "parameter" else None,
        op_name=search[_OP_NAME].group(1).replace("\\'", "'") if search[_OP_NAME] else "",
        attrs=attrs,
    )


class HloIndex:
    """Every instruction of one HLO module, by name, with its computation's instructions."""

    def __init__(self, hlo_module: Any):
        self.name: str = hlo_module.name
        self.computations: dict[str, dict[str, Instr]] = {}
        self.roots: dict[str, str] = {}  # computation -> its root instruction
        for comp in hlo_module.computations():
            instructions = comp.instructions()
            self.computations[comp.name] = {i.name: i for i in map(_instr, instructions)}
            unused = [i.name for i in instructions if not i.users()]
            if unused:  # the root is the one instruction nothing reads (parameters aside)
                self.roots[comp.name] = next((n for n in unused if self.computations[comp.name][n].opcode != "parameter"),
                                             unused[-1])
        self.instrs: dict[str, Instr] = {}
        self.home: dict[str, str] = {}  # instruction name -> its computation
        for comp_name, instrs in self.computations.items():
            for name, instr in instrs.items():
                self.instrs[name] = instr
                self.home[name] = comp_name
        called = {c for i in self.instrs.values() for c in _CALLED.findall(i.attrs)} & set(self.computations)
        entries = [c for c in self.computations if c not in called]
        if len(entries) != 1:
            # An async op in its short form (`custom-call-start(...)`, as TPU programs print them) names
            # no computation it runs, so its wrapped computation looks uncalled: the text's ENTRY says
            # (read only then: printing a large module costs more than the check above).
            match = _ENTRY.search(hlo_module.to_string())
            entries = [match.group(1)] if match and match.group(1) in self.computations else entries
        if len(entries) != 1:
            raise ValueError(f"HLO module {self.name}: cannot tell the entry computation among {entries}")
        self.entry: str = entries[0]

    @classmethod
    def from_compiled(cls, compiled: Any) -> HloIndex:
        """From a `jax.stages.Compiled` (`jitted.lower(...).compile()`): the module that actually runs."""
        return cls(compiled.runtime_executable().hlo_modules()[0])

    @classmethod
    def read(cls, hlo: str | HloIndex | Any) -> HloIndex:
        """An index of HLO text (`Compiled.as_text()`), of a jaxlib HloModule, or the index itself."""
        if isinstance(hlo, HloIndex):
            return hlo
        return cls(_hlo.hlo_module_from_text(hlo) if isinstance(hlo, str) else hlo)

    def body(self, instr: Instr) -> list[Instr]:
        """The instruction, or everything fused into it (nested fusions flattened)."""
        if instr.calls is None:
            return [instr]
        out = []
        for inner in self.computations.get(instr.calls, {}).values():
            out.extend(self.body(inner) if inner.calls is not None else [inner])
        return out

    def fused(self, instr: Instr) -> tuple[list[Instr], Instr | None]:
        """(instructions, root) of the computation a fusion calls, nested fusions as they are; ([], None)
        for anything else."""
        comp = self.computations.get(instr.calls or "", {})
        return list(comp.values()), comp.get(self.roots.get(instr.calls or "", ""))
