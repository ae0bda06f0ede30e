"""Constrained decoding in the real engine on the built-in model (Gemma 3 270M, a base model: the
constraint does the work). One engine for the module; every batch goes through it at once.

- 50 generated JSON schemas (nested objects, arrays, enums, bounded numbers, required fields) at
  temperature 0.7, submitted at once with a free row (greedy and sampled in turn) after every 7, so
  the 8 slots mix constrained and free rows: each constrained output parses and validates with
  `jsonschema`; each free row gives exactly the tokens it gives alone.

The machine these ran on is shared (2 cores, load 9-15 while they ran): the heavy tests carry a
longer timeout than the suite's 600 s.
- 100 sampled outputs under a regex, 100 under a choice list, 24 under a small arithmetic grammar
  (checked with Python's own parser).
- A constraint the model cannot finish within max_tokens ends with "length".
- Malformed constraints are refused by validate_request.
- Prefix caching over the wire (the engine keeps 64 MiB of prompt KV): a second chat turn and a
  repeated completions prompt reuse cached blocks, say so in usage and /metrics, and answer exactly
  as the same request prefilled from scratch (its own cache_salt).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import random
import re

import jsonschema
import pytest

from arrival_watch import ArrivalWatch
from gemmax.engine.api import Constraint, GenerationRequest, InvalidRequest, SamplingParams, validate_request
from gemmax.engine.engine import BatchEngine
from gemmax.engine.loading import load_model

PROMPT = "Here is the record as JSON:\n"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    loaded = load_model(None)  # the serve default: int8 linear layers and LM head
    eng = BatchEngine(loaded, max_model_len=512, max_batch=8, buckets=(64,), steps_per_dispatch=4,
                      compile_cache_dir=str(tmp_path_factory.mktemp("xla")), prefix_cache_bytes=64 << 20, warm_up=False)
    # Full-batch decode steps only (no smaller groups): a quarter of the compiled decode shapes, free
    # and masked. Free rows are still compared alone (7 idle neighbours) against constrained neighbours;
    # the masked small-group step runs in tests/test_tool_calls_thinking.py and the benchmark.
    eng.shapes = dataclasses.replace(eng.shapes, decode_groups=(8,))
    eng.start()
    assert eng.wait_ready(600)
    yield eng, loaded.tokenizer
    eng.shutdown(drain_timeout=5)


def _schema(rng: random.Random, depth: int = 0) -> dict:
    """A random JSON schema: objects of 1-3 properties (up to two levels deep), arrays of 1-3 items,
    enums, integers and numbers with bounds, short strings; a random non-empty required set."""
    kinds = ["integer", "number", "enum", "string", "boolean", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds) if depth else "object"
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        low = rng.randint(-10, 10)  # multipleOf: without it a base model may write digits until max_tokens
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 20), "multipleOf": 0.25}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cat", "dog", "yes", "no", "alpha", "beta"], rng.randint(2, 4))}
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(3, 10)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        item = rng.choice([{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["a", "b", "c"]}, {"type": "boolean"}])
        return {"type": "array", "items": item, "minItems": 1, "maxItems": rng.randint(1, 3)}
    names = rng.sample(["id", "name", "size", "color", "price", "tags", "meta", "ok", "count", "level"], rng.randint(1, 3))
    props = {n: _schema(rng, depth + 1) for n in names}
    return {"type": "object", "properties": props, "required": rng.sample(names, rng.randint(1, len(names))),
            "additionalProperties": False}


def _alone(eng, request):
    """The tokens a request gives with nothing else running."""
    return eng.submit(request).wait().token_ids


@pytest.mark.timeout(1800)
def test_fifty_json_schemas_validate_and_free_rows_are_untouched(engine):
    eng, tok = engine
    prompt = tuple(tok.encode(PROMPT))
    rng = random.Random(20)
    schemas = [_schema(rng) for _ in range(50)]
    for s in schemas:
        jsonschema.Draft202012Validator.check_schema(s)
    # All at once, a free row (greedy or sampled, in turn) after every 7 constrained ones: the engine
    # keeps its 8 slots full, so each free row decodes beside 7 constrained rows, and no batch waits
    # for its slowest schema before the next starts.
    requests = []
    for start in range(0, len(schemas), 7):
        requests += [(s, GenerationRequest(prompt, 120, SamplingParams(temperature=0.7, seed=start + j),
                                           constraint=Constraint("json_schema", json.dumps(s))))
                     for j, s in enumerate(schemas[start : start + 7])]
        requests.append((None, GenerationRequest(prompt, 12, SamplingParams(temperature=0.7 * ((start // 7) % 2),
                                                                            seed=start))))
    handles = [eng.submit(r) for _, r in requests]
    results = [h.wait() for h in handles]
    seen, free = 0, []
    for (schema, request), result in zip(requests, results, strict=True):
        if schema is None:
            assert result.finish_reason == "length"
            free.append((request, result.token_ids))
            continue
        text = tok.decode(result.token_ids)
        assert result.finish_reason == "stop", (result.finish_reason, text, schema)
        jsonschema.validate(json.loads(text), schema)
        seen += 1
    assert seen == 50 and len(free) == 8
    for request, tokens in free:
        assert tokens == _alone(eng, request)


def _many(eng, prompt, constraint, n, max_tokens):
    handles = [eng.submit(GenerationRequest(prompt, max_tokens, SamplingParams(temperature=1.0, seed=i),
                                            constraint=constraint)) for i in range(n)]
    return [h.wait() for h in handles]


@pytest.mark.timeout(1200)
def test_regex_and_choice_hold_on_a_hundred_samples(engine):
    eng, tok = engine
    prompt = tuple(tok.encode("Code: "))
    pattern = r"[A-Z][a-z]{1,4}-[0-9]{2,3}"
    results = _many(eng, prompt, Constraint("regex", pattern), 100, 16)
    texts = [tok.decode(r.token_ids) for r in results]
    assert all(r.finish_reason == "stop" for r in results), [r.finish_reason for r in results]
    assert all(re.fullmatch(pattern, t) for t in texts), texts
    assert len(set(texts)) > 10  # sampled, not one answer repeated

    choices = ["red", "green", "blue", "a very long colour name"]
    results = _many(eng, tuple(tok.encode("My favourite colour is")), Constraint("choice", json.dumps(choices)), 100, 16)
    texts = [tok.decode(r.token_ids) for r in results]
    assert all(r.finish_reason == "stop" for r in results)
    assert set(texts) <= set(choices) and len(set(texts)) > 1, texts


ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)?
term: factor (("*" | "/") factor)?
factor: NUMBER | "(" NUMBER OP NUMBER ")"
OP: "+" | "-" | "*" | "/"
NUMBER: /[1-9][0-9]{0,2}/
"""  # a finite language: a base model never chooses to stop an open-ended one within max_tokens


def _is_arithmetic(node) -> bool:
    if isinstance(node, ast.Expression):
        return _is_arithmetic(node.body)
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div) and _is_arithmetic(node.left) and _is_arithmetic(node.right)
    return isinstance(node, ast.Constant) and type(node.value) is int


def test_arithmetic_grammar(engine):
    eng, tok = engine
    results = _many(eng, tuple(tok.encode("Compute: ")), Constraint("grammar", ARITHMETIC), 24, 24)
    done = [tok.decode(r.token_ids) for r in results if r.finish_reason == "stop"]
    assert len(done) == 24, [(r.finish_reason, tok.decode(r.token_ids)) for r in results]
    for text in done:
        assert re.fullmatch(r"[0-9+\-*/()]+", text), text  # the grammar has no blanks
        assert _is_arithmetic(ast.parse(text, mode="eval")), text
    # A grammar too long for max_tokens: "length", never "stop" with a partial answer.
    long = Constraint("regex", "[a-z]{40}")
    result = eng.submit(GenerationRequest(tuple(tok.encode("x")), 5, constraint=long)).wait()
    assert result.finish_reason == "length" and len(result.token_ids) == 5


@pytest.mark.parametrize("constraint", [
    Constraint("json_schema", '{"type": "frobnicate"}', "response_format"),
    Constraint("json_schema", "{not json", "response_format"),
    Constraint("regex", "[a-z", "structured_outputs.regex"),
    Constraint("grammar", "start: missing_rule", "structured_outputs.grammar"),
])
def test_rejected_constraints_are_invalid_requests(constraint):
    request = GenerationRequest((2, 3), 4, constraint=constraint)
    with pytest.raises(InvalidRequest) as info:
        validate_request(request, max_model_len=64, vocab_size=512)
    assert info.value.param == constraint.param and "constraint" in info.value.message or "JSON" in info.value.message


# ------------------------------------------------------------------------------------------ the API
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(engine):
    import openai

    from fake_engine import running_server
    from gemmax.server.app import ServerSettings, create_app

    eng, tok = engine
    with running_server(create_app(eng, tok, ServerSettings(served_model_name="builtin", model_root="/m"))) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def test_tool_round_trip_named_and_required(engine, client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="builtin", messages=messages, tools=TOOLS, max_tokens=60, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(call) == 1 and call[0].function.name == "get_weather"
    jsonschema.validate(json.loads(call[0].function.arguments), PARAMS["get_weather"])
    # The call and its result go back through the chat template; the answer is plain content.
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call[0].id, "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(model="builtin", messages=messages, tools=TOOLS, tool_choice="none",
                                       max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    assert r.choices[0].message.tool_calls in (None, []) and r.choices[0].message.content
    prompt = engine[1].decode(r.model_extra["prompt_token_ids"])
    assert '{"temperature": 21}' in prompt and '"name": "get_weather"' in prompt  # the call and its result

    calls, finish = {}, None
    for chunk in client.chat.completions.create(
            model="builtin", messages=[{"role": "user", "content": "Add 2 and 40, and get the weather in Oslo."}],
            tools=TOOLS, tool_choice="required", max_tokens=100, temperature=0.7, seed=1, stream=True):
        for c in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(c.index, {"name": "", "arguments": ""})
            entry["name"] += c.function.name or ""
            entry["arguments"] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and 1 <= len(calls) <= 4
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), PARAMS[entry["name"]])


def test_response_format_and_structured_outputs(client):
    import openai

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "rank"], "additionalProperties": False}
    r = client.chat.completions.create(model="builtin", messages=[{"role": "user", "content": "A city and a rank."}],
                                       max_tokens=40, temperature=0.7, seed=4, response_format={
                                           "type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model="builtin", messages=[{"role": "user", "content": "Any JSON object."}],
                                       max_tokens=60, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason != "stop" or isinstance(json.loads(r.choices[0].message.content), dict)

    text = "".join(c.choices[0].text for c in client.completions.create(
        model="builtin", prompt="Date: ", max_tokens=16, temperature=1.0, seed=2, stream=True,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"}}))
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]", text), text
    r = client.completions.create(model="builtin", prompt="Yes or no?", max_tokens=4,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="builtin", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "bad", "schema": {"type": "frobnicate"}}})
    assert "frobnicate" in str(info.value) and info.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="builtin", prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "[a-"}})
    assert info.value.body["param"] == "structured_outputs.regex"


def test_prefix_cache_over_the_wire(engine, client):
    import httpx

    from fake_engine import read_metric

    url = str(client.base_url).rstrip("/").removesuffix("/v1")
    block = engine[0].prefix_cache.block
    facts = " ".join(f"Fact {i}: {i} squared is {i * i}." for i in range(24))
    turn1 = [{"role": "user", "content": f"Remember these facts. {facts} What is 3 squared?"}]
    first = client.chat.completions.create(model="builtin", messages=turn1, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0 and first.usage.prompt_tokens > 2 * block
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And 5 squared?"}]
    second = client.chat.completions.create(model="builtin", messages=turn2, max_tokens=12, temperature=0)
    fresh = client.chat.completions.create(model="builtin", messages=turn2, max_tokens=12, temperature=0,
                                           extra_body={"cache_salt": "fresh"})
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].message.content == fresh.choices[0].message.content
    cached = second.usage.prompt_tokens_details.cached_tokens
    # the first turn's full blocks (one may end where the reply's text retokenizes differently)
    assert cached % block == 0 and (first.usage.prompt_tokens // block - 1) * block <= cached < first.usage.prompt_tokens

    # token-id prompts: exact block arithmetic; the streamed usage carries it too
    ids = list(httpx.post(f"{url}/tokenize", json={"prompt": facts}).json()["tokens"])[: 3 * block + 5]
    plain = client.completions.create(model="builtin", prompt=ids + [235265], max_tokens=6, temperature=0,
                                      extra_body={"cache_salt": "ids"})
    assert plain.usage.prompt_tokens_details.cached_tokens == 0
    again = list(client.completions.create(model="builtin", prompt=ids + [235265], max_tokens=6, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"cache_salt": "ids"}))
    assert again[-1].usage.prompt_tokens_details.cached_tokens == 3 * block
    assert "".join(c.choices[0].text for c in again if c.choices) == plain.choices[0].text

    assert read_metric(url, "gemmax:prefix_cache_hits_total") >= 2
    assert read_metric(url, "gemmax:prefix_cache_cached_tokens_total") >= cached + 3 * block
    health = httpx.get(f"{url}/health").json()["prefix_cache"]
    assert health["budget_bytes"] == 64 << 20 and 0 < health["used_bytes"] <= health["budget_bytes"]


def test_an_arrival_during_a_constrained_dispatch_waits_only_for_the_step_in_flight(engine, monkeypatch):
    """A constrained dispatch (4 steps here) enqueues no further forward once a queued request could
    take a free slot, as the mask-free one does: a request arriving during the first forward of the
    running request's second dispatch is prefilled right after that step (before: after the
    dispatch's other 3 forwards). Both requests give the tokens they give alone."""
    eng, tok = engine
    late = GenerationRequest((9, 8, 7, 6), 4, ignore_eos=True)
    running = GenerationRequest(tuple(tok.encode("Name: ")), 16, constraint=Constraint("regex", "[a-z ]{100}"))
    alone = (_alone(eng, running), _alone(eng, late))
    watch = ArrivalWatch(eng, monkeypatch, late)
    watch.arm()
    result = eng.submit(running).wait()
    assert eng.steps_per_dispatch == 4 and watch.after_arrival()[0] == "prefill", watch.events
    assert (result.token_ids, watch.handle.wait().token_ids) == alone
