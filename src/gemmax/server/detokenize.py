"""Token ids -> text deltas that are safe to send: valid UTF-8, and never part of a stop string.

`IncrementalDetokenizer` decodes a window of recent ids and emits the text that window adds beyond
its already-emitted prefix (the offset scheme vLLM and HF's TextStreamer use), holding back text that
later ids could still change, so the concatenated deltas equal `tokenizer.decode(all_ids)`:

- byte-fallback tokens (`<0xC3>`, the Gemma / SentencePiece kind): the `ByteFallback` decoder turns a
  run of consecutive byte tokens into text as a whole (valid UTF-8, or one U+FFFD per byte when the
  run is invalid), so an open run is held until a non-byte token closes it, unless its bytes are
  already invalid whatever follows;
- other decoders (byte-level BPE): a window ending in U+FFFD is an unfinished multi-byte character
  and is held, at most `MAX_HELD_TOKENS` ids (a character is at most 4 bytes: longer, it is junk).

`flush()` releases whatever is held when generation ends.

`StopStringMatcher` sits after it: text that could still be the start of a stop string is held back,
so a stop string never leaks partially; on a match the text before it (plus the stop string itself
with `include_stop_str_in_output`) is the last delta. Given the special tokens' strings (`opaque`: a
parsed chat answer, whose text keeps its markers for the parser while the request skips special
tokens), it matches on the text without them, as the plain path's skipping decode shows it, and
passes them through: a stop string never matches in, or is held back by, a special token.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Sequence

REPLACEMENT = "\ufffd"
MAX_HELD_TOKENS = 8
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenTable:
    """What the detokenizer needs to know about a vocabulary, computed once per tokenizer:
    `byte_ids` {id: byte} of the `<0xHH>` tokens when the decoder is ByteFallback (else empty),
    `special_ids`, which decoding with skip_special_tokens drops (so byte runs join across them),
    `special_strings`, their texts, longest first, and `special_pattern`, a regex of them (None: none)."""

    def __init__(self, tokenizer):
        self.byte_ids: dict[int, int] = {}
        self.special_ids: frozenset[int] = frozenset()
        self.special_strings: tuple[str, ...] = ()
        self.special_pattern: re.Pattern | None = None
        backend = getattr(tokenizer, "backend", None)
        if backend is None:
            return
        specials = {i: tok.content for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        self.special_ids = frozenset(specials)
        self.special_strings = tuple(sorted(set(specials.values()), key=len, reverse=True))
        if self.special_strings:
            self.special_pattern = re.compile("|".join(map(re.escape, self.special_strings)))
        if backend.decoder is not None and "ByteFallback" in json.dumps(json.loads(backend.decoder.__getstate__())):
            self.byte_ids = {i: int(m.group(1), 16) for tok, i in backend.get_vocab(with_added_tokens=False).items()
                             if (m := _BYTE_TOKEN.fullmatch(tok))}


def _invalid_utf8(data: bytes) -> bool:
    """True when no continuation can make `data` valid UTF-8."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
    except UnicodeDecodeError:
        return True
    return False


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, table: TokenTable | None = None):
        self._tokenizer = tokenizer  # gemmax.weights.tokenizer.Tokenizer, or None: token ids only, empty text
        self._skip = skip_special_tokens
        table = table if table is not None else TokenTable(tokenizer)
        self._byte_ids = table.byte_ids
        self._skipped = table.special_ids if skip_special_tokens else frozenset()
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: context for the decode of the next ids
        self._read_offset = 0  # text of ids before this is emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _run_start(self, end: int) -> int:
        """Start of the run of byte-fallback tokens that ends at `end`, skipped special tokens inside
        or after it included (they vanish before decoding, so they do not close a run); == end when
        there is no such run."""
        ids, start = self._ids, end
        while start > 0 and ids[start - 1] in self._skipped:
            start -= 1
        if start == 0 or ids[start - 1] not in self._byte_ids:
            return end
        while start > 0 and (ids[start - 1] in self._byte_ids or ids[start - 1] in self._skipped):
            start -= 1
        while ids[start] in self._skipped:
            start += 1
        return start

    def push(self, token_id: int) -> str:
        """Add one generated id; returns the text that is now final (possibly empty)."""
        self._ids.append(token_id)
        if self._tokenizer is None:
            return ""
        end = len(self._ids)
        run = self._run_start(end)
        invalid_run = run < end and _invalid_utf8(bytes(self._byte_ids[i] for i in self._ids[run:] if i in self._byte_ids))
        if run < end and not invalid_run:
            end = run  # open byte run: the next id may still change its text
        if end <= self._read_offset:
            return ""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset : end])
        if len(text) <= len(prefix):
            return ""  # e.g. only skipped special tokens so far
        # Byte-level decoders: a trailing U+FFFD may be a character still missing bytes.
        unfinished = not self._byte_ids and text.endswith(REPLACEMENT)
        if unfinished and end - self._read_offset < MAX_HELD_TOKENS:
            return ""
        return self._advance(end, text[len(prefix) :])

    def flush(self) -> str:
        """Release held-back text at the end of generation."""
        if self._tokenizer is None or len(self._ids) == self._read_offset:
            return ""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        return self._advance(len(self._ids), text[len(prefix) :])

    def _advance(self, read_to: int, delta: str) -> str:
        # The next window starts at the old read offset, moved back to the start of a byte run that
        # crosses it (a run decodes as a whole, so a window must not start inside one).
        self._prefix_offset = self._run_start(self._read_offset)
        self._read_offset = read_to
        return delta


class StopStringMatcher:
    def __init__(self, stops: Sequence[str], include_stop: bool = False, opaque: re.Pattern | None = None):
        self.stops = tuple(stops)
        self._include = include_stop
        self._held = ""
        self._opaque = opaque  # the special tokens' strings (`TokenTable.special_pattern`): matched around, never in

    def _visible(self, text: str) -> tuple[str, list[int]]:
        """`text` without the opaque strings, and where each of its characters is in `text`."""
        if self._opaque is None:
            return text, list(range(len(text)))
        kept, at = [], 0
        for m in self._opaque.finditer(text):
            kept.extend(range(at, m.start()))
            at = m.end()
        kept.extend(range(at, len(text)))
        return "".join(text[i] for i in kept), kept

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text safe to emit, the stop string matched or None). After a match, stop feeding. What is
        held, or cut, starts at a visible character: opaque strings before it are emitted (whatever
        the deltas' grouping), and on a match with include_stop the text ends with the stop string's
        last character."""
        if not self.stops:
            return text, None
        buf = self._held + text
        visible, where = self._visible(buf)
        hits = [(visible.find(s), -len(s), s) for s in self.stops if s in visible]
        if hits:
            at, _, stop = min(hits)  # earliest match; the longest stop string on a tie
            self._held = ""
            return buf[: where[at + len(stop) - 1] + 1 if self._include else where[at]], stop
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(visible) + 1)) if visible.endswith(s[:k])),
                   default=0)
        if not keep:
            self._held = ""
            return buf, None
        cut = where[len(visible) - keep]
        self._held = buf[cut:]
        return buf[:cut], None

    @property
    def held(self) -> bool:
        return bool(self._held)

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
