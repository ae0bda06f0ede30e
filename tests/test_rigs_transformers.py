"""The transformers rig on tiny random Gemma 4 checkpoints, driven by the official `openai` client:
its greedy stream must equal transformers' own `generate`, tokens must arrive as they are sampled,
and `gemmax bench` must time it like any other server."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn

from gemmax.bench.sweep import Sweep, SweepConfig
from gemmax.rigs.transformers_server import HFGenerator, create_app
from hf_reference import build_gemma4

# A streamed reply's span on the wire is checked against the server's own decode time: `make test`
# runs this module alone, not beside a worker that compiles on both cores (pyproject.toml's markers).
pytestmark = pytest.mark.wire_timing

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


@contextlib.contextmanager
def serving(app):
    """Run an ASGI app under uvicorn on a free loopback port in a background thread."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


def add_tokenizer(directory: Path) -> None:
    """A word-level tokenizer (within the tiny 128-id vocabulary) with <bos> and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from gemmax.bench.prompts import FILLER_WORDS

    words = list(dict.fromkeys(FILLER_WORDS))[:124]
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = "{% for m in messages %}<bos>{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(directory)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("g4_shared")
    model = build_gemma4("g4_shared", directory)
    return directory, model


@pytest.fixture(scope="module")
def rig(checkpoint):
    directory, _ = checkpoint
    gen = HFGenerator(directory, dtype="float32", max_model_len=64)
    with serving(create_app(gen, "tiny")) as url:
        yield gen, url


@pytest.fixture(scope="module")
def client(rig):
    return openai.OpenAI(base_url=rig[1] + "/v1", api_key="unused")


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def stream_ids(client, **kwargs) -> tuple[list[int], list[float], list, object]:
    chunks, times, finish, usage = [], [], [], None
    for chunk in client.completions.create(model="tiny", stream=True, stream_options={"include_usage": True},
                                           **kwargs):
        if chunk.choices:
            chunks.extend(chunk.choices[0].token_ids)
            times.append(time.perf_counter())
            finish.append(chunk.choices[0].finish_reason)
        if chunk.usage is not None:
            usage = chunk.usage
    return chunks, times, finish, usage


def test_streamed_greedy_equals_transformers_generate_with_min_tokens(checkpoint, client):
    _, model = checkpoint
    ids, _, finish, usage = stream_ids(client, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"min_tokens": 12})
    assert ids == hf_greedy(model, PROMPT, 12)
    assert finish[-1] == "length" and all(f is None for f in finish[:-1])
    assert usage.prompt_tokens == len(PROMPT) and usage.completion_tokens == 12
    extra = usage.model_extra
    assert extra["decode_tokens_per_second"] > 0 and extra["time_to_first_token_seconds"] > 0


def test_eos_stops_unless_ignored(checkpoint, rig, client):
    _, model = checkpoint
    gen, _ = rig
    ref = hf_greedy(model, PROMPT, 12)
    stop_at = next(i for i in range(2, 12) if ref[i] not in ref[:i])
    saved = gen.eos_ids
    gen.eos_ids = [ref[stop_at]]
    try:
        ids, _, finish, usage = stream_ids(client, prompt=PROMPT, max_tokens=12, temperature=0)
        assert ids == ref[:stop_at + 1] and finish[-1] == "stop" and usage.completion_tokens == stop_at + 1
        ids, _, finish, _ = stream_ids(client, prompt=PROMPT, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
        assert ids == ref and finish[-1] == "length"
    finally:
        gen.eos_ids = saved


def test_tokens_arrive_as_they_are_sampled(client):
    # If the server buffered the stream, the chunks would land together; on the wire they must span
    # about the time the server spent decoding them.
    ids, times, _, usage = stream_ids(client, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"min_tokens": 40})
    server_span = (len(ids) - 1) / usage.model_extra["decode_tokens_per_second"]
    wire_span = times[-1] - times[0]
    assert len(times) == 40
    assert wire_span >= 0.8 * server_span


def test_seeded_sampling_is_reproducible(client):
    a, *_ = stream_ids(client, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=7, extra_body={"min_tokens": 10})
    b, *_ = stream_ids(client, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=7, extra_body={"min_tokens": 10})
    assert a == b and len(a) == 10


def test_non_streaming_completion(checkpoint, client):
    _, model = checkpoint
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                         extra_body={"min_tokens": 6})
    assert response.usage.completion_tokens == 6 and response.choices[0].finish_reason == "length"
    assert response.choices[0].text == ""  # no tokenizer: ids only


def test_bad_requests_get_openai_errors(client, rig):
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model="tiny", prompt=[5, 500], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="no tokenizer"):
        client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=60)
    response = httpx.post(rig[1] + "/tokenize", json={"prompt": "hello"})
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    # The server's own request models: what the rig cannot honour is refused, not ignored.
    with pytest.raises(openai.BadRequestError, match="one choice per request"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError, match="top_k is not supported"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"top_k": 5})
    with pytest.raises(openai.BadRequestError, match="structured_outputs is not supported"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                  extra_body={"structured_outputs": {"regex": "a+"}})
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"stream": "yes"})
    # refused as the gemmax server refuses them, not answered wrongly (500, a stream with no chunk)
    for fields, reason in (({"max_tokens": 0}, "max_tokens must be at least 1"),
                           ({"max_tokens": 2, "temperature": -1}, "temperature must be at least 0"),
                           ({"max_tokens": 2, "top_p": 0}, r"top_p must lie in \(0, 1\]"),
                           ({"max_tokens": 2, "top_p": 2}, r"top_p must lie in \(0, 1\]"),
                           ({"max_tokens": 2, "logprobs": 0}, "logprobs is not supported"),
                           ({"max_tokens": 2, "echo": True}, "echo is not supported")):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match=reason):
                client.completions.create(model="tiny", prompt=PROMPT, stream=stream, **fields)
    with pytest.raises(openai.NotFoundError, match="the model `other` does not exist"):
        client.completions.create(model="other", prompt=PROMPT, max_tokens=2)
    response = httpx.post(rig[1] + "/v1/completions", content=b'{"prompt": [5, 6], "max_tokens": 2,,}',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"] == "the request body is not valid JSON"
    for tokens in ([-1], [500]):
        response = httpx.post(rig[1] + "/detokenize", json={"tokens": tokens})
        assert response.status_code == 400 and "outside the vocabulary" in response.json()["error"]["message"]
    ids = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                    extra_body={"min_tokens": 3, "return_token_ids": True}).choices[0]
    assert len(ids.model_extra["token_ids"]) == 3


def test_health_models_and_precision(checkpoint, rig):
    _, url = rig
    health = httpx.get(url + "/health").json()
    assert health["precision"] == {"weights": "float32", "activations": "float32", "kv_cache": "float32"}
    entry = httpx.get(url + "/v1/models").json()["data"][0]
    assert entry["id"] == "tiny" and entry["max_model_len"] == 64 and entry["vocab_size"] == 128
    directory, _ = checkpoint
    bf16 = HFGenerator(directory, dtype="bfloat16")
    assert bf16.precision()["weights"] == "bfloat16"  # read from the loaded tensors


def test_auto_dtype_is_the_checkpoints_own(checkpoint, tmp_path):
    """`--dtype auto` (what `rigs_run.py --dtype auto` gives every rig) keeps a checkpoint stored in 16
    bits as it is (a float16 copy here) and computes a float32 one in bfloat16, as vLLM's auto does on
    this CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    directory, _ = checkpoint
    AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float16).save_pretrained(tmp_path)
    for path, used in ((directory, "bfloat16"), (tmp_path, "float16")):
        assert HFGenerator(path, dtype="auto").precision() == dict.fromkeys(("weights", "activations", "kv_cache"), used)


def test_bench_times_the_rig_with_token_id_prompts(rig):
    _, url = rig
    config = SweepConfig(base_url=url, input_lens=(9, 30), output_len=6, repeats=2, concurrency=(1, 2))
    result = asyncio.run(Sweep(config).run())
    assert result["prompt_mode"] == "ids" and result["decode_source"] == "both" and result["forced_output"]
    for cell in result["cells"]:
        assert cell["failed"] == 0 and cell["completed"] == 2 * cell["concurrency"]
        assert cell["input_len_verified"] and cell["output_len_verified"]
        assert cell["stream"]["median"] > 0 and cell["ratio"]["median"] > 0


def test_text_prompts_chat_and_exact_counts_with_a_tokenizer(checkpoint, tmp_path):
    directory, _ = checkpoint
    with_tok = tmp_path / "with_tokenizer"
    with_tok.mkdir()
    for f in directory.iterdir():
        (with_tok / f.name).write_bytes(f.read_bytes())
    add_tokenizer(with_tok)
    gen = HFGenerator(with_tok, dtype="float32", max_model_len=256)
    with serving(create_app(gen, "tiny-tok")) as url:
        tok = httpx.post(url + "/tokenize", json={"prompt": "the river of"}).json()
        assert tok["tokens"][0] == 2 and tok["count"] == len(tok["tokens"]) == 4
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        stream = client.chat.completions.create(model="tiny-tok", messages=[{"role": "user", "content": "the of"}],
                                                max_tokens=5, stream=True, extra_body={"min_tokens": 5})
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert sum(len(c.choices[0].token_ids) for c in chunks) == 5
        config = SweepConfig(base_url=url, input_lens=(20, 77), output_len=3, repeats=1)
        result = asyncio.run(Sweep(config).run())
        assert result["prompt_mode"] == "server"
        assert [c["input_len_verified"] for c in result["cells"]] == [True, True]


def test_a_partial_utf8_sequence_is_held_until_the_last_token_releases_it():
    """Streamed text holds back a partial UTF-8 sequence (it decodes to U+FFFD) while more tokens may
    complete it; the answer's last token releases it, so the streamed text is the whole answer's."""
    from types import SimpleNamespace

    from gemmax.rigs.transformers_server import HFGenerator

    texts = {1: "caf", 2: "caf\ufffd"}  # ids -> decoded text: the second token opens a byte sequence
    gen = object.__new__(HFGenerator)
    gen.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: texts[len(ids)])
    assert gen.decode_delta([7], "") == "caf"
    assert gen.decode_delta([7, 8], "caf") == ""  # held: a later token may complete it
    assert gen.decode_delta([7, 8], "caf", final=True) == "\ufffd"  # the end: as the whole answer shows it
