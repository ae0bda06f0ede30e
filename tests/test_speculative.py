"""Speculative decoding through the batching engine, with prompt lookup and with a draft model: plain
decoding in the same engine is the reference (greedy token-identical; with prompt lookup seeded
sampling draw-identical), and the verify step's rejection rule keeps the target distribution (a
statistical bound that always-accept fails; the draft model's rule: tests/test_speculative_draft.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from safetensors.numpy import load_file, save_file

from fake_engine import read_metric, running_server
from gemmax.engine.api import (
    SPEC_KS,
    GenerationRequest,
    InvalidRequest,
    SamplingParams,
    Speculation,
    validate_request,
)
from gemmax.engine.engine import BatchEngine
from gemmax.engine.loading import load_model
from gemmax.engine.sampling import SamplingState
from gemmax.engine.speculative import RequestSpeculation, propose_ngram
from gemmax.engine.steps import init_device_state, verify_rows
from gemmax.model.forward import forward_jit
from gemmax.model.kv_cache import cache_bytes
from gemmax.server.app import ServerSettings, create_app
from tiny_checkpoint import write_tiny_checkpoint

PLAIN = Speculation("off")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # g4_shared (sliding window 4, KV sharing) with a tokenizer, for the server test
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_model(str(checkpoint), "float32")  # float32: greedy picks do not hinge on bf16 ties


def related_copy(source, directory, noise: float, seed: int = 0):
    """The checkpoint at `source` with Gaussian noise (`noise` x each layer tensor's own std) added to
    its decoder layers' matrices: a draft that agrees with it often, not always (the tiny model's
    logits are flat: noise 0.003 kept 85% of its argmaxes over 60 positions, 0.01 55%, 0.05 17%)."""
    shutil.copytree(source, directory)
    rng = np.random.default_rng(seed)
    for path in directory.glob("*.safetensors"):
        tensors = load_file(path)
        for name, value in tensors.items():
            if ".layers." in name and value.ndim == 2:
                tensors[name] = (value + noise * value.std() * rng.standard_normal(value.shape)).astype(value.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def drafts(checkpoint, tmp_path_factory):
    """Draft models of the target's config, by the real loader: its own weights (every proposal
    right), a related copy (noise on its layers: some right, many rollbacks), another random seed
    (almost every proposal wrong)."""
    root = tmp_path_factory.mktemp("drafts")
    paths = {"same": checkpoint, "related": related_copy(checkpoint, root / "related", 0.003),
             "other": write_tiny_checkpoint(root / "other", seed=1)}
    return {name: load_model(str(path), "float32") for name, path in paths.items()}


@pytest.fixture(scope="module")
def engine(loaded, drafts):
    # One engine for prompt lookup and the draft model, its shapes compiled by the tests' requests (no warm-up):
    # rows of both methods share its verify steps.
    eng = BatchEngine(loaded, max_model_len=160, max_batch=2, buckets=(16,), steps_per_dispatch=3,
                      speculation=PLAIN, draft=drafts["related"], warm_up=False).start()
    assert eng.wait_ready(900)
    yield eng
    eng.shutdown(drain_timeout=5)


def _run(engine, prompt, max_tokens, spec, **extra):
    return engine.submit(GenerationRequest(tuple(prompt), max_tokens, speculative=spec, ignore_eos=True, **extra))


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for length in rng.integers(5, 40, n):
        motif = rng.integers(3, 128, rng.integers(2, 6))  # repeats: prompt lookup finds matches
        out.append(tuple(int(t) for t in np.resize(np.concatenate([motif, rng.integers(3, 128, 3)]), length)))
    return out


def test_ngram_proposer_takes_the_latest_longest_match():
    ctx = np.asarray([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert list(propose_ngram(ctx, 4)) == [7, 8, 5, 2]  # "2 3" last seen before 7 8 (n=3 "5 2 3" absent)
    assert list(propose_ngram(np.asarray([4, 5, 6, 4, 5]), 8)) == [6, 4, 5]  # cut at the context's end
    assert list(propose_ngram(np.asarray([1, 2, 3]), 4)) == []
    assert list(propose_ngram(np.asarray([1, 2, 1, 3, 1]), 2)) == [3, 1]  # n=1: latest earlier 1
    # in a loop the latest match ends right before the suffix (one token after it); the latest with k after it
    assert list(propose_ngram(np.asarray([7, 5, 5, 5, 5, 5, 5, 5, 5]), 4)) == [5, 5, 5, 5]
    assert list(propose_ngram(np.asarray([7, 1, 2, 1, 2, 1, 2, 1, 2]), 4)) == [1, 2, 1, 2]
    assert list(propose_ngram(np.asarray([7, 5, 5, 5, 5]), 4)) == [5]  # no match has 4 after it: the latest


def _proposer(monkeypatch, references, wrong_at):
    """Replace prompt lookup by a proposer that knows each request's plain output (`references`:
    {prompt: tokens}) and proposes its true continuation, with the token at `wrong_at(generated, k)`
    (None: none) replaced by a wrong one: the accepted and rejected lengths are then chosen by the
    test, not by what a random tiny model happens to repeat."""
    prompts = sorted(references, key=len, reverse=True)
    vocab = 512  # the tiny checkpoint's vocabulary

    def propose(self, context, generated):
        prompt = next(p for p in prompts if tuple(context[: len(p)]) == p and len(context) == len(p) + generated)
        proposed = np.asarray(references[prompt][generated : generated + self.k], np.int32)
        at = wrong_at(generated, self.k)
        if at is not None and at < len(proposed):
            proposed[at] = (proposed[at] + 1) % vocab
        return proposed

    monkeypatch.setattr(RequestSpeculation, "propose", propose)


def test_greedy_speculative_equals_plain_for_every_k_in_a_mixed_batch(engine, monkeypatch):
    """Requests with k = 2, 4, 8 and plain ones, different lengths, more than the slots, all at once:
    each speculative request gets exactly the tokens the same request gets decoded plainly. First
    with prompt lookup itself, then with proposals right up to a chosen place, so that the long
    requests cross the window-4 ring dozens of times with every accepted length from 0 to k."""
    prompts = _prompts(5)
    budgets = [120, 40, 90, 17, 60]
    specs = [Speculation("ngram", k) for k in (*SPEC_KS, *SPEC_KS)[:5]]
    plain = [_run(engine, p, b, PLAIN) for p, b in zip(prompts, budgets, strict=True)]
    lookup = [_run(engine, p, b, s) for p, b, s in zip(prompts, budgets, specs, strict=True)]
    references = {p: h.wait().token_ids for p, h in zip(prompts, plain, strict=True)}
    for i, (p, h) in enumerate(zip(prompts, lookup, strict=True)):
        assert h.wait().token_ids == references[p], f"request {i}, prompt lookup, k={specs[i].k}"
        assert plain[i].result.speculation is None
    assert sum(h.result.speculation.steps for h in lookup) > 0

    # wrong at a pseudo-random place in 0 .. k+1 (k, k+1: all right)
    _proposer(monkeypatch, references, lambda generated, k: int(np.random.default_rng(generated).integers(k + 2)))
    mixed = [_run(engine, p, b, PLAIN if i % 3 == 2 else s)
             for i, (p, b, s) in enumerate(zip(prompts, budgets, specs, strict=True))]
    for i, (p, h) in enumerate(zip(prompts, mixed, strict=True)):
        result = h.wait()
        assert result.token_ids == references[p], f"request {i} (k={specs[i].k})"
        assert result.finish_reason == "length" and len(result.token_ids) == budgets[i]
        if i % 3 == 2:
            assert result.speculation is None
            continue
        stats = result.speculation
        assert stats.steps == sum(stats.accepted_lengths) and stats.accepted <= stats.proposed
        assert len(stats.accepted_lengths) <= specs[i].k + 1
        if budgets[i] >= 60:  # accepted lengths 0 and k both met, across many window crossings
            assert stats.accepted_lengths[0] and len(stats.accepted_lengths) == specs[i].k + 1, stats


def test_rows_with_penalties_or_logprobs_beside_speculating_rows_get_their_own_tokens(engine):
    """A request with penalties and one with logprobs decode plainly, but beside a speculating
    request they take their tokens from the group's verify steps (the first position's draw, with
    their penalties, logprobs and counts): both give what they give alone."""
    penalised = GenerationRequest(_prompts(1, seed=5)[0], 30, SamplingParams(frequency_penalty=0.8,
                                                                               presence_penalty=0.5), ignore_eos=True)
    logged = GenerationRequest(_prompts(1, seed=6)[0], 30, logprobs=2, ignore_eos=True)
    alone = {name: list(engine.submit(r)) for name, r in (("penalised", penalised), ("logged", logged))}
    for name, request in (("penalised", penalised), ("logged", logged)):
        speculating = _run(engine, _prompts(1, seed=7)[0], 60, Speculation("ngram", 4))
        beside = list(engine.submit(request))
        assert speculating.wait().speculation.steps > 0
        assert [e.token_id for e in beside] == [e.token_id for e in alone[name]], name
        for got, want in zip(beside, alone[name], strict=True):
            assert (got.top_logprobs is None) == (want.top_logprobs is None) == (name == "penalised")
            if want.top_logprobs is None:
                continue
            assert [t for t, _ in got.top_logprobs] == [t for t, _ in want.top_logprobs]
            np.testing.assert_allclose([got.logprob, *(lp for _, lp in got.top_logprobs)],
                                       [want.logprob, *(lp for _, lp in want.top_logprobs)], atol=1e-5)


def test_all_rejected_proposals_stops_and_budgets_inside_accepted_tokens(engine, monkeypatch):
    prompt = _prompts(1, seed=3)[0]
    reference = _run(engine, prompt, 50, PLAIN).wait().token_ids
    _proposer(monkeypatch, {prompt: reference}, lambda generated, k: 0)  # every first proposal wrong
    rejected = _run(engine, prompt, 50, Speculation("ngram", 8)).wait()
    assert rejected.token_ids == reference
    assert rejected.speculation.accepted == 0 and rejected.speculation.steps > 0

    _proposer(monkeypatch, {prompt: reference}, lambda generated, k: None)  # always right
    right = _run(engine, prompt, 50, Speculation("ngram", 8))
    streamed = [event.token_id for event in right]
    assert tuple(streamed) == right.result.token_ids == reference
    assert right.result.speculation.accepted_lengths[8] > 0
    # a budget that ends inside the accepted tokens: exactly max_tokens of them
    assert _run(engine, prompt, 5, Speculation("ngram", 8)).wait().token_ids == reference[:5]
    # a stop id met inside the accepted tokens ends the request there, as in plain decoding
    stop = reference[11]
    expect = _run(engine, prompt, 50, PLAIN, stop_token_ids=(stop,)).wait()
    got = _run(engine, prompt, 50, Speculation("ngram", 8), stop_token_ids=(stop,)).wait()
    assert (got.token_ids, got.finish_reason, got.stop_token_id) == (expect.token_ids, "stop", stop)
    assert len(got.token_ids) == reference.index(stop)


def test_seeded_sampling_draws_the_plain_tokens(engine, monkeypatch):
    """A proposed position is drawn with the row's key at that generation step, as plain decoding
    draws it: a seeded request gives the same tokens with or without speculation."""
    prompt = _prompts(1, seed=5)[0]
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    reference = _run(engine, prompt, 60, PLAIN, sampling=sampled).wait().token_ids
    _proposer(monkeypatch, {prompt: reference}, lambda generated, k: generated % (k + 1))
    result = _run(engine, prompt, 60, Speculation("ngram", 4), sampling=sampled).wait()
    assert result.token_ids == reference and result.speculation.accepted > 0


@contextlib.contextmanager
def drafting_with(engine, draft):
    """The idle engine with another draft of the same config: its compiled steps serve it unchanged
    (they take the params as an argument), and every request prefills its own draft slot."""
    assert draft.checkpoint.config == engine.drafter.config
    before = engine.drafter.params
    engine.drafter.params = draft.checkpoint.params
    try:
        yield engine
    finally:
        engine.drafter.params = before


def test_greedy_draft_equals_plain_for_every_k_in_a_mixed_batch(engine):
    """Draft requests with k = 2, 4, 8 beside plain and prompt-lookup ones, more than the slots, all
    at once: each gets the tokens plain decoding gives. The long ones cross the window-4 ring dozens
    of times with accepted lengths from 0 to k (rollbacks of every length), and the draft's cache
    follows (a draft that fell behind or kept a rejected token would propose worse, never wrong
    tokens, so the acceptance is checked too: the related draft agrees on most tokens)."""
    prompts = _prompts(6)
    budgets = [120, 40, 100, 17, 90, 60]
    specs = [Speculation("draft", 2), Speculation("draft", 4), Speculation("draft", 8), PLAIN,
             Speculation("ngram", 4), Speculation("draft", 4)]
    plain = [_run(engine, p, b, PLAIN) for p, b in zip(prompts, budgets, strict=True)]
    drafted = [_run(engine, p, b, s) for p, b, s in zip(prompts, budgets, specs, strict=True)]
    for i, (reference, result) in enumerate(zip(plain, drafted, strict=True)):
        assert result.wait().token_ids == reference.wait().token_ids, f"request {i} ({specs[i]})"
        assert len(result.result.token_ids) == budgets[i]
    for i in (0, 2, 5):  # the draft requests of 60 tokens and more
        stats, k = drafted[i].result.speculation, specs[i].k
        assert stats.steps == sum(stats.accepted_lengths) and stats.accepted <= stats.proposed
        assert stats.accepted_lengths[0] > 0 and len(stats.accepted_lengths) == k + 1, stats  # 0 .. k kept
        assert stats.accepted > 0.3 * stats.proposed, stats
    assert drafted[3].result.speculation is None


def test_seeded_sampling_with_a_draft_repeats_and_stays_in_budget(engine):
    """A seeded sampled request with the draft draws the same tokens again (every random number is
    the row's key at its generation step), ends exactly at max_tokens and keeps some proposals."""
    prompt = _prompts(1, seed=4)[0]
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    first = _run(engine, prompt, 70, Speculation("draft", 4), sampling=sampled).wait()
    again = _run(engine, prompt, 70, Speculation("draft", 4), sampling=sampled).wait()
    assert first.token_ids == again.token_ids and len(first.token_ids) == 70
    assert first.speculation.accepted > 0


def test_a_disagreeing_draft_still_gives_the_plain_tokens(engine, drafts):
    """A draft of another random seed: its proposals are nearly all rejected (so the request backs
    off to plain decoding, and the draft catches up by prefill when it speculates again), and the
    tokens are still plain decoding's. The target's own weights as draft: every proposal kept."""
    prompt = _prompts(1, seed=2)[0]
    reference = _run(engine, prompt, 100, PLAIN).wait().token_ids
    with drafting_with(engine, drafts["other"]):
        result = _run(engine, prompt, 100, Speculation("draft", 8)).wait()
    assert result.token_ids == reference
    stats = result.speculation
    assert stats.steps > 0 and stats.accepted < 0.3 * stats.proposed, stats
    assert stats.steps < 100 // 3, stats  # backed off: most tokens decoded plainly
    with drafting_with(engine, drafts["same"]):
        result = _run(engine, prompt, 100, Speculation("draft", 8)).wait()
    assert result.token_ids == reference
    assert result.speculation.accepted == result.speculation.proposed > 0, result.speculation


def test_the_draft_is_in_the_memory_plan_and_health(engine, loaded):
    plan = engine.memory_plan
    assert plan.draft_weights == loaded.checkpoint.weight_bytes  # the related copy: the target's shapes
    assert plan.draft_kv_cache == plan.kv_cache > 0 and "draft model KV cache" in plan.explain()
    assert plan.required == (plan.weights + plan.kv_cache + plan.workspace + plan.prefix_cache + plan.draft_weights
                             + plan.draft_kv_cache)
    described = engine.info["speculative"]["draft"]
    assert described["weight_bytes"] == loaded.checkpoint.weight_bytes
    assert described["layers"] == len(loaded.checkpoint.config.layers) and described["kv_cache_bytes"] == plan.kv_cache


def test_requests_are_validated_and_the_ring_slack_is_in_the_memory_plan(engine, loaded):
    for spec, param in ((Speculation("beam", 4), "speculative.method"), (Speculation("ngram", 3), "speculative.k"),
                        (Speculation("ngram", True), "speculative.k")):
        with pytest.raises(InvalidRequest) as refused:
            engine.submit(GenerationRequest((1, 2, 3), 4, speculative=spec))
        assert refused.value.param == param
        assert "2, 4, 8" in str(refused.value) or "ngram, draft, mtp, off" in str(refused.value)
    with pytest.raises(InvalidRequest, match="--speculative"):
        validate_request(GenerationRequest((1, 2), 4, speculative=Speculation()), max_model_len=64, vocab_size=128)
    validate_request(GenerationRequest((1, 2), 4, speculative=PLAIN), max_model_len=64, vocab_size=128)
    plan, config = engine.memory_plan, loaded.checkpoint.config
    dtype = engine.precision.kv_cache
    assert plan.ring_slack == max(SPEC_KS) and "speculative" in plan.explain()
    assert plan.kv_cache == cache_bytes(config, 160, 2, dtype, max(SPEC_KS)) > cache_bytes(config, 160, 2, dtype)
    assert engine.info["speculative"]["k"] == list(SPEC_KS)


def test_rejection_rule_keeps_the_target_distribution(hf_checkpoints):
    """Many rows, each its own seed, verify the same proposals [x1, x2] after the same token at
    position 0: the first token out must follow the target p0 (whatever x1 is), x1 be kept with
    probability p0(x1), and the token after a kept x1 follow p1. Always-accept (out = x1) and
    always-resample (keep rate 0) are far outside the bounds."""
    loaded = load_model(str(hf_checkpoints["g4_plain"][0]), "float32")  # vocabulary 96
    config, params, precision = loaded.checkpoint.config, loaded.checkpoint.params, loaded.policy.precision()
    rows, first = 6000, 7
    logits, _ = forward_jit(params, init_device_state(config, 1, 8, precision).cache, jnp.asarray([[first]]),
                            jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32), config=config, precision=precision)
    temperature = 0.5
    p0 = np.asarray(jax.nn.softmax(logits[0] / temperature), np.float64)
    x1 = int(np.argmax(p0))
    x2 = int(np.argsort(p0)[-2])
    both, _ = forward_jit(params, init_device_state(config, 1, 8, precision).cache, jnp.asarray([[first, x1]]),
                          jnp.zeros(1, jnp.int32), jnp.full(1, 2, jnp.int32), config=config, precision=precision,
                          logits="all")
    p1 = np.asarray(jax.nn.softmax(both[0, 1] / temperature), np.float64)

    device = init_device_state(config, rows, 8, precision, max(SPEC_KS))
    keys = jax.random.key_data(jax.random.split(jax.random.key(0), rows))
    sampling = dataclasses.replace(SamplingState.empty(rows, config.vocab_size), temperature=jnp.full(rows, temperature), key=keys)
    device = dataclasses.replace(device, sampling=sampling, tokens=jnp.full(rows, first, jnp.int32),
                                 remaining=jnp.full(rows, 4, jnp.int32))
    proposals = jnp.tile(jnp.asarray([[x1, x2]], jnp.int32), (rows, 1))
    _, (drawn, accepted, *_) = verify_rows(params, device, jnp.zeros(rows, bool), jnp.arange(rows), proposals,
                                           jnp.full(rows, 2, jnp.int32), config=config, precision=precision, kv_len=8)
    drawn, accepted = np.asarray(drawn), np.asarray(accepted)

    def total_variation(samples, p):
        return 0.5 * np.abs(np.bincount(samples, minlength=len(p)) / len(samples) - p).sum()

    bound = 0.08  # ~0.04 expected from 6,000 draws over 96 tokens
    assert total_variation(drawn[:, 0], p0) < bound
    assert 1 - p0[x1] > 3 * bound  # what always-accept would show
    kept = accepted >= 1
    sigma = np.sqrt(p0[x1] * (1 - p0[x1]) / rows)
    assert abs(kept.mean() - p0[x1]) < 4 * sigma and p0[x1] > 5 * sigma
    assert np.all(drawn[kept, 0] == x1) and np.all(drawn[~kept, 0] != x1)  # rejected: from p0 without x1
    assert total_variation(drawn[kept, 1], p1) < 0.5 * bound * np.sqrt(rows / kept.sum()) + 0.05


def test_server_extra_usage_metrics_and_refusals(engine, loaded):
    """The real server and the official client: the `speculative` extra gives the plain tokens,
    streamed or not, with the accepted-length distribution in usage and in /metrics; bad values
    are 400s naming the parameter."""
    settings = ServerSettings(served_model_name="tiny")
    prompt = [int(t) for t in _prompts(1, seed=7)[0]]
    with running_server(create_app(engine, loaded.tokenizer, settings)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)

        def complete(spec, **extra):
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                             extra_body={"return_token_ids": True, "ignore_eos": True,
                                                         "speculative": spec}, **extra)

        plain = complete({"method": "off"})
        spec = complete({"method": "ngram", "k": 8})
        assert spec.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
        drafted = complete({"method": "draft", "k": 4})
        assert drafted.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
        assert plain.usage.model_extra["speculative"] is None
        usage = spec.usage.model_extra["speculative"]
        assert usage["steps"] == sum(usage["accepted_lengths"]) > 0
        assert usage["accepted_tokens"] == sum(n * c for n, c in enumerate(usage["accepted_lengths"]))
        chunks = list(complete({"k": 2}, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == spec.choices[0].text
        assert chunks[-1].usage.model_extra["speculative"]["steps"] > 0
        steps = read_metric(url, "gemmax:spec_accepted_per_step_count")
        assert steps == (usage["steps"] + chunks[-1].usage.model_extra["speculative"]["steps"]
                         + drafted.usage.model_extra["speculative"]["steps"])
        assert read_metric(url, "gemmax:spec_accepted_per_step_bucket", {"le": "8.0"}) == steps
        for spec_extra, param in (({"method": "ngram", "k": 3}, "speculative.k"),
                                  ({"method": "medusa"}, "speculative.method"), ({"depth": 2}, None)):
            with pytest.raises(openai.BadRequestError) as refused:
                complete(spec_extra)
            assert refused.value.status_code == 400
            if param:
                assert refused.value.body["param"] == param


@pytest.fixture(scope="module")
def builtin_engine():
    loaded = load_model(None, "float32")  # the built-in Gemma 3 270M
    # KV buckets (256, 512): the verify steps choose one on the device (`verify_rows`' tuple of bounds)
    eng = BatchEngine(loaded, max_model_len=512, max_batch=1, buckets=(64,), steps_per_dispatch=4,
                      speculation=PLAIN, warm_up=False).start()
    assert eng.wait_ready(900)
    yield eng, loaded.tokenizer
    eng.shutdown(drain_timeout=5)


def test_builtin_model_greedy_speculative_equals_plain(builtin_engine):
    """The real model on a copying prompt, where prompt lookup's proposals are often right: k = 2, 4
    and 8 each give the plain tokens, with proposals kept, while the context crosses from the first
    KV bucket (256 slots) into the second."""
    engine, tokenizer = builtin_engine
    text = ("The keeper wound the clock every four hours, wrote the weather in the log three times a day, "
            "and polished the brass lens until it shone. In winter he walked the breakwater at dawn to clear "
            "the ice from the lamp room windows, and in summer he painted the railings white again. On "
            "Sundays his daughter rowed out from the village with bread, letters and the newspaper, and "
            "stayed until the tide turned. When storms kept her ashore he read the old almanacs by the stove "
            "and mended the nets that hung in the boathouse.")
    prompt = tokenizer.encode(f"Copy this text twice.\nText: {text}\nCopy 1: {text}\nCopy 2:")
    assert len(prompt) < 256 < len(prompt) + 48
    reference = _run(engine, prompt, 48, PLAIN).wait().token_ids
    for k in SPEC_KS:
        result = _run(engine, prompt, 48, Speculation("ngram", k)).wait()
        assert result.token_ids == reference, f"k={k}"
        assert result.speculation.accepted > 0, result.speculation
    # One verify program per k (one decode group), compiled by these requests (the engine skips the
    # warm-up) and run in both KV buckets, where a program per bucket would make it two per k.
    assert engine.steps.verify_rows.size() == len(SPEC_KS)
