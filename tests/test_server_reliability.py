"""Issue 15 over HTTP (the real app on loopback, a fake engine that validates with the engine's own
`validate_request`): every value the engine cannot represent is a 400 naming the parameter, one call
cannot queue unbounded work, a full queue answers 503 with Retry-After, a 500 closes its connection,
and the browser / host exposure is closed (415 for non-JSON bodies, Host checked on a loopback bind,
the auth scheme in any case, two Authorization headers refused)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from fake_engine import fake_server
from gemmax.server.app import ServerSettings
from test_server_errors import CRASH, MESSAGES, assert_error, assert_serving, post
from tiny_checkpoint import BOS_ID


@pytest.fixture(scope="module")
def server(tokenizer):
    settings = ServerSettings(served_model_name="tiny", max_choices=16)
    with fake_server(tokenizer, settings, max_model_len=64, crash_token=CRASH) as running:
        yield running


def raw(url: str, path: str, text: str, **headers) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=text.encode(), headers={"content-type": "application/json", **headers},
                      timeout=10)


CHAT = '{"messages": [{"role": "user", "content": "hi"}], '


@pytest.mark.parametrize(("body", "param"), [
    (CHAT + '"top_k": 2147483648, "temperature": 1}', "top_k"),
    (CHAT + '"top_k": 100000}', "top_k"),  # over the vocabulary
    (CHAT + '"temperature": Infinity}', "temperature"),
    (CHAT + '"temperature": 1e999}', "temperature"),
    (CHAT + '"temperature": 1e9}', "temperature"),
    (CHAT + '"top_p": NaN}', "top_p"),
    (CHAT + '"presence_penalty": -Infinity}', "presence_penalty"),
    (CHAT + '"repetition_penalty": 1e300}', "repetition_penalty"),
    (CHAT + '"seed": 18446744073709551616}', "seed"),
    (CHAT + '"max_tokens": 2147483648}', "max_tokens"),
    (CHAT + '"stop_token_ids": [100000]}', "stop_token_ids"),
    (CHAT + '"stop_token_ids": [-1]}', "stop_token_ids"),
    (CHAT + '"min_tokens": 500}', "min_tokens"),  # beyond the 64-token context
    (CHAT + '"stream": "yes"}', "stream"),
    (CHAT + '"ignore_eos": 1}', "ignore_eos"),
    (CHAT + '"top_k": 1.5}', "top_k"),
    (CHAT + '"logprobs": true, "top_logprobs": 21}', "top_logprobs"),
    ('{"prompt": "hi", "logprobs": -1}', "logprobs"),
    ('{"prompt": "hi", "echo": "true"}', "echo"),
])
def test_values_the_engine_cannot_represent_are_400(server, body, param):
    path = "/v1/chat/completions" if body.startswith(CHAT) else "/v1/completions"
    before = len(server[1].submitted)
    err = assert_error(raw(server[0], path, body), 400)
    assert err["param"] == param and err["message"].startswith(f"{param}: "), err
    assert len(server[1].submitted) == before  # nothing reached the engine's queue


def test_out_of_range_token_ids_are_400_before_anything_decodes_them(server):
    url = server[0]
    for ids in ([BOS_ID, -1], [BOS_ID, 2**40], [BOS_ID, 100_000]):
        err = assert_error(post(url, "/v1/completions", {"prompt": ids, "echo": True}), 400)
        assert err["param"] == "prompt" and "outside the vocabulary" in err["message"]
    assert_error(post(url, "/detokenize", {"tokens": [1, -5]}), 400)
    assert_serving(url)


def test_prompts_times_n_is_capped(server):
    url, engine, _ = server
    before = len(engine.submitted)
    err = assert_error(post(url, "/v1/completions", {"prompt": ["Hi"] * 100, "n": 64, "max_tokens": 1}), 400,
                       "too_many_completions")
    assert "6400" in err["message"] and "at most 16" in err["message"]
    assert len(engine.submitted) == before
    ok = post(url, "/v1/completions", {"prompt": ["a", "b"], "n": 8, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 16


def test_a_500_closes_its_connection_and_the_next_pooled_request_works(server):
    url = server[0]
    with httpx.Client(base_url=url, timeout=10) as client:
        for _ in range(3):
            r = client.post("/v1/completions", json={"prompt": [BOS_ID, CRASH]})
            assert_error(r, 500, "internal_error")
            assert r.headers["connection"] == "close"
            ok = client.post("/v1/completions", json={"prompt": "ab", "temperature": 0, "max_tokens": 2})
            assert ok.status_code == 200


def test_non_json_bodies_are_415(server):
    url = server[0]
    body = json.dumps({"messages": MESSAGES})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"content-type": content_type} if content_type else {}
        r = httpx.post(f"{url}/v1/chat/completions", content=body.encode(), headers=headers)
        assert_error(r, 415, "unsupported_media_type")
    r = httpx.post(f"{url}/v1/chat/completions", content=body.encode(),
                   headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_host_header_is_checked_on_a_loopback_bind(server, tokenizer):
    url = server[0]
    port = url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io", "10.0.0.1"):
        r = httpx.get(f"{url}/v1/models", headers={"host": host})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
        assert "DNS rebinding" in r.json()["error"]["message"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost", f"[::1]:{port}"):
        assert httpx.get(f"{url}/v1/models", headers={"host": host}).status_code == 200
    settings = ServerSettings(served_model_name="tiny", host="0.0.0.0")
    with fake_server(tokenizer, settings) as (other, _, _):
        assert httpx.get(f"{other}/v1/models", headers={"host": "gemmax.internal"}).status_code == 200
    settings = ServerSettings(served_model_name="tiny", allowed_hosts=("gemmax.test",))
    with fake_server(tokenizer, settings) as (named, _, _):
        assert httpx.get(f"{named}/v1/models", headers={"host": "gemmax.test:80"}).status_code == 200


def test_auth_scheme_in_any_case_and_one_authorization_header(tokenizer):
    settings = ServerSettings(served_model_name="tiny", api_key="s3cret")
    with fake_server(tokenizer, settings) as (url, _, _):
        for value in ("Bearer s3cret", "bearer s3cret", "BEARER s3cret", "Bearer  s3cret"):
            assert httpx.get(f"{url}/v1/models", headers={"authorization": value}).status_code == 200, value
        for pair in ([("authorization", "Bearer s3cret"), ("authorization", "Bearer nope")],
                     [("authorization", "Bearer nope"), ("authorization", "Bearer s3cret")],
                     [("authorization", "Bearer s3cret"), ("authorization", "Bearer s3cret")]):
            assert_error(httpx.get(f"{url}/v1/models", headers=pair), 401, "invalid_api_key")
        assert_error(httpx.get(f"{url}/v1/models", headers={"authorization": "Basic s3cret"}), 401)
        assert_serving(url, {"Authorization": "bearer s3cret"})


def test_a_full_queue_answers_503_with_retry_after(tokenizer):
    with fake_server(tokenizer, max_batch=1, max_queue=1, token_delay=0.02, max_model_len=4096) as (url, engine, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        body = {"prompt": "ab", "max_tokens": 400, "temperature": 0}
        started = [threading.Event() for _ in range(2)]
        results: list[int] = []

        def hold(i: int) -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True, "ignore_eos": True}, timeout=30) as r:
                started[i].set()
                results.append(r.status_code)
                for _ in r.iter_lines():
                    pass

        threads = [threading.Thread(target=hold, args=(i,)) for i in range(2)]
        for thread in threads:  # one running, one waiting
            thread.start()
            started[threads.index(thread)].wait(10)
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model="tiny", **body)
        assert info.value.status_code == 503
        assert info.value.body["code"] == "queue_full"
        assert 1 <= int(info.value.response.headers["retry-after"]) <= 60
        assert engine.stats().waiting == 1
        for run in list(engine._active) + list(engine._waiting):
            run.handle.cancel()
        for thread in threads:
            thread.join(30)
        assert results == [200, 200]
        assert client.completions.create(model="tiny", prompt="ab", max_tokens=2, temperature=0).choices[0].text


def test_one_calls_choices_are_admitted_or_refused_together(tokenizer):
    """A call's prompts x n engine requests enter the queue as one: on an idle server with one slot and
    a queue of one, n=3 and 2 prompts x n=2 are served (each choice used to be counted against the
    bound by the call's own earlier choices: 503 every time); behind a full queue the whole call is
    refused and none of it is queued."""
    with fake_server(tokenizer, max_batch=1, max_queue=1, token_delay=0.02, max_model_len=4096) as (url, engine, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        body = {"max_tokens": 3, "temperature": 0}
        assert len(client.completions.create(model="tiny", prompt="ab", n=3, **body).choices) == 3
        assert len(client.completions.create(model="tiny", prompt=["ab", "cd"], n=2, **body).choices) == 4
        held = httpx.Client(timeout=30)
        hold = {"prompt": "ab", "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
        with held.stream("POST", f"{url}/v1/completions", json=hold) as running, \
                held.stream("POST", f"{url}/v1/completions", json=hold) as waiting:
            assert (running.status_code, waiting.status_code) == (200, 200)
            deadline = time.monotonic() + 10
            while engine.stats().waiting != 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            before = len(engine.submitted)
            with pytest.raises(openai.APIStatusError) as info:
                client.completions.create(model="tiny", prompt="ab", n=3, **body)
            assert info.value.status_code == 503 and info.value.body["code"] == "queue_full"
            assert len(engine.submitted) == before and engine.stats().waiting == 1  # nothing of it queued
            for run in list(engine._active) + list(engine._waiting):
                run.handle.cancel()
        held.close()
