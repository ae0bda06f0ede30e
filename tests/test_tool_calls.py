"""Tool calls and the thought channel through the real app on loopback, read by the official `openai`
client, on scripted model outputs (a FakeEngine that plays a given answer, token by token):

- Gemma 4 format (a tokenizer with `<|tool_call>`, `<tool_call|>`, `<|"|>`, `<|channel>`, `<channel|>`):
  `auto` parses one and two (parallel) calls, with text before them, streamed and not; the thought
  channel is `reasoning_content`.
- Streamed, each call's first delta carries its id and name, then its arguments come in pieces as
  the tokens arrive (as vLLM sends them); the `openai` client's own stream reassembly
  (`chat.completions.stream`) gives exactly the non-streamed message, arguments text included.
- Gemma 3 format (the tiny tokenizer as it is): a JSON list of calls, a pythonic list, and plain text
  that stays content; `role: tool` messages render into the prompt.
- the forced choices' grammars (Gemma 4 and Gemma 3) accept a real call and refuse a wrong name.

The built-in model's named and `required` round trip is in tests/test_structured.py (one engine)."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import openai
import pytest

from fake_engine import FakeEngine, running_server
from gemmax.server.app import ServerSettings, create_app
from gemmax.server.tool_calls import call_format, tool_constraint
from gemmax.weights.tokenizer import load_tokenizer
from tiny_checkpoint import EOS_ID, SPECIALS, TURN_CLOSE_ID, write_tokenizer

G4_SPECIALS = ("<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>")
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                                      "days": {"type": "integer"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}},
]


def gemma4_tokenizer_dir(directory: Path) -> Path:
    """The tiny tokenizer with Gemma 4's tool and channel tokens as specials (ids 512..516)."""
    from tokenizers import AddedToken, Tokenizer

    write_tokenizer(directory)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in G4_SPECIALS])
    tok.save(str(directory / "tokenizer.json"))
    return directory


class ScriptedEngine(FakeEngine):
    """Answers every request with `script` (token ids), then eos."""

    script: list[int] = []

    def _next_token(self, run):
        k = run.position
        run.position += 1
        return self.script[k] if k < len(self.script) else self._eos[0]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{"gemma4": (url, engine, tokenizer), "gemma3": ...} on loopback."""
    out = {}
    for name, directory in (("gemma4", gemma4_tokenizer_dir(tmp_path_factory.mktemp("g4"))),
                            ("gemma3", write_tokenizer(tmp_path_factory.mktemp("g3")))):
        tok = load_tokenizer(directory)
        specials = {tok.token_to_id(s) for s in SPECIALS + G4_SPECIALS} - {None}
        engine = ScriptedEngine(special_ids=specials, eos_token_ids=(EOS_ID, TURN_CLOSE_ID), vocab_size=tok.vocab_size,
                                max_model_len=2048).start()
        out[name] = (create_app(engine, tok, ServerSettings(served_model_name="tiny", model_root="/m")), engine, tok)
    with running_server(out["gemma4"][0]) as url4, running_server(out["gemma3"][0]) as url3:
        yield {"gemma4": (url4, out["gemma4"][1], out["gemma4"][2]), "gemma3": (url3, out["gemma3"][1], out["gemma3"][2])}


def _ask(url, engine, tok, answer: str, stream: bool, **extra):
    engine.script = tok.encode(answer, add_bos=False)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "What is the weather?"}], tools=TOOLS,
                  max_tokens=400, temperature=0, **extra)
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as events:  # the client reassembles the deltas
        chunks = [event.chunk for event in events if event.type == "chunk"]
        final = events.get_final_completion().choices[0]
    pieces: dict[int, list] = {}  # per call index, its delta entries in order
    for chunk in chunks:
        for call in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            pieces.setdefault(call.index, []).append(call)
    return final, pieces


def _calls(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def _same_message(streamed, choice):
    """The client's reassembled stream is the non-streamed choice (ids aside: each answer has its own)."""
    text = lambda m: (m.content or None, (m.model_extra or {}).get("reasoning_content"),  # noqa: E731
                      [(c.type, c.function.name, c.function.arguments) for c in m.tool_calls or ()])
    assert text(streamed.message) == text(choice.message)
    assert streamed.finish_reason == choice.finish_reason
    assert all(c.id for c in streamed.message.tool_calls or ())


def _pieces_as_vllm_sends(pieces, calls):
    """Each call: a first entry with id and name, then argument pieces only; a call whose arguments
    take several tokens gets them in several pieces."""
    assert sorted(pieces) == list(range(len(calls)))
    for index, entries in pieces.items():
        first, *rest = entries
        assert first.id and first.function.name == calls[index][0]
        assert all(e.id is None and not e.function.name for e in rest)
        if len(json.dumps(calls[index][1])) > 12:
            assert len(rest) > 1, [e.function.arguments for e in entries]


G4_ONE = 'Let me look.<|tool_call>call:get_weather{city:<|"|>Paris, "FR"<|"|>,days:3}<tool_call|>'
G4_TWO = ('<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>'
          '<|tool_call>call:add{a:1.5,b:-2}<tool_call|>')
G4_THINK = '<|channel>thought\nThe user wants weather: call the tool.<channel|>' + G4_ONE


@pytest.mark.parametrize("answer, content, reasoning, calls", [
    (G4_ONE, "Let me look.", None, [("get_weather", {"city": 'Paris, "FR"', "days": 3})]),
    (G4_TWO, None, None, [("get_weather", {"city": "Oslo"}), ("add", {"a": 1.5, "b": -2})]),
    (G4_THINK, "Let me look.", "The user wants weather: call the tool.", [("get_weather", {"city": 'Paris, "FR"', "days": 3})]),
    ("It is sunny in Paris.", "It is sunny in Paris.", None, []),
])
def test_gemma4_auto_calls_streamed_and_not(servers, answer, content, reasoning, calls):
    url, engine, tok = servers["gemma4"]
    assert call_format(tok) == "gemma4"
    choice = _ask(url, engine, tok, answer, stream=False)
    message = choice.message
    assert message.content == content
    assert (message.model_extra or {}).get("reasoning_content") == reasoning
    assert _calls(message) == calls
    assert choice.finish_reason == ("tool_calls" if calls else "stop")
    assert len({c.id for c in message.tool_calls or ()}) == len(calls)

    streamed, pieces = _ask(url, engine, tok, answer, stream=True)
    _same_message(streamed, choice)
    _pieces_as_vllm_sends(pieces, calls)


@pytest.mark.parametrize("answer, content, calls", [
    ('[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "add", "arguments": {"a": 2, "b": 3}}]',
     None, [("get_weather", {"city": "Rome"}), ("add", {"a": 2, "b": 3})]),
    ('```json\n{"name": "add", "parameters": {"a": 1, "b": 1}}\n```', None, [("add", {"a": 1, "b": 1})]),
    ('[get_weather(city="Lima", days=2)]', None, [("get_weather", {"city": "Lima", "days": 2})]),
    ("[citation needed] no call here", "[citation needed] no call here", []),
])
def test_gemma3_auto_calls_streamed_and_not(servers, answer, content, calls):
    url, engine, tok = servers["gemma3"]
    assert call_format(tok) == "gemma3"
    choice = _ask(url, engine, tok, answer, stream=False)
    assert choice.message.content == content and _calls(choice.message) == calls
    assert choice.finish_reason == ("tool_calls" if calls else "stop")
    streamed, pieces = _ask(url, engine, tok, answer, stream=True)
    _same_message(streamed, choice)
    if not answer.startswith("[get_weather("):  # a pythonic list is read once complete: one entry per call
        _pieces_as_vllm_sends(pieces, calls)


def test_tool_choice_none_and_tool_messages(servers):
    url, engine, tok = servers["gemma3"]
    choice = _ask(url, engine, tok, '[{"name": "add", "arguments": {"a": 1, "b": 2}}]', stream=False, tool_choice="none")
    assert choice.message.tool_calls is None or choice.message.tool_calls == []
    assert choice.message.content.startswith("[")
    # A full round: the assistant's call and the tool's answer render into the prompt.
    engine.script = tok.encode("It is 3.", add_bos=False)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "add 1 and 2"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == "It is 3."
    prompt = tok.decode(engine.submitted[-1].prompt_ids, skip_special_tokens=False)
    assert '"name": "add"' in prompt and "Tool result (call_1): 3" in prompt and "get_weather" in prompt


@pytest.mark.parametrize("fmt", ["gemma4", "gemma3"])
def test_forced_choice_grammars_accept_calls_and_refuse_other_names(servers, fmt):
    _, _, tok = servers[fmt]
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=[EOS_ID])
    named = tool_constraint(TOOLS, {"type": "function", "function": {"name": "add"}}, fmt, tok)
    required = tool_constraint(TOOLS, "required", fmt, tok)
    if fmt == "gemma4":
        good, other = G4_TWO.split("<tool_call|>")[1] + "<tool_call|>", G4_TWO.split("<tool_call|>")[0] + "<tool_call|>"
        both = G4_TWO
    else:
        good, other = '[{"name":"add","arguments":{"a":1,"b":2}}]', '[{"name":"get_weather","arguments":{"city":"x"}}]'
        both = '[{"name":"get_weather","arguments":{"city":"x"}},{"name":"add","arguments":{"a":1,"b":2}}]'

    def accepts(constraint, text):
        from gemmax.engine.constraints import grammar_of

        matcher = llguidance.LLMatcher(lltok, grammar_of(constraint))
        ids = tok.encode(text, add_bos=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    assert accepts(named, good) and not accepts(named, other)
    assert accepts(required, good) and accepts(required, other) and accepts(required, both)
    assert not accepts(required, "Just text.")
    if fmt == "gemma4":  # the arguments follow each function's parameters schema
        call = lambda body: f"<|tool_call>call:{body}<tool_call|>"  # noqa: E731
        assert accepts(required, call('get_weather{city:<|"|>Oslo<|"|>,days:2}'))
        for wrong in ('add{a:<|"|>1<|"|>,b:2}', "add{a:1}", "add{b:2,a:1}", "add{a:1,b:2,c:3}",
                      'get_weather{city:<|"|>Oslo<|"|>,days:1.5}', "get_weather{days:2}", "get_weather{city:5}"):
            assert not accepts(required, call(wrong)), wrong


def _chat_text(url, engine, tok, script: list[int], **extra):
    """(non-streamed choice, the streamed content deltas joined, the streamed finish chunk's choice) of
    a chat answering `script`, with the parser on (tools, or the gemma4 tokenizer's thought channel)."""
    engine.script = script
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=400, temperature=0, **extra)
    choice = client.chat.completions.create(**kwargs).choices[0]
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert all(c.choices[0].delta.model_dump(exclude_none=True) or c.choices[0].finish_reason for c in chunks[1:])
    return choice, "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0]


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_stop_strings_cut_parsed_content_streamed_and_not(servers, tools):
    """A stop string ends the parsed answer where it starts, as on the plain path (vLLM applies stop
    strings to the text before its reasoning and tool parsers read it): nothing of the stop string
    or of the token it ended in is content; with include_stop_str_in_output the string is kept. Every
    streamed chunk after the first carries something (no empty deltas)."""
    url, engine, tok = servers["gemma4"]
    script = tok.encode("It is sunny in Paris today. Rain later.", add_bos=False)
    extra = {"tools": tools} if tools else {}
    for stop, include, content in ((["is sunny", "rain"], False, "It "), (["Paris t"], False, "It is sunny in "),
                                   (["Paris t"], True, "It is sunny in Paris t")):
        choice, streamed, finish = _chat_text(url, engine, tok, script, stop=stop,
                                              extra_body={"include_stop_str_in_output": include}, **extra)
        assert choice.message.content == streamed == content, (stop, include)
        assert choice.finish_reason == finish.finish_reason == "stop"
        assert choice.model_extra["stop_reason"] == finish.model_extra["stop_reason"] == stop[0]
    # a stop string inside the thought channel ends the reasoning there, with no content
    engine.script = tok.encode("<|channel>thought\nCheck the sky first.<channel|>It is sunny.", add_bos=False)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    message = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=400,
                                             temperature=0, stop=["sky"], **extra).choices[0].message
    assert message.model_extra["reasoning_content"] == "Check the " and not message.content


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_never_match_in_special_tokens(servers, stream):
    """The request skips special tokens (the default), so its stop strings see the answer as the plain
    path's skipping decode shows it: `|`, `<|tool_call>` or `<|channel>` match nothing in a call or a
    thought channel, which parse as without them; `"` matches in the call's text, the content ends
    before the call, and the answer ends "stop" (the call it cut is not complete); a stop string after
    a complete call leaves it "tool_calls", as vLLM reports an answer whose parser found calls."""
    url, engine, tok = servers["gemma4"]
    call = [("get_weather", {"city": 'Paris, "FR"', "days": 3})]
    for stop in (["|"], ["<|tool_call>"], ["<|channel>", "<|\"|>"]):
        choice = _ask(url, engine, tok, G4_ONE, stream=stream, stop=stop)
        choice = choice[0] if stream else choice
        assert (choice.message.content, _calls(choice.message), choice.finish_reason) == ("Let me look.", call, "tool_calls")
    choice = _ask(url, engine, tok, G4_ONE, stream=stream, stop=['"'])
    choice = choice[0] if stream else choice
    assert (choice.message.content, choice.finish_reason) == ("Let me look.", "stop")
    choice = _ask(url, engine, tok, G4_ONE + " Done, more.", stream=stream, stop=["Done"])
    choice = choice[0] if stream else choice
    assert (choice.message.content, _calls(choice.message), choice.finish_reason) == ("Let me look. ", call, "tool_calls")
    think = tok.encode("<|channel>thought\nCheck | the sky.<channel|>It is sunny.", add_bos=False)
    engine.script = think
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    message = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=400,
                                             temperature=0, stop=["ky.<"]).choices[0].message  # across a marker
    assert (message.model_extra["reasoning_content"], message.content) == ("Check | the sky.", "It is sunny.")
    message = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=400,
                                             temperature=0, stop=["|"]).choices[0].message  # the pipe the text holds
    assert message.model_extra["reasoning_content"] == "Check " and not message.content


def test_an_invalid_byte_run_streams_what_the_answer_holds(servers):
    """Parsed chat content streamed token by token joins to the non-streamed content and to the ids'
    decode, also when a byte-fallback run turns invalid part way (`è` then a lone continuation byte:
    the decoder then gives one U+FFFD per byte of the run, so a character streamed from the run's
    first bytes would not be a prefix of the answer any more, and its stream stopped there)."""
    url, engine, tok = servers["gemma4"]
    run = [tok.token_to_id(f"<0x{b:02X}>") for b in (0xC3, 0xA8, 0x80)]
    script = [*tok.encode(" hello", add_bos=False), *run, *tok.encode(" hello world", add_bos=False)]
    for extra in ({}, {"tools": TOOLS}):
        choice, streamed, finish = _chat_text(url, engine, tok, script, **extra)
        assert choice.message.content == streamed == tok.decode(script) == " hello\ufffd\ufffd\ufffd hello world"
        assert choice.finish_reason == finish.finish_reason == "stop"
