"""Tool calls and the thought channel: one parser over a choice's token stream, for streaming and not.

Two call formats, picked from the tokenizer:
- Gemma 4 (its tokenizer has `<|tool_call>`): `<|tool_call>call:NAME{k:<|"|>text<|"|>,n:5}<tool_call|>`,
  keys bare, strings between `<|"|>` delimiters (docs spec section 17); the chat template renders
  the tool declarations and `role: tool` messages itself. The thought channel
  `<|channel>thought\\n...<channel|>` is the reasoning, returned as `reasoning_content`.
- Gemma 3 (no tool tokens): prompt-based. The tools are described in a system text that asks for a
  JSON list `[{"name": ..., "arguments": {...}}]`; a pythonic list `[f(a=1), g()]` is read too.
  Tool results (`role: tool`) are rendered as user turns, since Gemma 3's template knows only
  user and model.

`tool_choice` "required" and a named function are enforced by a grammar (`tool_constraint`), so the
answer always parses; "auto" parses whatever the model wrote and leaves plain text as content.

`OutputParser.update(text)` re-reads a choice's whole released text each time (outputs are short next
to the cost of a decode step) and returns what is new since the last call. That text is the choice's
detokenizer output with special tokens kept (markers included), released as the plain path releases
it: valid UTF-8 only, an open byte-fallback run held back, cut at a stop string and any prefix of one
held back (`gemmax.server.detokenize`), so it only ever grows and never holds a stop string's text.
What is new is reasoning text, content
text, and tool calls as vLLM streams them: a call's name (with its id) as soon as it is written,
then its JSON arguments in pieces as they arrive. Both call formats are read left to right so that
a call's arguments only ever grow (Gemma 4's are translated to JSON character by character;
Gemma 3's JSON arguments are the model's own text), and the final state is the non-streamed
message: the pieces a client joins are exactly its arguments.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from typing import Any

from gemmax.engine.api import Constraint

G4_CALL_OPEN, G4_CALL_CLOSE, G4_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"
MAX_PARALLEL = 4  # calls a grammar-enforced answer may hold


def call_format(tokenizer) -> str:
    """"gemma4" when the tokenizer has the tool-call tokens, else "gemma3" (prompt-based JSON)."""
    return "gemma4" if tokenizer is not None and tokenizer.token_to_id(G4_CALL_OPEN) is not None else "gemma3"


def has_thought_channel(tokenizer) -> bool:
    return tokenizer is not None and tokenizer.token_to_id(CHANNEL_OPEN) is not None


def _functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t["function"] for t in tools if t.get("type", "function") == "function" and "function" in t]


def gemma3_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Gemma 3's template knows user and model turns only: the tool list goes into a leading system
    text (the template folds it into the first user turn), assistant tool calls are written back as
    the JSON the model produced, and tool results become user turns."""
    out = []
    for m in messages:
        if m.get("role") == "tool":
            out.append({"role": "user", "content": f"Tool result ({m.get('name') or m.get('tool_call_id', 'tool')}): "
                                                   f"{m.get('content') or ''}"})
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"].get("arguments") or "{}")}
                     for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": json.dumps(calls)})
        else:
            out.append(m)
    if tools:
        spec = json.dumps(_functions(tools))
        text = ("You can call these functions:\n" + spec + "\nTo call functions, answer with only a JSON list "
                'like [{"name": "function_name", "arguments": {"arg": "value"}}]; otherwise answer normally.')
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def tool_constraint(tools: list[dict[str, Any]], tool_choice: Any, fmt: str, tokenizer) -> Constraint | None:
    """The grammar that forces a call: for "required" one to MAX_PARALLEL calls of any tool, for a
    named function exactly one call of it; None for "auto" / "none"."""
    functions = _functions(tools)
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        functions, most = [f for f in functions if f["name"] == name], 1
    elif tool_choice == "required":
        most = MAX_PARALLEL
    else:
        return None
    if fmt == "gemma4":
        return Constraint("grammar", _gemma4_grammar(functions, most, tokenizer), "tool_choice")
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1,
              "maxItems": most}
    return Constraint("json_schema", json.dumps(schema), "tool_choice")


def _gemma4_grammar(functions: list[dict[str, Any]], most: int, tokenizer) -> str:
    """Lark (llguidance) for 1..most Gemma 4 calls, the special tokens by id (`<[id]>`): one rule per
    function, its name, then its arguments under its `parameters` schema (`_Gemma4Arguments`)."""
    open_, close, quote = (f"<[{tokenizer.token_to_id(t)}]>" for t in (G4_CALL_OPEN, G4_CALL_CLOSE, G4_QUOTE))
    arguments = _Gemma4Arguments(quote)
    calls = [f'{open_} {json.dumps("call:" + f["name"])} {arguments.object(f.get("parameters") or {}, root=True)} {close}'
             for f in functions]
    repeat = " ".join(["call"] + ["call?"] * (most - 1))
    return "\n".join([f"start: {repeat}", "call: " + " | ".join(f"({c})" for c in calls), *arguments.rules, f"""
obj: "{{" (pair ("," pair)*)? "}}"
pair: KEY ":" value
value: string | NUMBER | "true" | "false" | "null" | obj | "[" (value ("," value)*)? "]"
string: {quote} TEXT? {quote}
KEY: /[A-Za-z_][A-Za-z0-9_]*/
NUMBER: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?/
TEXT: /[^<]+/
"""])


_JSON_SCALAR_KEYS = ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


class _Gemma4Arguments:
    """Lark rules for Gemma 4 argument values under a JSON schema, as far as the syntax goes:
    objects `{key:value,...}` with the schema's keys in its order (required ones always, the others
    optional; no other keys), strings `<|"|>text<|"|>` (enum and const as literals, min/maxLength,
    a `pattern` as the whole text), numbers, integers and booleans through llguidance's own JSON
    rules (`%json`: bounds and multipleOf hold; the Gemma 4 and JSON spellings are the same), arrays
    with min/maxItems, anyOf / oneOf, type lists and local `$ref`s. A value the schema leaves open
    (no type, or a keyword not listed) is any Gemma 4 value (`value`). String text never holds `<`,
    so no text can be read as a delimiter."""

    def __init__(self, quote: str):
        self.quote = quote
        self.rules: list[str] = []
        self.root: dict[str, Any] = {}
        self.refs: dict[str, str] = {}

    def _rule(self, body: str, name: str | None = None) -> str:
        name = name or f"arg{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def value(self, schema: Any) -> str:
        """The name of a rule (or a literal) for one value under `schema`."""
        if not isinstance(schema, dict):
            return "value"
        if "$ref" in schema:
            return self._ref(schema["$ref"])
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            literals = [self._literal(v) for v in values]
            return "value" if None in literals else self._rule(" | ".join(literals))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                rest = {k: v for k, v in schema.items() if k != key}
                return self._rule(" | ".join(self.value({**rest, **sub}) for sub in schema[key]))
        kind = schema.get("type")
        if isinstance(kind, list):
            return self._rule(" | ".join(self.value({**schema, "type": t}) for t in kind))
        if kind == "object" or (kind is None and "properties" in schema):
            return self.object(schema)
        if kind == "array":
            return self._array(schema)
        if kind == "string":
            return self._string(schema)
        if kind in ("integer", "number", "boolean", "null"):
            subset = {k: schema[k] for k in _JSON_SCALAR_KEYS if k in schema}
            return self._rule("%json " + json.dumps({**subset, "x-guidance": {"whitespace_flexible": False}}))
        return "value"

    def object(self, schema: dict[str, Any], root: bool = False) -> str:
        if root:
            self.root = schema
        props = schema.get("properties") or {}
        if not props:
            return '"{" "}"' if schema.get("additionalProperties") is False else "obj"
        required = set(schema.get("required") or ())
        items = [(f"{json.dumps(key + ':')} {self.value(sub)}", key in required) for key, sub in props.items()]
        # The first key written is any up to the first required one; each later one follows a comma.
        firsts = []
        for k, (item, needed) in enumerate(items):
            rest = " ".join(f'("," {later})' + ("" if later_needed else "?") for later, later_needed in items[k + 1:])
            firsts.append(f"({item} {rest})")
            if needed:
                break
        body = " | ".join(firsts)
        return self._rule(f'"{{" ({body}){"" if required & props.keys() else "?"} "}}"')

    def _array(self, schema: dict[str, Any]) -> str:
        low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
        if high == 0:
            return self._rule('"[" "]"')
        item = self.value(schema.get("items"))
        more = f'("," {item}){{{max(low - 1, 0)},{"" if high is None else int(high) - 1}}}'
        return self._rule(f'"[" ({item} {more}){"?" if low == 0 else ""} "]"')

    def _string(self, schema: dict[str, Any]) -> str:
        if "pattern" in schema:
            text = "/" + schema["pattern"].removeprefix("^").removesuffix("$").replace("/", "\\/") + "/"
            return self._rule(f"{self.quote} {text} {self.quote}")
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
        if high == 0:
            return self._rule(f"{self.quote} {self.quote}")
        text = f"/[^<]{{{max(low, 1)},{'' if high is None else int(high)}}}/"
        return self._rule(f"{self.quote} {text}{'?' if low == 0 else ''} {self.quote}")

    def _literal(self, value: Any) -> str | None:
        """A Lark literal for one enum value (None for objects and arrays: left open)."""
        if isinstance(value, str):
            return f"{self.quote} {json.dumps(value)} {self.quote}" if value else f"{self.quote} {self.quote}"
        if isinstance(value, (bool, int, float)) or value is None:
            return json.dumps(json.dumps(value))
        return None

    def _ref(self, ref: str) -> str:
        """A local `#/...` reference, one rule per target (so recursive schemas stay finite)."""
        if ref in self.refs:
            return self.refs[ref]
        target: Any = self.root
        for part in ref.removeprefix("#/").split("/") if ref.startswith("#/") else ():
            target = target.get(part, {}) if isinstance(target, dict) else {}
        if not ref.startswith("#/") or not isinstance(target, dict):
            return "value"
        name = self.refs[ref] = f"ref{len(self.refs)}"
        self._rule(self.value(target), name)
        return name


def _gemma4_json(args: str) -> str:
    """Gemma 4 arguments `{k:<|"|>v<|"|>,n:5}` (or the part of them written so far) -> JSON text
    '{"k": "v", "n": 5}', read left to right: the text of a prefix is a prefix of the whole's text,
    so streamed pieces add up to the final arguments. Keys are bare, strings raw between `<|"|>`;
    blanks outside strings are dropped; numbers and literals pass as written (what the forced
    grammar allows is JSON)."""
    out: list[str] = []
    containers: list[str] = []  # "{" / "[" open around the current position
    expect_key = in_key = False
    parts = args.split(G4_QUOTE)
    for i, part in enumerate(parts):
        if i % 2:  # inside a string: opened by the quote before it, closed if a quote follows
            out.append('"' + json.dumps(part, ensure_ascii=False)[1:-1] + ('"' if i + 1 < len(parts) else ""))
            continue
        for ch in part:
            if in_key:
                if ch == ":":
                    out.append('": ')
                    in_key = False
                else:
                    out.append(json.dumps(ch, ensure_ascii=False)[1:-1])
            elif ch in " \t\r\n":
                continue
            elif ch in "{[":
                containers.append(ch)
                expect_key = ch == "{"
                out.append(ch)
            elif ch in "}]":
                containers = containers[:-1]
                expect_key = False
                out.append(ch)
            elif ch == ",":
                expect_key = containers[-1:] == ["{"]
                out.append(", ")
            elif expect_key:
                out.append('"' + json.dumps(ch, ensure_ascii=False)[1:-1])
                expect_key, in_key = False, True
            else:
                out.append(ch)
    return "".join(out)


_JSON = json.JSONDecoder()
_BLANKS = " \t\r\n"


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _BLANKS:
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """Where the JSON value at text[i] ends, or None while it is not complete in `text` (a number
    or literal that reaches the end of the text may still go on)."""
    try:
        _, end = _JSON.raw_decode(text, i)
    except ValueError:
        return None
    return None if end == len(text) and text[i] not in '{["' else end


def _json_call(text: str, i: int) -> tuple[str | None, str | None, int | None]:
    """The call object at text[i] == "{" as far as written: (name once its string is complete,
    the raw text of "arguments" / "parameters" so far, the object's end or None)."""
    name = arguments = None
    j = _skip(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            return name, arguments, j + 1
        key_end = _value_end(text, j)
        if key_end is None or text[j] != '"':
            break
        key = json.loads(text[j:key_end])
        j = _skip(text, key_end)
        if j >= len(text) or text[j] != ":":
            break
        j = _skip(text, j + 1)
        end = _value_end(text, j)
        if key in ("arguments", "parameters"):
            arguments = text[j:end] if end is not None else text[j:].rstrip(_BLANKS)
        elif key == "name" and end is not None:
            value = json.loads(text[j:end])
            name = value if isinstance(value, str) else None
        if end is None:
            break
        j = _skip(text, end)
        if j < len(text) and text[j] == ",":
            j = _skip(text, j + 1)
    return name, arguments, None


def _json_calls(text: str) -> list[tuple[str, str]] | None:
    """The calls of a Gemma 3 JSON answer as far as written, `[{"name": ..., "arguments": {...}}, ...]`
    or one such object, in a code fence or not: [(name, raw arguments text so far)] for each call
    whose name is complete (arguments "{}" when a complete call has none), read left to right so
    that each call's arguments only grow; None when the answer does not start like that. Whatever
    follows the calls is dropped."""
    i = _skip(text, 0)
    fence = re.match(r"```(?:json|tool_code)?[ \t]*\n", text[i:])
    if fence:
        i = _skip(text, i + fence.end())
    if i >= len(text) or text[i] not in "[{":
        return None
    listed = text[i] == "["
    i = _skip(text, i + 1) if listed else i
    calls = []
    while i < len(text) and text[i] == "{":
        name, arguments, end = _json_call(text, i)
        if name is not None:
            calls.append((name, arguments if arguments is not None else ("{}" if end is not None else "")))
        if end is None or not listed:
            break
        i = _skip(text, end)
        if i >= len(text) or text[i] != ",":
            break
        i = _skip(text, i + 1)
    return calls or None


def _pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """The calls of a complete pythonic Gemma 3 answer `[f(a=1), g()]` (in a code fence or not), with
    JSON arguments; None when it is not one."""
    body = text.strip()
    fence = re.fullmatch(r"```(?:python|tool_code)?\s*(.*?)\s*```", body, re.S)
    if fence:
        body = fence.group(1)
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    items = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for node in items:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except ValueError:
            return None
        calls.append((node.func.id, json.dumps(args, ensure_ascii=False)))
    return calls or None


class OutputParser:
    """Reasoning / content / tool calls of one choice, from its released text (see the module docstring)."""

    def __init__(self, tokenizer, *, tools: bool, reasoning: bool, skipped: tuple[str, ...] | None = None):
        """`skipped`: the special tokens' strings (`TokenTable.special_strings`) when the request skips
        them, removed from the content with the channel and call markers; None keeps every one."""
        self.tools, self.reasoning = tools, reasoning
        self.fmt = call_format(tokenizer)
        markers = (CHANNEL_OPEN, CHANNEL_CLOSE, G4_CALL_OPEN, G4_CALL_CLOSE)
        self.skipped = () if skipped is None else tuple(sorted({*skipped, *markers}, key=len, reverse=True))
        self.sent = {"reasoning": "", "content": ""}
        self.reasoning_text, self.content = "", ""
        self.calls: list[tuple[str, str]] = []  # (name, JSON arguments so far) per call, in order
        self.call_ids: list[str] = []  # one id per call, given when its name is first seen
        self.arguments_sent: list[int] = []  # characters of each call's arguments sent so far

    def _split(self, full: str, final: bool) -> None:
        """reasoning_text, content and the calls of the released text so far."""
        reasoning, rest = "", full
        if self.reasoning and full.lstrip().startswith(CHANNEL_OPEN):
            body = full.lstrip()[len(CHANNEL_OPEN):]
            if not final and "thought\n".startswith(body):
                body = ""  # the channel's label is still arriving
            body = body[len("thought"):] if body.startswith("thought") else body
            body = body.removeprefix("\n")
            reasoning, _, rest = body.partition(CHANNEL_CLOSE)
            if CHANNEL_CLOSE not in body:
                rest = ""
        calls = []
        if self.tools and self.fmt == "gemma4":
            # Complete calls, and the one being written once its name is (its arguments so far).
            pattern = (re.escape(G4_CALL_OPEN) + r"call:([\w.\-]+)(\{.*?\})" + re.escape(G4_CALL_CLOSE)
                       + "|" + re.escape(G4_CALL_OPEN) + r"call:([\w.\-]+)(\{.*)\Z")
            pieces, position = [], 0
            for m in re.finditer(pattern, rest, re.S):
                pieces.append(rest[position : m.start()])
                calls.append((m.group(1) or m.group(3), _gemma4_json(m.group(2) or m.group(4))))
                position = m.end()
            tail = rest[position:]
            if G4_CALL_OPEN in tail and not final:  # a call whose name is still arriving: held back
                tail = tail[: tail.index(G4_CALL_OPEN)]
            rest = "".join(pieces) + tail
        for special in self.skipped:  # longest first
            rest = rest.replace(special, "")
        if self.tools and self.fmt == "gemma3":
            calls = _json_calls(rest) or (_pythonic_calls(rest) if final else None) or []
            stripped = rest.lstrip()
            if calls or (not final and (stripped.startswith(("[", "{", "```")) or "```".startswith(stripped))):
                rest = ""  # calls, or maybe calls: no content goes out until the answer is complete
        self.reasoning_text, self.content, self.calls = reasoning, rest, calls

    def update(self, text: str, final: bool = False) -> dict[str, Any]:
        """What is new in the choice's released text (special tokens kept) since the last call:
        {"reasoning_content": str, "content": str, "tool_calls": [...]} (only the keys with something
        new). A call's first entry carries its index, id, type and name with the arguments so far;
        later entries only arguments pieces (`{"index", "function": {"arguments"}}`), as vLLM streams
        them."""
        self._split(text, final)
        delta: dict[str, Any] = {}
        for key, part in (("reasoning", self.reasoning_text), ("content", self.content)):
            sent = self.sent[key]
            if len(part) > len(sent) and part.startswith(sent):
                delta["reasoning_content" if key == "reasoning" else "content"] = part[len(sent):]
                self.sent[key] = part
        pieces = []
        for index, (name, arguments) in enumerate(self.calls):
            if index == len(self.call_ids):
                self.call_ids.append(f"call_{uuid.uuid4().hex[:24]}")
                self.arguments_sent.append(len(arguments))
                pieces.append({"index": index, "id": self.call_ids[index], "type": "function",
                               "function": {"name": name, "arguments": arguments}})
            elif len(arguments) > self.arguments_sent[index]:
                pieces.append({"index": index, "function": {"arguments": arguments[self.arguments_sent[index]:]}})
                self.arguments_sent[index] = len(arguments)
        if pieces:
            delta["tool_calls"] = pieces
        return delta

    @property
    def calls_complete(self) -> bool:
        """Whether the answer holds calls and every one is complete (its arguments whole JSON): the
        answer then ends "tool_calls", as vLLM's does when its parser found calls. A call a stop
        string or max_tokens cut is reported as written so far (streamed, its pieces already went
        out), and its answer keeps its own finish reason."""
        if not self.calls:
            return False
        try:
            return all(isinstance(json.loads(arguments), dict) for _, arguments in self.calls)
        except ValueError:
            return False

    def message(self) -> dict[str, Any]:
        """The non-streamed assistant message (after `update(text, final=True)`)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content if self.content or not self.calls else None}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning_text or None
        if self.tools:
            msg["tool_calls"] = [{"id": self.call_ids[i], "type": "function",
                                  "function": {"name": name, "arguments": arguments}}
                                 for i, (name, arguments) in enumerate(self.calls)]
        return msg

