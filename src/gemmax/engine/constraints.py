"""Constrained decoding: a request's constraint as a grammar, and per-step token masks on the host.

A `Constraint` (gemmax.engine.api, duck-typed here: api imports this module) is compiled by llguidance into a matcher over the checkpoint's
tokenizer (`ConstraintCompiler`). Before each sampling step of a constrained row the engine asks its
matcher for the allowed tokens as a packed bitmask, int32 [ceil(V / 32)] (bit j of word i: token
32 i + j), and the jitted sampler sets every other logit to -inf (`sampling.unpack_mask`). After the
step the matcher consumes the sampled token. The checkpoint's eos ids are allowed only when the
grammar accepts, so a constrained request that stops with "stop" is complete; one that runs out of
max_tokens first ends with "length".

Why llguidance rather than xgrammar (measured on this machine with the Gemma 3 tokenizer, 262,144
entries, a nested JSON schema of 4 required fields, docs/structured.md): schema compile 17 ms
(xgrammar 237 ms), per-token mask median 0.04 ms / max 1.3 ms (xgrammar 0.006 / 0.21 ms). Both masks
are two orders of magnitude below a decode step (tens of ms on CPU, ~1-5 ms on a GPU); compile time
is paid per new schema on the request path, where llguidance is 14x faster. llguidance also reads
Lark grammars (and converts GBNF), which the tool-call grammars use.

The masks of a step are filled for all constrained rows in one call (`fill_rows`: llguidance's
executor, the rows in Rust threads without the GIL). The tokenizer carries `SLICES`, llguidance's
mask fast path: the vocabulary is split into slices by regex, and a slice whose every token the
grammar allows at this step is set in bulk instead of walked token by token. llguidance's general
slices are JSON-string runs of 1-10, 1-30 and any length; a string of at most 8 characters (or 7
left of it) takes none of them and walks all 262,144 tokens of Gemma's vocabulary every step.
`SLICES` adds runs of 1 to 8 characters, so a short string's remaining length always has a slice
(the benchmark's schema, 8 rows, replaying the model's own tokens: 24 -> 16 ms a step).
"""

from __future__ import annotations

import collections
import json
import threading

import llguidance
import llguidance.numpy
import numpy as np

_JSON_OPTIONS = {"whitespace_flexible": False}  # one canonical spacing: a base model cannot wander off in blanks
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)
_STRING_CHAR = '[^"\\\\\\x00-\\x1F\\x7F]'  # a JSON string's unescaped character, as llguidance's slices write it
# llguidance's general slices (blanks; string runs of 1-10, 1-30, any) with runs of 1..8 between:
# each token goes to the first slice that matches it, so the runs are walked only past a string's bound.
SLICES = [llguidance.LLTokenizer.general_slices()[0],
          *(f"{_STRING_CHAR}{{1,{n}}}" for n in (1, 2, 3, 4, 5, 6, 7, 8, 10, 30)),
          llguidance.LLTokenizer.general_slices()[-1]]


def grammar_of(constraint) -> str:
    """The llguidance grammar (its JSON form) of a `Constraint`; raises ValueError when the spec is
    not even well-formed (the library's own check is `check`)."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
    if kind == "json_schema":
        try:
            json.loads(spec)
        except ValueError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "grammar":
        lark = llguidance.gbnf_to_lark.gbnf_to_lark(spec) if "::=" in spec else spec
        return llguidance.LLMatcher.grammar_from_lark(lark)
    raise ValueError(f"unknown constraint kind {kind!r}")


def check(constraint) -> str | None:
    """Why llguidance rejects a constraint (validate_request turns it into a 400), or None."""
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_of(constraint))
    except Exception as exc:  # the converters raise on malformed input
        error = str(exc) or type(exc).__name__
    return f"the {constraint.kind} constraint was rejected: {error.strip()}" if error else None


class ConstraintCompiler:
    """Matchers for one tokenizer. Compiled grammars are cached by their text: a new request with a
    schema seen before gets a copy of the compiled matcher (`deep_copy`), not a recompilation."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words per row of the packed mask
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids),
                                                slices=SLICES)
        self._executor = llguidance.LLExecutor()
        self._cache: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, constraint) -> llguidance.LLMatcher:
        grammar = grammar_of(constraint)
        with self._lock:
            compiled = self._cache.get(grammar)
            if compiled is not None:
                self._cache.move_to_end(grammar)
                return compiled.deep_copy()
        compiled = llguidance.LLMatcher(self.tokenizer, grammar)
        if compiled.is_error():
            raise ValueError(f"the {constraint.kind} constraint was rejected: {compiled.get_error()}")
        with self._lock:
            self._cache[grammar] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled.deep_copy()

    def masks(self, rows: int) -> np.ndarray:
        """[rows, words] int32, every token allowed (-1 is all 32 bits set)."""
        return np.full((rows, self.words), -1, np.int32)

    def fill_rows(self, rows: list[tuple[llguidance.LLMatcher, int]], masks: np.ndarray) -> None:
        """For each (matcher, row): row `row` of `masks` [rows, words] := the tokens `matcher` allows
        next; one call for all of them (llguidance's executor threads, the GIL released). No rows
        (every constrained row of the step has ended) leaves `masks` as it is."""
        if rows:  # the executor refuses an empty list
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, masks)
