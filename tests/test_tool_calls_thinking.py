"""Gemma 4 thinking and forced tool calls on a real engine: a tiny random Gemma 4 checkpoint whose
tokenizer has the `<|channel>` / `<channel|>` and `<|tool_call>` / `<tool_call|>` / `<|"|>` specials.

- Thinking, forced by a grammar to answer `<|channel>thought\\n...<channel|>...`: `reasoning_content`
  and `content` must be exactly the decoded token ids inside and after the channel, streamed
  (reassembled by the openai client) and not; `enable_thinking` reaches the chat template.
- `tool_choice` "required" and a named function, sampled at temperature 1 (a random model: the
  grammar does all the work): every call parses and its arguments validate with `jsonschema`
  against the function's `parameters`."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from fake_engine import running_server
from gemmax.engine.engine import BatchEngine
from gemmax.engine.loading import load_model
from gemmax.server.app import ServerSettings, create_app
from tiny_checkpoint import CHAT_TEMPLATE, VOCAB_SIZE, write_tiny_checkpoint

OPEN_ID, CLOSE_ID = VOCAB_SIZE - 2, VOCAB_SIZE - 1
# The checkpoint's last learned tokens, turned into specials (the model's 512-entry vocabulary covers them).
SPECIAL_IDS = {VOCAB_SIZE - 5: "<|tool_call>", VOCAB_SIZE - 4: "<tool_call|>", VOCAB_SIZE - 3: '<|"|>',
               OPEN_ID: "<|channel>", CLOSE_ID: "<channel|>"}
TEMPLATE = "{% if enable_thinking %}{{ '<|turn>system\\nthink<turn|>\\n' }}{% endif %}" + CHAT_TEMPLATE.replace(
    "{{ bos_token }}", "")
TEMPLATE = "{{ bos_token }}" + TEMPLATE


def special_checkpoint(directory):
    """The tiny checkpoint with its last learned tokens turned into the channel and tool-call specials
    (`SPECIAL_IDS`), and a template that reads `enable_thinking`."""
    write_tiny_checkpoint(directory)
    path = directory / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    removed = {by_id[i] for i in SPECIAL_IDS}
    for i, name in SPECIAL_IDS.items():
        del vocab[by_id[i]]
        vocab[name] = i
        data["added_tokens"].append({"id": i, "content": name, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    pair = lambda m: m.split(" ") if isinstance(m, str) else m  # noqa: E731
    data["model"]["merges"] = [m for m in data["model"]["merges"] if "".join(pair(m)) not in removed]
    path.write_text(json.dumps(data))
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = special_checkpoint(tmp_path_factory.mktemp("think") / "ckpt")
    loaded = load_model(str(directory), "float32")
    assert loaded.tokenizer.token_to_id("<|channel>") == OPEN_ID
    engine = BatchEngine(loaded, max_model_len=256, max_batch=2, buckets=(32,), steps_per_dispatch=2, warm_up=False).start()
    with running_server(create_app(engine, loaded.tokenizer, ServerSettings(served_model_name="tiny",
                                                                            model_root=str(directory)))) as url:
        assert engine.wait_ready(300)
        yield url, loaded.tokenizer
    engine.shutdown(drain_timeout=5)


FORCE = f'start: <[{OPEN_ID}]> "thought\\n" /[a-z ]{{3,24}}/ <[{CLOSE_ID}]> /[A-Za-z ]{{3,24}}/'


def test_reasoning_and_content_split_exactly(server):
    url, tok = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=80, temperature=0.8,
                  seed=3, extra_body={"structured_outputs": {"grammar": FORCE}, "return_token_ids": True,
                                      "chat_template_kwargs": {"enable_thinking": True}})
    r = client.chat.completions.create(**kwargs)
    ids = r.choices[0].model_extra["token_ids"]
    assert r.choices[0].finish_reason == "stop"
    assert ids[0] == OPEN_ID and ids.count(CLOSE_ID) == 1
    close = ids.index(CLOSE_ID)
    thought = tok.decode(ids[1:close])
    assert thought.startswith("thought\n")
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == thought.removeprefix("thought\n")
    assert message.content == tok.decode(ids[close + 1:])
    assert message.content and message.model_extra["reasoning_content"]
    assert "think" in tok.decode(r.model_extra["prompt_token_ids"])  # enable_thinking reached the template

    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            reasoning += chunk.choices[0].delta.model_extra.get("reasoning_content") or ""
            content += chunk.choices[0].delta.content or ""
    assert (reasoning, content) == (message.model_extra["reasoning_content"], message.content)
    # Constrained decoding's shapes are not warmed up; /health says which have compiled since.
    constrained = httpx.get(f"{url}/health").json()["constrained_decode"]
    assert constrained["warmed_up"] is False and 0 < constrained["shapes_compiled"] <= constrained["shapes_declared"]


FUNCTIONS = [
    {"name": "book", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 6},
        "nights": {"type": "integer", "minimum": 1, "maximum": 14},
        "room": {"enum": ["single", "double"]},
        "breakfast": {"type": "boolean"},
        "guest": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                                   "age": {"type": "number", "minimum": 0, "maximum": 99}},
                  "required": ["age"]},
        "ratings": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 5}, "maxItems": 3}},
        "required": ["city", "nights", "room"]}},
    {"name": "tag", "parameters": {"type": "object", "properties": {
        "labels": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 2},
        "level": {"type": ["integer", "null"], "minimum": 0, "maximum": 3}}, "required": ["labels"]}},
]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "tag"}}])
def test_forced_gemma4_calls_follow_the_argument_schema(server, tool_choice):
    url, tok = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    schemas = {f["name"]: f["parameters"] for f in FUNCTIONS}
    calls = []
    for k in range(6):  # 12 draws (seeds 0..11), two at a time (the engine's two slots)
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Book it"}], max_tokens=230, temperature=1.0,
            seed=2 * k, n=2, tools=[{"type": "function", "function": f} for f in FUNCTIONS], tool_choice=tool_choice)
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
            calls += choice.message.tool_calls
    for call in calls:
        if isinstance(tool_choice, dict):
            assert call.function.name == "tag"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert len(calls) >= 12 and (isinstance(tool_choice, dict) or {c.function.name for c in calls} == set(schemas))
