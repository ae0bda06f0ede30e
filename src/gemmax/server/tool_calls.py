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

`OutputParser.update(ids)` re-reads a choice's whole token list each time (outputs are short next to
the cost of a decode step) and returns what is new since the last call: reasoning text, content
text, and tool calls once each is complete (name and JSON arguments in one delta, which is how
vLLM's parsers send a call whose arguments arrive together). Its final state is the non-streamed
message, so streamed and non-streamed answers agree.
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
    """`{k:<|"|>v<|"|>,n:5}` -> '{"k": "v", "n": 5}' (raises ValueError when it is not that shape)."""
    parts = args.split(G4_QUOTE)
    if len(parts) % 2 == 0:
        raise ValueError("unbalanced string delimiters")
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append(json.dumps(part))
        else:
            out.append(re.sub(r'([{,]\s*)([A-Za-z_][\w\-]*)(\s*):', r'\1"\2"\3:', part))
    return json.dumps(json.loads("".join(out)), ensure_ascii=False)


def _call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def parse_gemma3(text: str) -> list[dict[str, Any]] | None:
    """The calls in a Gemma 3 answer (a JSON call or list of calls, in a code fence or not, or a
    pythonic list `[f(a=1)]`); None when the answer is not a call."""
    body = text.strip()
    fence = re.fullmatch(r"```(?:json|python|tool_code)?\s*(.*?)\s*```", body, re.S)
    if fence:
        body = fence.group(1)
    try:
        value = json.loads(body)
    except ValueError:
        return _parse_pythonic(body)
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in items):
        return None
    return [_call(c["name"], c.get("arguments", c.get("parameters", {}))) for c in items]


def _parse_pythonic(body: str) -> list[dict[str, Any]] | None:
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
        calls.append(_call(node.func.id, args))
    return calls or None


class OutputParser:
    """Reasoning / content / tool calls of one choice, from its token ids (see the module docstring)."""

    def __init__(self, tokenizer, *, tools: bool, reasoning: bool, skip_special_tokens: bool = True):
        self.tok, self.tools, self.reasoning = tokenizer, tools, reasoning
        self.fmt = call_format(tokenizer)
        self.skip = skip_special_tokens
        ids = lambda names: {tokenizer.token_to_id(n) for n in names} - {None}  # noqa: E731
        self.markers = ids((G4_CALL_OPEN, G4_CALL_CLOSE, CHANNEL_OPEN, CHANNEL_CLOSE))
        self.sent = {"reasoning": "", "content": ""}
        self.calls_sent = 0
        self.reasoning_text, self.content, self.calls = "", "", []

    def _split(self, ids: list[int], final: bool) -> None:
        """reasoning_text, content and complete calls of the ids so far."""
        tok = self.tok
        full = tok.decode(ids, skip_special_tokens=False)
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
            pieces = []
            position = 0
            for m in re.finditer(re.escape(G4_CALL_OPEN) + r"call:([\w.\-]+)(\{.*?\})" + re.escape(G4_CALL_CLOSE), rest, re.S):
                pieces.append(rest[position : m.start()])
                try:
                    args = _gemma4_json(m.group(2))
                except ValueError:
                    args = m.group(2)
                calls.append((m.group(1), args))
                position = m.end()
            tail = rest[position:]
            if G4_CALL_OPEN in tail:  # a call still being written: hold it back
                tail = tail[: tail.index(G4_CALL_OPEN)] if not final else tail
            rest = "".join(pieces) + tail
        if self.skip:
            for marker in (CHANNEL_OPEN, CHANNEL_CLOSE, G4_CALL_OPEN, G4_CALL_CLOSE):
                rest = rest.replace(marker, "")
            rest = _strip_specials(rest, tok)
        if self.tools and self.fmt == "gemma3":
            stripped = rest.lstrip()
            if final:
                parsed = parse_gemma3(rest)
                if parsed is not None:
                    self.calls = [(c["function"]["name"], c["function"]["arguments"]) for c in parsed]
                    self.reasoning_text, self.content = reasoning, ""
                    return
            elif stripped.startswith(("[", "{", "```")) or "```".startswith(stripped):
                rest = ""  # maybe a call: nothing goes out until the answer is complete
        self.reasoning_text, self.content = reasoning, rest
        if calls or self.fmt == "gemma4":
            self.calls = calls

    def update(self, ids: list[int], final: bool = False) -> dict[str, Any]:
        """What is new since the last call: {"reasoning_content": str, "content": str,
        "tool_calls": [...]} (only the keys with something new)."""
        self._split(ids, final)
        delta: dict[str, Any] = {}
        for key, text in (("reasoning", self.reasoning_text), ("content", self.content)):
            if not final:
                text = text.rstrip("\ufffd")  # a character whose bytes have not all arrived
            sent = self.sent[key]
            if len(text) > len(sent) and text.startswith(sent):
                delta["reasoning_content" if key == "reasoning" else "content"] = text[len(sent):]
                self.sent[key] = text
        new = self.calls[self.calls_sent:]
        if new:
            delta["tool_calls"] = [
                {"index": self.calls_sent + i, **_call(name, args)} for i, (name, args) in enumerate(new)]
            self.calls_sent = len(self.calls)
        return delta

    def message(self) -> dict[str, Any]:
        """The non-streamed assistant message (after `update(ids, final=True)`)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content if self.content or not self.calls else None}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning_text or None
        if self.tools:
            msg["tool_calls"] = [_call(name, args) for name, args in self.calls]
        return msg


def _strip_specials(text: str, tokenizer) -> str:
    specials = getattr(tokenizer, "_special_strings", None)
    if specials is None:
        added = tokenizer.backend.get_added_tokens_decoder()
        specials = sorted((t.content for t in added.values() if t.special), key=len, reverse=True)
        tokenizer._special_strings = specials
    for s in specials:
        text = text.replace(s, "")
    return text
