"""The OpenAI-compatible API over a fake engine, through the official `openai` client (sync and async)
on a real loopback server. The fake's greedy answer is the prompt's content echoed (specials removed),
so every expected text below can be checked by hand against the chat template."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from fake_engine import fake_server, read_metric

USER = "Hello café €"
# tiny chat template: <bos><|turn>user\n{content}<turn|>\n<|turn>model\n ; the fake echoes it without specials
CHAT_ECHO = f"user\n{USER}\nmodel\n"
MESSAGES = [{"role": "user", "content": USER}]


@pytest.fixture(scope="module")
def server(tokenizer):
    with fake_server(tokenizer, max_model_len=128, max_batch=4, token_delay=0.001) as running:
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def test_chat_greedy(client, tokenizer):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == CHAT_ECHO
    assert choice.finish_reason == "stop"
    assert r.object == "chat.completion" and r.model == "tiny" and r.id.startswith("chatcmpl-")
    prompt_ids = tokenizer.encode_chat(MESSAGES)
    assert tokenizer.decode(prompt_ids, skip_special_tokens=False) == f"<bos><|turn>user\n{USER}<turn|>\n<|turn>model\n"
    usage = r.usage.model_dump()
    assert usage["prompt_tokens"] == len(prompt_ids)
    assert usage["completion_tokens"] == len(tokenizer.encode(CHAT_ECHO, add_bos=False))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    for key in ("decode_tokens_per_second", "time_to_first_token_seconds", "prefill_seconds", "queue_seconds"):
        assert isinstance(usage[key], float) and usage[key] >= 0
    assert usage["prefill_bucket"] == 32 and usage["pad_tokens"] == 32 - len(prompt_ids)  # the fake's buckets
    assert usage["uncompiled_shape"] is False and usage["degenerate"] is False
    assert choice.model_extra["degeneracy"] == {"degenerate": False, "reason": None}


def test_chat_stream(client, tokenizer):
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    first, *middle, finish, usage = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == "u"  # first token
    assert all(c.choices[0].delta.role is None for c in middle)
    deltas = [c.choices[0].delta.content or "" for c in [first, *middle, finish]]
    assert "".join(deltas) == CHAT_ECHO
    assert all(d and "\ufffd" not in d for d in deltas[:-1])  # no empty chunks, no broken characters
    assert any("é" in d for d in deltas) and any("€" in d for d in deltas)
    assert finish.choices[0].finish_reason == "stop"
    assert finish.choices[0].model_extra["degeneracy"] == {"degenerate": False, "reason": None}
    assert usage.choices == [] and usage.usage.completion_tokens == len(tokenizer.encode(CHAT_ECHO, add_bos=False))
    assert usage.usage.model_extra["decode_tokens_per_second"] >= 0


def test_first_chunk_waits_for_the_first_token(tokenizer):
    """The role chunk is not sent ahead of generation: it arrives with the first token."""
    with fake_server(tokenizer, prefill_delay=0.4) as (url, _, _):
        body = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "stream": True, "max_tokens": 3}
        start = time.perf_counter()
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=10) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            waited = time.perf_counter() - start
            rest = [line for line in lines if line]
    assert waited >= 0.4
    assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"] == {"role": "assistant", "content": "u"}
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"


def test_completions_prompt_forms(client, tokenizer):
    ids = tokenizer.encode("ab cd")
    r = client.completions.create(model="tiny", prompt="ab cd", temperature=0, max_tokens=20)
    assert r.choices[0].text == "ab cd" and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(ids)
    r = client.completions.create(model="tiny", prompt=ids, temperature=0, max_tokens=20)
    assert r.choices[0].text == "ab cd"
    r = client.completions.create(model="tiny", prompt=["ab", "xy z"], temperature=0, max_tokens=20, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == ["ab", "ab", "xy z", "xy z"]
    assert r.usage.prompt_tokens == len(tokenizer.encode("ab")) + len(tokenizer.encode("xy z"))
    r = client.completions.create(model="tiny", prompt=[tokenizer.encode("ab"), tokenizer.encode("q")],
                                  temperature=0, max_tokens=20)
    assert [c.text for c in r.choices] == ["ab", "q"]
    r = client.completions.create(model="tiny", prompt="ab", temperature=0, max_tokens=20, echo=True)
    assert r.choices[0].text == "abab"


def test_max_tokens_and_ignore_eos(client):
    r = client.completions.create(model="tiny", prompt="ab", temperature=0, max_tokens=3)
    assert r.choices[0].text == "ab" and r.choices[0].finish_reason == "stop"  # eos after 1 content token
    r = client.completions.create(model="tiny", prompt="ab cd", temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = client.completions.create(model="tiny", prompt="ab", temperature=0, max_tokens=7,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7
    # "ab" is two tokens: eos is skipped after "ab" and "abab"; the first eos with >= 5 tokens ends it
    r = client.completions.create(model="tiny", prompt="ab", temperature=0, max_tokens=9,
                                  extra_body={"min_tokens": 5})
    assert r.usage.prompt_tokens == 3 and r.choices[0].text == "ababab" and r.usage.completion_tokens == 6
    assert r.choices[0].finish_reason == "stop"


def test_seeds_and_n(client, server):
    engine = server[1]
    kwargs = dict(model="tiny", prompt="the quick brown fox jumps", temperature=0.9, max_tokens=8)
    before = len(engine.submitted)
    a = client.completions.create(**kwargs, n=3, seed=11)
    assert [r.sampling.seed for r in engine.submitted[before:]] == [11, 12, 13]  # seed + choice index
    texts = [c.text for c in a.choices]
    assert len(set(texts)) == 3
    b = client.completions.create(**kwargs, n=3, seed=11)
    assert [c.text for c in b.choices] == texts
    c = client.completions.create(**kwargs, n=1, seed=12)
    assert c.choices[0].text == texts[1]
    d = client.completions.create(**kwargs, n=1, seed=99)
    assert d.choices[0].text not in texts

    # the last choice's seed is seed + n - 1: past the int64 range the request is refused for that,
    # naming the seed and n it was given, and nothing is queued
    before = len(engine.submitted)
    top = 2**63 - 1
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**kwargs, n=2, seed=top)
    error = refused.value.body
    assert refused.value.status_code == 400 and error["param"] == "seed"
    assert f"got seed {top} with n 2" in error["message"] and "seed + n - 1" in error["message"]
    assert len(engine.submitted) == before
    e = client.completions.create(**kwargs, n=2, seed=top - 1)  # seeds top - 1 and top: in range
    assert [r.sampling.seed for r in engine.submitted[before:]] == [top - 1, top] and len(e.choices) == 2


def test_n_streaming_chat(client):
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, n=3, stream=True,
                                            stream_options={"include_usage": True})
    texts, finishes, roles = {}, {}, {}
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        roles.setdefault(choice.index, choice.delta.role)
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert texts == {0: CHAT_ECHO, 1: CHAT_ECHO, 2: CHAT_ECHO}
    assert finishes == {0: "stop", 1: "stop", 2: "stop"} and roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert usage.completion_tokens == 3 * (usage.completion_tokens // 3) and usage.completion_tokens > 0


def test_stop_strings(client, server):
    prompt = "say it and then stop here or go on"
    r = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=40, stop=["stop here"])
    choice = r.choices[0]
    assert choice.text == "say it and then " and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == "stop here"
    assert r.usage.completion_tokens < 40
    r = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=40, stop=["then", "it"],
                                  extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == "say it"
    chunks = list(client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=40,
                                            stop="stop here", stream=True))
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == "say it and then "  # so no piece of "stop here" ever went out
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert read_metric(server[0], "gemmax:kv_slots_in_use") == 0  # the stopped request was cancelled


def test_stop_token_ids(client, tokenizer):
    ids = tokenizer.encode("ab cd ef", add_bos=False)
    r = client.completions.create(model="tiny", prompt="ab cd ef", temperature=0, max_tokens=20,
                                  extra_body={"stop_token_ids": [ids[2]], "return_token_ids": True})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == ids[2]
    assert choice.model_extra["token_ids"] == ids[:2]
    assert choice.model_extra["prompt_token_ids"] == tokenizer.encode("ab cd ef")


def test_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=4,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and content[0].token == "u" and content[0].logprob == -0.25
    assert [t.logprob for t in content[0].top_logprobs] == [-0.25, -1.25]
    assert content[0].bytes == list(b"u")
    r = client.completions.create(model="tiny", prompt="ab cd", temperature=0, max_tokens=3, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == [-0.25] * 3 and len(lp.top_logprobs) == 3 and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == r.choices[0].text


def test_completion_offsets_count_token_strings_and_top_logprobs_hold_the_chosen_token(client, tokenizer):
    """text_offset[i] is the length of the token strings before token i (vLLM's rule), also across a
    byte-fallback run whose text is held back until the run closes (`café` spelled as bytes: the
    released text lags behind the tokens there); `logprobs: 0` still gives each chosen token's own
    entry in top_logprobs (OpenAI's legacy rule: up to logprobs + 1 entries), streamed and not."""
    ids = [*tokenizer.encode("ab caf", add_bos=False), tokenizer.token_to_id("<0xC3>"), tokenizer.token_to_id("<0xA9>"),
           *tokenizer.encode(" cd", add_bos=False)]  # the fake echoes the prompt's ids
    for stream in (False, True):
        got = client.completions.create(model="tiny", prompt=ids, temperature=0, max_tokens=len(ids), logprobs=0,
                                        stream=stream, extra_body={"ignore_eos": True})
        chunks = list(got) if stream else [got]
        text = "".join(c.choices[0].text for c in chunks)
        tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
        offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
        top = [t for c in chunks for t in c.choices[0].logprobs.top_logprobs]
        assert text.startswith("ab café cd") and len(tokens) == len(ids)
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        assert top == [{t: -0.25} for t in tokens]


def test_penalties_and_filters_reach_the_engine(client, server):
    engine = server[1]
    client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0.5, top_p=0.9, max_tokens=2,
                                   presence_penalty=0.5, frequency_penalty=-0.5,
                                   extra_body={"top_k": 7, "min_p": 0.1, "repetition_penalty": 1.2})
    s = engine.submitted[-1].sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.5, 0.9, 7, 0.1)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.2)
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"top_k": -1})
    s = engine.submitted[-1].sampling
    assert (s.temperature, s.top_k, s.top_p) == (1.0, 0, 1.0)  # OpenAI defaults; top_k -1 is off


async def test_async_client_sixteen_concurrent_streams(server, tokenizer):
    client = openai.AsyncOpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)
    prompts = [f"number {i} says hello" for i in range(16)]

    async def one(prompt: str) -> tuple[str, str | None, int]:
        text, finish, usage = "", None, None
        stream = await client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=64,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            else:
                usage = chunk.usage
        return text, finish, usage.completion_tokens

    results = await asyncio.gather(*(one(p) for p in prompts))
    for prompt, (text, finish, tokens) in zip(prompts, results, strict=True):
        assert text == prompt and finish == "stop"
        assert tokens == len(tokenizer.encode(prompt, add_bos=False))
    r = await client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0)
    assert r.choices[0].message.content == CHAT_ECHO
    await client.close()


def test_models_tokenize_detokenize_version(server, tokenizer):
    url = server[0]
    models = httpx.get(f"{url}/v1/models").json()
    (card,) = models["data"]
    assert card["id"] == "tiny" and card["root"] == "/models/tiny" and card["max_model_len"] == 128
    assert card["vocab_size"] == tokenizer.vocab_size
    assert openai.OpenAI(base_url=f"{url}/v1", api_key="x").models.list().data[0].id == "tiny"
    t = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": "Hello café"}).json()
    assert t["tokens"] == tokenizer.encode("Hello café") and t["count"] == len(t["tokens"])
    assert t["max_model_len"] == 128 and t["token_strs"] is None
    t = httpx.post(f"{url}/tokenize", json={"prompt": "Hello", "add_special_tokens": False,
                                             "return_token_strs": True}).json()
    assert t["tokens"] == tokenizer.encode("Hello", add_bos=False) and t["token_strs"] == ["Hell", "o"]
    t = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()
    assert t["tokens"] == tokenizer.encode_chat(MESSAGES)
    d = httpx.post(f"{url}/detokenize", json={"tokens": tokenizer.encode("Hello café")}).json()
    assert d == {"prompt": "<bos>Hello café"}
    v = httpx.get(f"{url}/version").json()
    assert v["version"] == __import__("gemmax").__version__ and "build" in v


def test_health_reports_device_and_precision(server):
    h = httpx.get(f"{server[0]}/health")
    assert h.status_code == 200
    body = h.json()
    assert body["status"] == "ready" and body["model"] == "tiny"
    assert body["policy"]["platform"] == "cpu" and "compute_capability" in body["policy"]
    assert body["precision"] == {"weights": "bfloat16", "activations": "float32", "kv_cache": "float32",
                                 "pre_ampere": False}
    assert body["weight_bytes"] == 123_456 and body["max_model_len"] == 128
    assert body["slots"]["total"] == 4 and body["version"]


def test_metrics_parse_and_count(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    url = server[0]
    before = read_metric(url, "gemmax:requests_total", {"endpoint": "/v1/chat/completions", "status": "200"}) or 0
    tokens_before = read_metric(url, "gemmax:generation_tokens_total") or 0
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    for name, kind in [("gemmax:time_to_first_token_seconds", "histogram"),
                       ("gemmax:inter_token_latency_seconds", "histogram"),
                       ("gemmax:e2e_request_latency_seconds", "histogram"),
                       ("gemmax:request_queue_time_seconds", "histogram"),
                       ("gemmax:requests", "counter"), ("gemmax:degenerate_responses", "counter"),
                       ("gemmax:prompt_tokens", "counter"), ("gemmax:generation_tokens", "counter"),
                       ("gemmax:num_requests_running", "gauge"), ("gemmax:num_requests_waiting", "gauge"),
                       ("gemmax:kv_slots_in_use", "gauge"), ("gemmax:weight_bytes", "gauge"),
                       ("gemmax:model_info", "gauge")]:
        assert families[name].type == kind, name
    assert read_metric(url, "gemmax:requests_total", {"endpoint": "/v1/chat/completions", "status": "200"}) == before + 1
    assert read_metric(url, "gemmax:generation_tokens_total") == tokens_before + r.usage.completion_tokens
    assert read_metric(url, "gemmax:weight_bytes") == 123_456
    assert read_metric(url, "gemmax:model_info", {"weights": "bfloat16", "kv_cache": "float32"}) == 1
    assert read_metric(url, "gemmax:time_to_first_token_seconds_count") >= 1
