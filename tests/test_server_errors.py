"""Every error the server answers, in the OpenAI shape, and that the server keeps serving after each."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from fake_engine import fake_server, read_metric
from gemmax.server.app import ServerSettings
from tiny_checkpoint import BOS_ID

MESSAGES = [{"role": "user", "content": "hi"}]
FAULT, CRASH = 500, 501  # token ids that make the fake engine fail (mid-request / on submit)
LEAKS = ("pydantic", "errors.pydantic.dev", "ValidationError", "input_value", "Traceback", "loc", "ctx")


@pytest.fixture(scope="module")
def server(tokenizer):
    settings = ServerSettings(served_model_name="tiny", max_body_bytes=4096)
    with fake_server(tokenizer, settings, max_model_len=64, fault_token=FAULT, crash_token=CRASH) as running:
        yield running


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    for leak in LEAKS:
        assert leak not in body["error"]["message"], body
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


def assert_serving(url: str, headers=None) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=10,
                   json={"model": "tiny", "messages": MESSAGES, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "user\nhi\nmodel\n"


def post(url: str, path: str, body, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=10, **kwargs)


def test_prompt_longer_than_max_model_len(server):
    url = server[0]
    long_text = "word " * 80
    err = assert_error(post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]}),
                       400, "context_length_exceeded")
    n = int(err["message"].split("prompt has ")[1].split(" ")[0])
    assert n > 64 and "max_model_len is 64" in err["message"]
    err = assert_error(post(url, "/v1/completions", {"prompt": [BOS_ID] * 64}), 400, "context_length_exceeded")
    assert "prompt has 64 tokens" in err["message"] and "64" in err["message"]
    err = assert_error(post(url, "/v1/completions", {"prompt": [BOS_ID] * 10, "max_tokens": 60}), 400,
                       "context_length_exceeded")
    assert "64" in err["message"] and "70" in err["message"] and err["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).completions.create(
            model="tiny", prompt=[BOS_ID] * 100)
    assert "max_model_len is 64" in info.value.message
    assert_serving(url)


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/chat/completions", {"temperature": -0.5}, "temperature"),
    ("/v1/chat/completions", {"top_p": 1.5}, "top_p"),
    ("/v1/chat/completions", {"top_k": -2}, "top_k"),
    ("/v1/chat/completions", {"min_p": 2}, "min_p"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": -3}, "max_completion_tokens"),
    ("/v1/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", {"frequency_penalty": -9}, "frequency_penalty"),
    ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"stop": [""]}, "stop"),
    ("/v1/chat/completions", {"stop": [1, 2]}, "stop"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": {"text": "x"}}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], "x"]}, "prompt"),
])
def test_out_of_range_parameters_are_400(server, path, extra, param):
    body = {"model": "tiny", "messages": MESSAGES} if path.endswith("chat/completions") else {"prompt": "hi"}
    err = assert_error(post(server[0], path, {**body, **extra}), 400)
    assert err["param"] == param and err["message"].startswith(f"{param}: ")


@pytest.mark.parametrize(("path", "body", "needle"), [
    ("/v1/chat/completions", {"messages": MESSAGES, "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs requires logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"5": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text only"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": [BOS_ID, 100_000]}, "outside the vocabulary"),
    ("/v1/completions", {"prompt": []}, "empty"),
    ("/v1/chat/completions", {"messages": MESSAGES, "structured_outputs": {"json": "{bad"}},
     "structured_outputs.json is not valid JSON"),
])
def test_inconsistent_requests_are_400(server, path, body, needle):
    err = assert_error(post(server[0], path, body), 400)
    assert needle in err["message"]


def test_malformed_bodies_are_400_not_422(server):
    url = server[0]
    for content in (b"{not json", b"", b"[1, 2]", b'"text"'):
        r = httpx.post(f"{url}/v1/chat/completions", content=content, headers={"content-type": "application/json"})
        assert_error(r, 400)
    assert_error(post(url, "/tokenize", {"prompt": "a", "messages": MESSAGES}), 400)
    assert_error(post(url, "/detokenize", {"tokens": ["a"]}), 400)
    assert_error(post(url, "/detokenize", {"tokens": [-1]}), 400)
    assert_serving(url)


def test_unknown_model_and_route_are_404(server):
    url = server[0]
    err = assert_error(post(url, "/v1/chat/completions", {"model": "gpt-9", "messages": MESSAGES}), 404,
                       "model_not_found")
    assert "gpt-9" in err["message"] and err["param"] == "model"
    assert_error(post(url, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404, "model_not_found")
    assert_error(post(url, "/tokenize", {"model": "gpt-9", "prompt": "x"}), 404, "model_not_found")
    assert_error(httpx.get(f"{url}/v1/nothing"), 404)
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).chat.completions.create(
            model="gpt-9", messages=MESSAGES)
    assert_serving(url)


def test_oversized_bodies_are_413(server):
    url = server[0]
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}
    err = assert_error(post(url, "/v1/chat/completions", big), 413, "request_too_large")
    assert "4096" in err["message"]

    def chunked():  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}]}'

    r = httpx.post(f"{url}/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
    assert "content-length" not in {k.lower() for k in r.request.headers}
    assert_error(r, 413, "request_too_large")
    assert_serving(url)


def test_engine_faults_are_500_and_the_server_goes_on(server):
    url = server[0]
    err = assert_error(post(url, "/v1/completions", {"prompt": [BOS_ID, FAULT, 7]}), 500, "engine_error")
    assert "fake fault" in err["message"]
    err = assert_error(post(url, "/v1/completions", {"prompt": [BOS_ID, CRASH]}), 500, "internal_error")
    assert "Traceback" not in err["message"]
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": [BOS_ID, FAULT], "stream": True}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "engine_error"
    assert read_metric(url, "gemmax:requests_total", {"endpoint": "/v1/completions", "status": "500"}) == 3
    assert read_metric(url, "gemmax:kv_slots_in_use") == 0
    assert_serving(url)


def test_api_key(tokenizer):
    settings = ServerSettings(served_model_name="tiny", api_key="s3cret")
    with fake_server(tokenizer, settings) as (url, _, _):
        good = {"Authorization": "Bearer s3cret"}
        for wrong in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}, {"Authorization": "Bearer s3cre"}):
            for method, path in [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
                                 ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version")]:
                r = httpx.request(method, f"{url}{path}", headers=wrong, json={"prompt": "x", "messages": MESSAGES})
                assert_error(r, 401, "invalid_api_key")
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
        assert read_metric(url, "gemmax:requests_total", {"endpoint": "/v1/completions", "status": "401"}) == 4
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0).choices[0].message.content
        assert httpx.get(f"{url}/version", headers=good).status_code == 200
        assert_serving(url, good)


def test_not_ready_is_503_then_health_turns_200(tokenizer):
    with fake_server(tokenizer, wait_ready=False, warmup_seconds=1.0) as (url, engine, _):
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["status"] == "warming"
        err = assert_error(post(url, "/v1/chat/completions", {"messages": MESSAGES}), 503, "not_ready")
        assert "warming" in err["message"] and "/health" in err["message"]
        assert_error(httpx.get(f"{url}/v1/models"), 503, "not_ready")
        assert read_metric(url, "gemmax:ready") == 0
        deadline = time.time() + 10
        while httpx.get(f"{url}/health").status_code != 200:
            assert time.time() < deadline
            time.sleep(0.05)
        assert read_metric(url, "gemmax:ready") == 1
        assert_serving(url)


def test_failed_warm_up_is_503_failed(tokenizer):
    with fake_server(tokenizer, warmup_error="XLA ran out of memory compiling prefill[2048]") as (url, _, _):
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503
        assert health.json()["status"] == "failed" and "out of memory" in health.json()["error"]
        err = assert_error(post(url, "/v1/chat/completions", {"messages": MESSAGES}), 503, "not_ready")
        assert "failed" in err["message"] and "out of memory" in err["message"]


def test_degenerate_output_is_flagged_counted_and_logged(server, caplog):
    url = server[0]
    before = read_metric(url, "gemmax:degenerate_responses_total")
    loop = [BOS_ID] + [300] * 8  # the fake echoes 8 equal ids: a period-1 loop
    with caplog.at_level("WARNING", logger="gemmax.server"):
        r = post(url, "/v1/completions", {"prompt": loop, "max_tokens": 8, "temperature": 0})
    body = r.json()
    assert r.status_code == 200 and body["usage"]["degenerate"] is True
    verdict = body["choices"][0]["degeneracy"]
    assert verdict["degenerate"] is True and "period 1" in verdict["reason"]
    assert any("degenerate response" in rec.message and "period 1" in rec.message for rec in caplog.records)
    with httpx.stream("POST", f"{url}/v1/completions",
                      json={"prompt": loop, "max_tokens": 8, "temperature": 0, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"][0]["degeneracy"]["degenerate"] is True  # the finish chunk carries it
    assert read_metric(url, "gemmax:degenerate_responses_total") == before + 2
    ok = post(url, "/v1/completions", {"prompt": "ab", "temperature": 0}).json()
    assert ok["choices"][0]["degeneracy"] == {"degenerate": False, "reason": None}


def test_on_degenerate_error(tokenizer):
    settings = ServerSettings(served_model_name="tiny", on_degenerate="error")
    with fake_server(tokenizer, settings) as (url, _, _):
        loop = [BOS_ID] + [300] * 8
        err = assert_error(post(url, "/v1/completions", {"prompt": loop, "max_tokens": 8, "temperature": 0}), 422,
                           "degenerate_output")
        assert "period 1" in err["message"]
        with httpx.stream("POST", f"{url}/v1/completions",
                          json={"prompt": loop, "max_tokens": 8, "temperature": 0, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["code"] == "degenerate_output"
        assert read_metric(url, "gemmax:degenerate_responses_total") == 2
        assert read_metric(url, "gemmax:requests_total", {"endpoint": "/v1/completions", "status": "422"}) == 2
        assert_serving(url)
