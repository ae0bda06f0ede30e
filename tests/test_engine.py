"""The batching engine against the single-request reference path (`gemmax generate`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import shutil
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arrival_watch import ArrivalWatch
from engine_faults import consume_the_state_and_fail, fail_the_next_rebuild, fail_the_start_of
from gemmax.engine import engine as engine_module
from gemmax.engine.api import GenerationRequest, PromptTooLong, SamplingParams
from gemmax.engine.degeneracy import check_degeneracy
from gemmax.engine.engine import BatchEngine
from gemmax.engine.executables import STORE_DIR
from gemmax.engine.generate import _step, generate
from gemmax.engine.loading import load_model
from gemmax.engine.sampling import SamplingState
from gemmax.engine.shapes import plan_chunks
from gemmax.model.kv_cache import init_cache


@pytest.fixture(scope="module")
def loaded(hf_checkpoints):
    return load_model(str(hf_checkpoints["g4_shared"][0]), "float32")


@pytest.fixture(scope="module")
def engine(loaded):
    # the session's compile cache (tests/conftest.py): tests/test_prefix_cache.py's engine has these
    # shapes and loads what this one compiled
    eng = BatchEngine(loaded, max_model_len=96, max_batch=3, buckets=(8, 32), steps_per_dispatch=3).start()
    assert eng.wait_ready(300)
    yield eng
    eng.shutdown(drain_timeout=5)


def _reference(loaded, prompt, max_tokens, sampling=SamplingParams()):
    ck = loaded.checkpoint
    return generate(ck.params, ck.config, list(prompt), max_tokens, sampling, loaded.policy.precision(), stop_ids=())


def test_plan_chunks_covers_long_prompts_with_declared_buckets():
    assert plan_chunks(5, (8, 32)) == [(5, 8)]
    assert plan_chunks(32, (8, 32)) == [(32, 32)]
    assert plan_chunks(70, (8, 32)) == [(32, 32), (32, 32), (6, 8)]
    default = (32, 128, 512, 2048)
    assert plan_chunks(521, default) == [(512, 512), (9, 32)]  # not one 2048 chunk
    assert plan_chunks(2047, default) == [(2047, 2048)]
    assert plan_chunks(2057, default) == [(2048, 2048), (9, 32)]

    def cost(plan):  # bucket tokens + one smallest bucket per chunk, the planner's objective
        return sum(bucket for _, bucket in plan) + 32 * len(plan)

    for length in range(1, 5000):
        plan = plan_chunks(length, default)
        assert sum(real for real, _ in plan) == length and all(real == b for real, b in plan[:-1])
        assert 0 < plan[-1][0] <= plan[-1][1] and all(b in default for _, b in plan)
        # never worse than the largest chunks, then the smallest bucket that holds the rest
        full, rest = divmod(length - 1, 2048)
        rest += 1
        assert cost(plan) <= cost([(2048, 2048)] * full + [(rest, next(b for b in default if b >= rest))])


def test_generate_pads_prompts_to_a_few_compiled_shapes_with_the_unpadded_tokens(loaded):
    """`gemmax generate` prefills a prompt padded to a power of two (at least 16): prompts of 3, 11, 16
    and 17 tokens compile two prefills and one decode step, not one prefill per length, and every
    prompt gets the greedy tokens of the same steps run on the unpadded prompt."""
    ck, precision = loaded.checkpoint, loaded.policy.precision()

    def unpadded(prompt, max_tokens):
        cache = init_cache(ck.config, 1, 256, precision.kv_cache)
        state, tokens, start, out = SamplingState.empty(1, ck.config.vocab_size), [prompt], 0, []
        for _ in range(max_tokens):
            ids, cache, state = _step(
                ck.params, cache, jnp.asarray(tokens, jnp.int32), jnp.asarray([start], jnp.int32),
                jnp.asarray([len(tokens[0])], jnp.int32), state, config=ck.config, precision=precision)
            start += len(tokens[0])
            tokens = [[int(np.asarray(ids)[0])]]
            out.append(tokens[0][0])
        return out

    prompts = [list(range(1, 1 + n)) for n in (3, 11, 16, 17)]
    expected = [unpadded(p, 5) for p in prompts]
    _step.clear_cache()
    assert [_reference(loaded, p, 5) for p in prompts] == expected
    assert _step._cache_size() == 3  # prefill 16, prefill 32, decode


def test_batched_greedy_equals_generate_alone_for_any_mix(engine, loaded):
    """Mixed prompt lengths (incl. > largest bucket: chunked prefill), staggered arrivals, mixed
    max_tokens, more requests than slots: every request gets exactly its solo greedy tokens."""
    rng = np.random.default_rng(0)
    lengths = [3, 9, 40, 1, 17, 70, 5]
    budgets = [20, 5, 24, 12, 8, 10, 16]
    prompts = [tuple(int(t) for t in rng.integers(3, 128, n)) for n in lengths]
    handles = []
    for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
        handles.append(engine.submit(GenerationRequest(prompt, max_tokens=budget, ignore_eos=True)))
        if i % 3 == 2:
            time.sleep(0.05)  # arrive while others decode
    for handle, prompt, budget in zip(handles, prompts, budgets, strict=True):
        result = handle.wait()
        assert result.finish_reason == "length"
        assert list(result.token_ids) == _reference(loaded, prompt, budget), f"prompt len {len(prompt)}"
        assert not result.timings.uncompiled_shape  # warm-up compiled every shape this needed


def test_prompts_arriving_together_prefill_in_one_forward_with_their_solo_tokens(engine, loaded):
    """Requests queued at one moment (the engine's lock held while they are submitted, so one
    admission sees them all) whose whole prompts fit a batched shape (3 slots, buckets 8 and 32:
    groups of 2 and 3 prompts of up to 8 tokens) prefill in one forward; greedy and seeded sampled
    requests alike give exactly their tokens alone, a prompt too long for a group prefills alone,
    and a group of 2 arrives while others decode."""
    assert engine.shapes.prefill_groups == ((2, 8), (3, 8))
    sampled = SamplingParams(temperature=1.0, seed=321)
    rng = np.random.default_rng(5)
    wave = [(tuple(int(t) for t in rng.integers(3, 128, n)), budget, sampling)
            for n, budget, sampling in ((2, 9, SamplingParams()), (8, 14, sampled), (5, 4, SamplingParams()),
                                        (20, 6, SamplingParams()), (1, 12, sampled), (7, 5, SamplingParams()))]
    with engine._lock:  # the first three take the 3 slots together; the rest queue for slots
        handles = [engine.submit(GenerationRequest(p, n, s, ignore_eos=True)) for p, n, s in wave]
    again = engine.submit(GenerationRequest(wave[1][0], wave[1][1], sampled, ignore_eos=True))
    results = [h.wait() for h in handles]
    for (prompt, budget, sampling), result in zip(wave, results, strict=True):
        if sampling.temperature == 0:
            assert list(result.token_ids) == _reference(loaded, prompt, budget), len(prompt)
        assert not result.timings.uncompiled_shape
    assert [r.timings.prefill_batch for r in results[:3]] == [3, 3, 3]
    assert results[3].timings.prefill_batch == 1 and results[1].timings.prefill_bucket == 8
    assert results[1].token_ids == again.wait().token_ids  # the seeded row drew its tokens as it does later
    # the 4th waited for the 3rd (4 tokens); the 5th and 6th then took the next two free slots together
    assert {r.timings.prefill_batch for r in results[4:]} <= {1, 2}
    # prompts of two chunks (8 + the rest) prefill together chunk by chunk
    assert plan_chunks(12, engine.shapes.buckets) == [(8, 8), (4, 8)]
    two = [(tuple(int(t) for t in rng.integers(3, 128, n)), budget) for n, budget in ((12, 7), (15, 9), (10, 5))]
    with engine._lock:
        handles = [engine.submit(GenerationRequest(p, n, ignore_eos=True)) for p, n in two]
    for (prompt, budget), handle in zip(two, handles, strict=True):
        result = handle.wait()
        assert (result.timings.prefill_batch, result.timings.prefill_bucket) == (3, 16)
        assert list(result.token_ids) == _reference(loaded, prompt, budget), len(prompt)


def test_a_burst_at_an_idle_engine_prefills_as_one_group(engine, loaded, monkeypatch):
    """Requests that reach an idle engine a few ms apart (clients that all sent their next request
    when their previous ones ended together) are admitted together and prefill in one forward, not
    the first alone and the rest after it. The window is widened here (quiet 50 ms, at most 0.5 s)
    so that a loaded test machine's 5 ms sleeps stay inside it."""
    monkeypatch.setattr(engine_module, "BURST_QUIET_SECONDS", 0.05)
    monkeypatch.setattr(engine_module, "BURST_WINDOW_SECONDS", 0.5)
    prompts = [(11, 12, 13), (21, 22), (31, 32, 33, 34)]
    handles = []
    for prompt in prompts:
        handles.append(engine.submit(GenerationRequest(prompt, 5, ignore_eos=True)))
        time.sleep(0.005)
    results = [h.wait() for h in handles]
    assert [r.timings.prefill_batch for r in results] == [3, 3, 3]
    for prompt, result in zip(prompts, results, strict=True):
        assert list(result.token_ids) == _reference(loaded, prompt, 5)


def test_fewer_prompts_than_the_smallest_batched_shape_prefill_alone(engine, loaded, monkeypatch):
    """With a batched shape of 3 rows only, 2 prompts queued together prefill one at a time (the shape
    would run an idle row) and 3 prefill together; every output is the solo path's."""
    monkeypatch.setattr(engine, "shapes", dataclasses.replace(engine.shapes, prefill_groups=((3, 8),)))
    for prompts, batch in (([(11, 12, 13), (21, 22)], 1), ([(11, 12, 13), (21, 22), (31, 32, 33, 34)], 3)):
        with engine._lock:  # one admission sees them all
            handles = [engine.submit(GenerationRequest(prompt, 4, ignore_eos=True)) for prompt in prompts]
        results = [h.wait() for h in handles]
        assert [r.timings.prefill_batch for r in results] == [batch] * len(prompts)
        for prompt, result in zip(prompts, results, strict=True):
            assert list(result.token_ids) == _reference(loaded, prompt, 4)


def test_streamed_events_equal_final_tokens_and_usage_timings(engine):
    handle = engine.submit(GenerationRequest((5, 6, 7), max_tokens=7, ignore_eos=True))
    streamed = [event.token_id for event in handle]
    result = handle.result
    assert tuple(streamed) == result.token_ids and result.completion_tokens == 7
    t = result.timings
    assert t.prefill_bucket == 8 and t.pad_tokens == 5
    assert 0 <= t.queue_seconds <= t.time_to_first_token_seconds
    assert t.decode_tokens_per_second > 0


def test_a_decode_dispatch_copies_nothing_from_the_host_once_its_values_were_seen(engine):
    """A decode step sends nothing from host to device once its rows, flags and `advance` were seen:
    they are device arrays made once per distinct value (`BatchEngine._on_device`), not a fresh copy
    each step (a round trip each on an accelerator: docs/gpu.md, "Many users on a TPU v5e"). JAX's
    transfer guard, on this thread only, fails any host-to-device copy of the guarded dispatches; the
    engine's own loop is idle meanwhile (no request is running), for every slot and for a group."""
    want = np.zeros(engine.max_batch, np.bool_)
    for rows in (None, np.arange(2, dtype=np.int32)):
        jax.block_until_ready(engine._dispatch_decode(1, want, rows)[0])  # the values are seen once
        with jax.transfer_guard_host_to_device("disallow_explicit"):
            outputs, _ = engine._dispatch_decode(2, want, rows)
        jax.block_until_ready(outputs)
    # and the engine serves as before
    handle = engine.submit(GenerationRequest((5, 6, 7), max_tokens=5, ignore_eos=True))
    assert handle.wait().completion_tokens == 5


def test_cancel_frees_slot_and_leaves_others_untouched(engine, loaded):
    keep = (11, 12, 13, 14)
    victim = engine.submit(GenerationRequest((20, 21), max_tokens=80, ignore_eos=True))
    other = engine.submit(GenerationRequest(keep, max_tokens=30, ignore_eos=True))
    first = next(iter(victim))
    assert first.token_id >= 0
    victim.cancel()
    for _ in victim:
        pass
    assert victim.result.finish_reason == "cancelled"
    assert victim.result.completion_tokens < 80
    assert list(other.wait().token_ids) == _reference(loaded, keep, 30)
    deadline = time.monotonic() + 1.0
    while engine.stats().slots_in_use and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats().slots_in_use == 0


def test_seeds_reproduce_and_top1_sampling_is_greedy(engine, loaded):
    prompt = (7, 8, 9, 10)
    sampled = SamplingParams(temperature=1.0, seed=1234)
    runs = [engine.submit(GenerationRequest(prompt, 24, sampled, ignore_eos=True)) for _ in range(2)]
    other_seed = engine.submit(GenerationRequest(prompt, 24, dataclasses.replace(sampled, seed=99), ignore_eos=True))
    a, b = (h.wait().token_ids for h in runs)
    assert a == b
    assert other_seed.wait().token_ids != a  # 24 draws at temperature 1 on a 128-token vocab
    top1 = engine.submit(GenerationRequest(prompt, 24, SamplingParams(temperature=0.8, top_k=1, seed=5), ignore_eos=True))
    assert list(top1.wait().token_ids) == _reference(loaded, prompt, 24)
    # temperature 0 ignores the seed
    greedy_seeded = engine.submit(GenerationRequest(prompt, 24, SamplingParams(seed=77), ignore_eos=True))
    assert list(greedy_seeded.wait().token_ids) == _reference(loaded, prompt, 24)


def test_stop_ids_min_tokens_and_logprobs(engine, loaded):
    prompt = (30, 31, 32)
    greedy = _reference(loaded, prompt, 12)
    stop_at = greedy[4]
    first_index = greedy.index(stop_at)
    result = engine.submit(GenerationRequest(prompt, 12, stop_token_ids=(stop_at,))).wait()
    assert result.finish_reason == "stop" and result.stop_token_id == stop_at
    assert list(result.token_ids) == greedy[:first_index]
    forced = engine.submit(GenerationRequest(prompt, 12, stop_token_ids=(stop_at,), min_tokens=12)).wait()
    assert list(forced.token_ids) == greedy
    handle = engine.submit(GenerationRequest(prompt, 4, logprobs=3, ignore_eos=True))
    events = list(handle)
    for event in events:
        assert len(event.top_logprobs) == 3
        assert event.top_logprobs[0][1] >= event.top_logprobs[-1][1]
        assert event.logprob <= 0 and event.top_logprobs[0][0] == event.token_id  # greedy: chosen = top-1


def test_prompt_too_long_is_refused_with_numbers(engine):
    with pytest.raises(PromptTooLong, match="96") as info:
        engine.submit(GenerationRequest(tuple(range(3, 99)), max_tokens=1))
    assert info.value.prompt_tokens == 96 and info.value.max_model_len == 96


def test_length_capped_by_max_model_len(engine):
    result = engine.submit(GenerationRequest(tuple([5] * 90), max_tokens=50, ignore_eos=True)).wait()
    assert result.finish_reason == "length" and result.completion_tokens == 6  # 90 + 6 = max_model_len


def test_concurrent_submitters_all_complete(engine, loaded):
    prompt = (40, 41, 42, 43, 44)
    expected = _reference(loaded, prompt, 10)
    results = []

    def worker():
        results.append(engine.submit(GenerationRequest(prompt, 10, ignore_eos=True)).wait())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 8 and all(list(r.token_ids) == expected for r in results)


def test_model_forced_into_a_loop_is_flagged_degenerate(loaded):
    """Zeroing the final norm makes every logit 0: greedy picks token 0 forever."""
    params = dict(loaded.checkpoint.params)
    params["final_norm"] = jnp.zeros_like(params["final_norm"])
    broken = dataclasses.replace(loaded, checkpoint=dataclasses.replace(loaded.checkpoint, params=params))
    eng = BatchEngine(broken, max_model_len=64, max_batch=1, buckets=(8,), steps_per_dispatch=4, warm_up=False).start()
    try:
        assert eng.wait_ready(300)
        result = eng.submit(GenerationRequest((3, 4, 5), max_tokens=32, ignore_eos=True)).wait()
    finally:
        eng.shutdown(1)
    assert set(result.token_ids) == {0}
    assert result.degeneracy.degenerate and "period 1" in result.degeneracy.reason


def test_without_warm_up_each_shape_compiles_on_its_first_use(loaded, monkeypatch):
    """`warm_up=False` (`serve --no-warm-up`): ready with no program compiled; the first request of a
    shape compiles it and says so, the next one of that shape does not, and all give `generate`'s
    tokens. A request decoding alone when a second one arrives waits for the two-row decode step's
    first compile, and says so too."""
    eng = BatchEngine(loaded, max_model_len=64, max_batch=2, buckets=(8,), steps_per_dispatch=3, warm_up=False).start()
    try:
        assert eng.wait_ready(300)
        report = eng.warmup_report
        assert report["warm_up"] is False and report["shapes"] == 0 and report["shapes_declared"] > 0
        assert eng.steps.summary()["executables"] == 0  # nothing compiled or loaded before ready
        prompt, other = (5, 9, 2, 7, 1), (8, 3, 3, 6)
        first, second = (eng.submit(GenerationRequest(prompt, max_tokens=7, ignore_eos=True)).wait() for _ in range(2))
        assert first.timings.uncompiled_shape and not second.timings.uncompiled_shape
        assert list(first.token_ids) == list(second.token_ids) == _reference(loaded, prompt, 7)
        # every one-row program is compiled now; the two-row decode step is not: a second request
        # arrives during the first one's second decode dispatch (tests/arrival_watch.py)
        watch = ArrivalWatch(eng, monkeypatch, GenerationRequest(other, max_tokens=12, ignore_eos=True))
        watch.arm()
        running = eng.submit(GenerationRequest(prompt, max_tokens=40, ignore_eos=True)).wait()
        joining = watch.handle.wait()
        assert running.timings.uncompiled_shape and joining.timings.uncompiled_shape
        assert list(running.token_ids) == _reference(loaded, prompt, 40)
        assert list(joining.token_ids) == _reference(loaded, other, 12)
    finally:
        eng.shutdown(1)


def test_degeneracy_check_judges_loops_collapse_and_normal_text():
    assert check_degeneracy([1, 2, 3, 4, 5, 6, 7, 8, 9, 10] + [7, 8] * 10).degenerate
    assert not check_degeneracy([1, 2, 3] * 3).degenerate  # too short to judge
    babble = [int(t) for t in np.random.default_rng(1).integers(0, 4, 100)]  # 4 tokens, no tail loop
    assert check_degeneracy(babble).reason == "token collapse: 4 distinct tokens in 100"
    natural = list(np.random.default_rng(0).integers(0, 1000, 200))
    assert not check_degeneracy(natural).degenerate


def test_restart_with_warm_compile_cache_hits_it(hf_checkpoints, tmp_path):
    """Two fresh processes share a cache dir: the first misses and writes it, the second hits it."""
    script = (
        "import json, sys; from gemmax.engine.loading import load_model; from gemmax.engine.engine import BatchEngine;"
        "e = BatchEngine(load_model(sys.argv[1], 'float32'), max_model_len=64, max_batch=2, buckets=(16,),"
        " compile_cache_dir=sys.argv[2]).start(background=False); print(json.dumps(e.warmup_report)); e.shutdown(1)"
    )
    reports, logs = [], []

    def start() -> None:
        out = subprocess.run([sys.executable, "-c", script, str(hf_checkpoints["g4_plain"][0]), str(tmp_path)],
                             capture_output=True, text=True, timeout=600, check=True)
        reports.append(json.loads(out.stdout.strip().splitlines()[-1]))
        logs.append(out.stderr)

    start()
    start()
    cold, warm = reports
    assert cold["cache_misses"] > 0 and not cold["cache_hit"]
    assert warm["cache_hit"] and warm["cache_misses"] == 0
    # Corrupted entries of JAX's own cache (one truncated, one overwritten) are detected, logged once and
    # replaced. Without the executable store (tests/test_executables.py) every shape goes through them.
    shutil.rmtree(tmp_path / STORE_DIR)
    entries = sorted(tmp_path.glob("*-cache"))
    entries[0].write_bytes(entries[0].read_bytes()[: len(entries[0].read_bytes()) // 2])
    entries[1].write_bytes(b"\0" * 64)
    start()
    scrubbed = reports[-1]
    assert scrubbed["corrupt_entries_replaced"] == 2 and scrubbed["cache_misses"] == 2
    assert scrubbed["cache_hits"] == warm["cache_hits"] - 2
    assert logs[-1].count("corrupted entries removed") == 1 and entries[0].name in logs[-1]
    assert "Error reading persistent compilation cache" not in logs[-1]
    from gemmax.engine.compile_cache import scrub

    assert entries[0].exists() and entries[1].exists() and scrub(tmp_path) == []  # written anew, valid


def test_cache_export_import_round_trip(tmp_path):
    from typer.testing import CliRunner

    from gemmax.cli import app

    source = tmp_path / "xla"
    (source / "sub").mkdir(parents=True)
    (source / "entry-a").write_bytes(b"compiled-a")
    (source / "sub" / "entry-b").write_bytes(b"compiled-b")
    runner = CliRunner()
    tarball = tmp_path / "cache.tar.gz"
    out = runner.invoke(app, ["cache", "export", str(tarball), "--cache-dir", str(source)])
    assert out.exit_code == 0, out.output
    restored = tmp_path / "restored"
    out = runner.invoke(app, ["cache", "import", str(tarball), "--cache-dir", str(restored)])
    assert out.exit_code == 0 and "restored 2 files" in out.output
    assert (restored / "entry-a").read_bytes() == b"compiled-a"
    assert (restored / "sub" / "entry-b").read_bytes() == b"compiled-b"
    missing = runner.invoke(app, ["cache", "export", str(tmp_path / "x.tgz"), "--cache-dir", str(tmp_path / "none")])
    assert missing.exit_code != 0


def test_chunked_long_prompt_samples_like_generate(engine, loaded):
    """A prompt longer than the largest bucket prefills in 3 chunks; seeded sampling with a presence
    penalty still equals the single-request path (chunks must not advance the sampling state)."""
    prompt = tuple(int(t) for t in np.random.default_rng(5).integers(3, 128, 70))
    sampling = SamplingParams(temperature=0.9, seed=21, presence_penalty=0.7)
    result = engine.submit(GenerationRequest(prompt, 12, sampling, ignore_eos=True)).wait()
    assert result.timings.prefill_bucket == 32 + 32 + 8
    assert list(result.token_ids) == _reference(loaded, prompt, 12, sampling)


def _fail_prefills_of(engine, monkeypatch, first_token: int, message: str):
    """Make the engine's prefill raise for prompts that start with `first_token`; returns the original."""
    original = engine._run_prefill

    def broken(tokens, *args):
        if tokens[0, 0] == first_token:
            raise RuntimeError(message)
        return original(tokens, *args)

    monkeypatch.setattr(engine, "_run_prefill", broken)
    return original


def test_a_failing_prefill_fails_its_request_and_the_engine_keeps_serving(engine, loaded, monkeypatch):
    original = _fail_prefills_of(engine, monkeypatch, 99, "simulated device fault")
    failed = engine.submit(GenerationRequest((99, 3, 4), 5, ignore_eos=True)).wait()
    assert failed.finish_reason == "error" and "simulated device fault" in failed.error
    monkeypatch.setattr(engine, "_run_prefill", original)
    ok = engine.submit(GenerationRequest((7, 3, 4), 5, ignore_eos=True)).wait()
    assert ok.finish_reason == "length" and list(ok.token_ids) == _reference(loaded, (7, 3, 4), 5)
    assert engine.ready


def test_a_failing_batched_prefill_fails_its_group_alone(engine, loaded, monkeypatch):
    """A batched prefill that raises ends the requests of its group with the error; a request
    decoding meanwhile, and the next group, are untouched."""
    original = engine._run_prefill_rows

    def broken(tokens, *args):
        if 98 in tokens[:, 0]:
            raise RuntimeError("simulated batched fault")
        return original(tokens, *args)

    running = engine.submit(GenerationRequest((7, 3, 4), 30, ignore_eos=True))
    next(iter(running))
    monkeypatch.setattr(engine, "_run_prefill_rows", broken)
    with engine._lock:
        group = [engine.submit(GenerationRequest((first, 5), 4, ignore_eos=True)) for first in (98, 97)]
    assert [h.wait().finish_reason for h in group] == ["error", "error"]
    assert all("simulated batched fault" in h.result.error for h in group)
    with engine._lock:
        after = [engine.submit(GenerationRequest((first, 5), 4, ignore_eos=True)) for first in (96, 95)]
    for handle, first in zip(after, (96, 95), strict=True):
        result = handle.wait()
        assert result.timings.prefill_batch == 2 and list(result.token_ids) == _reference(loaded, (first, 5), 4)
    assert list(running.wait().token_ids) == _reference(loaded, (7, 3, 4), 30) and engine.ready


def test_a_decode_step_that_consumed_the_state_and_failed_ends_the_running_requests_and_serving_goes_on(
        engine, loaded, monkeypatch):
    """A decode step that fails after its donated state is gone (XLA consumes it when a program fails):
    the running request ends with the error, the engine builds a new state before it finishes the
    request's slot (which writes to the state), and the next request is served as before."""
    original = engine._forward

    def consumed_then_failed(rows):
        consume_the_state_and_fail(engine)

    running = engine.submit(GenerationRequest((7, 3, 4), 30, ignore_eos=True))
    next(iter(running))
    monkeypatch.setattr(engine, "_forward", consumed_then_failed)
    failed = _ended(engine, running)
    assert failed.finish_reason == "error" and "simulated fault after donation" in failed.error
    monkeypatch.setattr(engine, "_forward", original)
    ok = engine.submit(GenerationRequest((7, 3, 4), 5, ignore_eos=True)).wait()
    assert list(ok.token_ids) == _reference(loaded, (7, 3, 4), 5) and engine.ready and engine.error is None


def _ended(engine, handle, seconds: float = 120):
    """The result of `handle`, failing the test if it has not ended within `seconds`."""
    ended = []
    waiting = threading.Thread(target=lambda: ended.append(handle.wait()), daemon=True)
    waiting.start()
    waiting.join(seconds)
    assert ended, f"{handle.request_id} never ended (engine loop error: {engine.error!r})"
    return ended[0]


def test_a_start_in_a_group_that_took_the_state_requeues_the_prompts_prefilled_after_it(engine, loaded, monkeypatch):
    """Two prompts prefilled in one forward; starting the first fails after the state went (a drafter's
    prefill can consume it). The first ends with the error, the engine builds a new state, and the
    second, whose KV went with the old cache, goes back to the queue, is prefilled again (alone now)
    and decodes exactly as `generate`: it neither starts on the new state without its KV nor fails."""
    started = fail_the_start_of(engine, monkeypatch, lambda request: request.prompt_ids[0] == 94)
    with engine._lock:  # one admission, one batched group
        group = [engine.submit(GenerationRequest((first, 5), 4, ignore_eos=True)) for first in (94, 93)]
    failed, requeued = (_ended(engine, handle) for handle in group)
    assert started[0] == 2  # the failing start was in a group of two
    assert failed.finish_reason == "error" and "simulated fault after donation" in failed.error
    assert requeued.finish_reason == "length" and requeued.timings.prefill_batch == 1
    assert list(requeued.token_ids) == _reference(loaded, (93, 5), 4) and engine.error is None


def test_after_a_group_start_took_the_state_no_later_prompt_overtakes_the_requeued_ones(engine, loaded, monkeypatch):
    """One admission takes a batched group of two and, after it, a prompt that prefills alone; starting
    the group's first prompt takes the state. The group's second prompt goes back to the queue, and so
    does the later prompt (this engine has no prefix cache, whose new pool would force it): the next
    admission prefills them in arrival order, so the requeued prompt starts first (before 2026-12-07 the
    later prompt was prefilled at once on the new state, ahead of it)."""
    started = fail_the_start_of(engine, monkeypatch, lambda request: request.prompt_ids[0] == 88)
    order, failing_begin = [], engine._begin

    def begin(slot_index, slot, *rest):  # the order in which prefilled prompts start
        order.append(slot.request.prompt_ids[0])
        return failing_begin(slot_index, slot, *rest)

    monkeypatch.setattr(engine, "_begin", begin)
    rng = np.random.default_rng(29)
    later_prompt = (86, *(int(t) for t in rng.integers(3, 128, 19)))  # 20 tokens: prefilled alone
    with engine._lock:  # one admission: the group of two, then the prompt alone
        group = [engine.submit(GenerationRequest((first, 5), 4, ignore_eos=True)) for first in (88, 87)]
        later = engine.submit(GenerationRequest(later_prompt, 4, ignore_eos=True))
    failed, requeued, alone = (_ended(engine, handle) for handle in (*group, later))
    assert started == [2] and failed.finish_reason == "error"
    assert list(requeued.token_ids) == _reference(loaded, (87, 5), 4)
    assert list(alone.token_ids) == _reference(loaded, later_prompt, 4) and engine.error is None
    assert order == [88, 87, 86]


def test_a_rebuild_that_fails_after_a_group_start_took_the_state_is_tried_again(engine, loaded, monkeypatch):
    """Starting a prompt of a batched group takes the state, and the rebuild that follows fails once,
    inside the group (its error reaches the admission's handler as the group's failure). The engine
    has no state then: it builds one again instead of leaving every later request to fail against
    none while it reports ready. Both prompts of the group end with the error; the next request is
    served exactly."""
    started = fail_the_start_of(engine, monkeypatch, lambda request: request.prompt_ids[0] == 90)
    fail_the_next_rebuild(engine, monkeypatch)
    with engine._lock:  # one admission, one batched group
        group = [engine.submit(GenerationRequest((first, 5), 4, ignore_eos=True)) for first in (90, 89)]
    results = [_ended(engine, handle) for handle in group]
    assert started == [2] and [r.finish_reason for r in results] == ["error", "error"]
    assert all("simulated rebuild failure" in r.error for r in results)
    ok = engine.submit(GenerationRequest((89, 5), 4, ignore_eos=True)).wait()
    assert list(ok.token_ids) == _reference(loaded, (89, 5), 4) and engine.ready and engine.error is None


def test_a_rebuild_that_fails_during_an_admission_ends_the_prompts_it_had_not_started(engine, loaded, monkeypatch):
    """A prefill takes the state with it and the rebuild that follows fails once: the fault escapes the
    admission's handler. The prompt admitted after the failing one, taken from the queue but in no
    slot yet, ends with that fault instead of waiting forever; the loop's handler rebuilds, and the
    engine serves the next request exactly."""
    rng = np.random.default_rng(23)
    doomed, later = ((first, *(int(t) for t in rng.integers(3, 128, 19))) for first in (92, 91))  # 20 tokens: alone
    original_prefill = engine._run_prefill

    def prefill(tokens, *args):
        if tokens[0, 0] == 92:
            consume_the_state_and_fail(engine)
        return original_prefill(tokens, *args)

    monkeypatch.setattr(engine, "_run_prefill", prefill)
    fail_the_next_rebuild(engine, monkeypatch)
    with engine._lock:  # one admission takes both, the failing one first
        handles = [engine.submit(GenerationRequest(prompt, 4, ignore_eos=True)) for prompt in (doomed, later)]
    failed, dropped = (_ended(engine, handle) for handle in handles)
    assert failed.finish_reason == "error" and dropped.finish_reason == "error"
    assert "simulated rebuild failure" in dropped.error
    monkeypatch.setattr(engine, "_run_prefill", original_prefill)
    ok = engine.submit(GenerationRequest(later, 4, ignore_eos=True)).wait()
    assert list(ok.token_ids) == _reference(loaded, later, 4) and engine.ready and engine.error is None


@contextlib.contextmanager
def _a_group_held_in_its_forward(loaded, monkeypatch, drain_timeout: float):
    """An engine whose batched prefill waits in its forward until the block ends, and a group of two
    prompts (one admission) in it: yields (engine, the group's handles, a thread that shuts the engine
    down with `drain_timeout`, not started) once the forward began. Leaving releases the forward, and
    shuts the engine down where the test failed before starting that thread. The module engine's
    shapes: nothing new compiles (the session's compile cache and store)."""
    eng = BatchEngine(loaded, max_model_len=96, max_batch=3, buckets=(8, 32), steps_per_dispatch=3).start()
    assert eng.wait_ready(300)
    entered, release, original = threading.Event(), threading.Event(), eng._run_prefill_rows

    def held(*args, **kwargs):
        entered.set()
        assert release.wait(60)
        return original(*args, **kwargs)

    monkeypatch.setattr(eng, "_run_prefill_rows", held)
    closing = threading.Thread(target=eng.shutdown, kwargs={"drain_timeout": drain_timeout})
    try:
        with eng._lock:  # one admission, one batched group
            group = [eng.submit(GenerationRequest((first, 5), 12, ignore_eos=True)) for first in (85, 84)]
        assert entered.wait(60), "the group's forward never began"
        yield eng, group, closing
    finally:
        release.set()
        if not closing.is_alive():  # a failure before the shutdown started: stop the engine anyway
            eng.shutdown(5)


def test_a_batched_group_counts_as_running_while_it_prefills_and_a_shutdown_drains_it(loaded, monkeypatch):
    """A batched group's prompts are in no slot until their forward ends: they count as running during
    it (/metrics, /health), and a shutdown that drains waits for them to finish instead of reading
    nothing running and cancelling them (before 2026-12-07 they were neither running nor waiting)."""
    with _a_group_held_in_its_forward(loaded, monkeypatch, drain_timeout=120) as (eng, group, closing):
        stats = eng.stats()
        assert (stats.running, stats.waiting, stats.slots_in_use) == (2, 0, 2)
        closing.start()
        time.sleep(0.2)  # the drain reads the group as running meanwhile
    results = [_ended(eng, handle) for handle in group]
    closing.join(130)
    assert [r.finish_reason for r in results] == ["length", "length"]
    assert [list(r.token_ids) for r in results] == [_reference(loaded, (first, 5), 12) for first in (85, 84)]
    assert results[0].timings.prefill_batch == 2 and not eng.ready


def test_a_shutdown_past_its_drain_cancels_a_group_still_in_its_forward(loaded, monkeypatch):
    """After its drain timeout a shutdown cancels what still runs, a batched group in its forward
    too: the group ends cancelled without a token (its prefill's draw is dropped), no decode step
    after the drain. Before 2026-12-07 only queued and slotted requests were cancelled: the group
    decoded on until the loop's clean-up ended it."""
    with _a_group_held_in_its_forward(loaded, monkeypatch, drain_timeout=0.2) as (eng, group, closing):
        closing.start()
        deadline = time.monotonic() + 10
        while not all(handle.cancelled for handle in group) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(handle.cancelled for handle in group)  # by the shutdown, while the forward is held
    results = [_ended(eng, handle) for handle in group]
    closing.join(30)
    assert [r.finish_reason for r in results] == ["cancelled", "cancelled"]
    assert [tuple(r.token_ids) for r in results] == [(), ()] and not eng.ready


def test_the_first_request_after_ready_traces_and_compiles_nothing(loaded, caplog):
    """Warm-up leaves a fresh state, committed to the device as every step's output is: before
    2026-12-07 it was not, and the first request's `set_sampling_row` (run before any step) traced and
    loaded a second program (uncommitted arguments are another cache key): 100-150 ms of its TTFT on
    the built-in model. Nothing is traced or compiled for it now."""
    # the module engine's shapes: nothing new compiles (the session's compile cache and store)
    eng = BatchEngine(loaded, max_model_len=96, max_batch=3, buckets=(8, 32), steps_per_dispatch=3).start()
    try:
        assert eng.wait_ready(300)
        jax.config.update("jax_log_compiles", True)  # global: the engine thread compiles, not this one
        try:
            with caplog.at_level(logging.WARNING):
                result = eng.submit(GenerationRequest((83, 5, 6), 4, ignore_eos=True)).wait()
        finally:
            jax.config.update("jax_log_compiles", False)
        compiled = [r.getMessage()[:80] for r in caplog.records if r.getMessage().startswith("Compiling ")]
        assert compiled == [] and result.finish_reason == "length"
        assert list(result.token_ids) == _reference(loaded, (83, 5, 6), 4)
    finally:
        eng.shutdown(5)


def test_shutdown_ends_every_queued_and_running_request(loaded):
    # the shapes of the degeneracy test's engine (same config): nothing new compiles
    eng = BatchEngine(loaded, max_model_len=64, max_batch=1, buckets=(8,)).start()
    assert eng.wait_ready(300)
    handles = [eng.submit(GenerationRequest((5, 6, 7), 60, ignore_eos=True)) for _ in range(3)]
    next(iter(handles[0]))  # the first is running, the others wait for the only slot
    eng.shutdown(drain_timeout=0)
    results = [h.wait() for h in handles]
    assert [r.finish_reason for r in results] == ["cancelled"] * 3
    assert not eng.ready


def test_a_submit_that_raced_the_shutdown_is_refused_not_queued_where_nothing_takes_it(loaded, monkeypatch):
    """A request that read `ready` just before the engine's loop stopped and ended its queue is refused
    (EngineNotReady, a 503) instead of queued behind the loop's last look at the queue, where its
    client would wait forever."""
    from gemmax.engine.api import EngineNotReady

    # the shapes of the shutdown test's engine: their programs are loaded from the session's store
    eng = BatchEngine(loaded, max_model_len=64, max_batch=1, buckets=(8,)).start()
    assert eng.wait_ready(300)
    validated, go_on = threading.Event(), threading.Event()
    validate = engine_module.validate_request

    def slow_validate(*args, **kwargs):  # `submit` is past its `ready` check here
        validated.set()
        go_on.wait(60)
        return validate(*args, **kwargs)

    monkeypatch.setattr(engine_module, "validate_request", slow_validate)
    outcome = []

    def submit():
        try:
            outcome.append(eng.submit(GenerationRequest((5, 6, 7), 4, ignore_eos=True)))
        except EngineNotReady as exc:
            outcome.append(exc)

    submitting = threading.Thread(target=submit, daemon=True)
    submitting.start()
    assert validated.wait(60)
    eng.shutdown(drain_timeout=0)  # the loop ends its queue and stops
    eng._thread.join(60)
    assert not eng._thread.is_alive()
    go_on.set()
    submitting.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], EngineNotReady), outcome


def test_a_warm_up_past_the_limit_on_memory_maps_stops_with_the_arithmetic(loaded, monkeypatch):
    """A host whose limit on memory maps (vm.max_map_count) is below what the process holds already:
    warm-up stops at the first program ready, with the numbers (XLA:CPU's JIT maps each compiled
    kernel, and at the real limit LLVM aborts the process; the projection's arithmetic:
    tests/test_memory.py)."""
    from gemmax.engine import memory

    monkeypatch.setattr(memory, "max_map_count", lambda: 1)
    # the shapes of the shutdown test's engine: their programs are loaded from the session's store
    eng = BatchEngine(loaded, max_model_len=64, max_batch=1, buckets=(8,)).start()
    with pytest.raises(RuntimeError, match="memory maps") as failed:
        eng.wait_ready(300)
    assert isinstance(failed.value.__cause__, memory.MapLimitError)
    assert "vm.max_map_count" in str(failed.value) and "to go" in str(failed.value)
    assert not eng.ready
    eng.shutdown(drain_timeout=0)


def test_a_one_token_prefill_bucket_is_refused():
    from gemmax.engine.shapes import prefill_buckets

    assert prefill_buckets(96, (8, 32, 128)) == (8, 32)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        prefill_buckets(96, (1, 32))


def test_warm_up_starts_a_chunk_at_every_past_it_can_read():
    """`ShapePlan.warm_starts`: the starts whose chunks read each of the pasts `forward.past_bounds`
    offers, none and every KV bound, each once (serve's CPU shapes, and a plan with one bound); the
    largest bucket at 0 only."""
    from gemmax.engine.shapes import ShapePlan
    from gemmax.model.forward import kv_bound_index, past_bounds

    for plan in (ShapePlan.create(2048, 8, (32, 128, 512)), ShapePlan.create(96, 3, (8, 32))):
        bounds = past_bounds(plan.kv_buckets)
        for bucket in plan.buckets[:-1]:
            starts = plan.warm_starts(bucket)
            read = [int(kv_bound_index(bounds, jnp.asarray([s], jnp.int32), jnp.ones(1, jnp.int32), past_only=True))
                    for s in starts]
            assert read == list(range(len(bounds))) and max(starts) < plan.max_model_len
        assert plan.warm_starts(plan.buckets[-1]) == (0,)
    assert ShapePlan.create(2048, 8, (32, 128, 512)).warm_starts(32) == (0, 1, 257, 1025)


def test_cpu_default_shapes_batch_only_four_or_more_prompts_of_one_short_chunk(loaded):
    """With the CPU policy's buckets only 4 or more prompts of one 32-token chunk prefill batched
    (`policy.CPU_PREFILL_BATCHED_BUCKETS`, `CPU_PREFILL_BATCHED_MIN_ROWS`): a 41-token prompt is one chunk of
    64 and never waits for a group, and 2 or 3 prompts prefill one at a time instead of taking a
    shape of 4 with idle rows. Buckets given explicitly all get batched shapes from 2 rows, as before.
    A plan whose chunk before the last is partial never forms a group."""
    default = BatchEngine(loaded, max_model_len=2048, max_batch=8).shapes
    assert default.buckets == (32, 64, 128, 512)
    assert default.prefill_groups == ((4, 32), (8, 32))
    assert plan_chunks(41, default.buckets) == [(41, 64)] and default.group_buckets([(41, 64)]) is None
    assert default.group_buckets([(20, 32)]) == (32,)
    assert [default.prefill_group(n, (32,)) for n in range(1, 11)] == [None, None, None, 4, 8, 8, 8, 8, 8, 8]
    given = BatchEngine(loaded, max_model_len=2048, max_batch=8, buckets=(32, 64, 128, 512)).shapes
    assert {bucket for _, bucket in given.prefill_groups} == {32, 64, 128} and min(given.prefill_groups)[0] == 2
    assert given.prefill_group(2, (32,)) == 2 and given.prefill_group(1, (32,)) is None
    assert given.group_buckets([(96, 128), (4, 32)]) is None and given.group_buckets([(128, 128), (4, 32)]) == (128, 32)


def test_a_step_reads_the_first_bound_that_holds_every_real_row():
    from gemmax.model.forward import kv_bound_index, past_bounds

    bounds = (256, 1024, 2048)

    def index(start, num_new):
        return int(kv_bound_index(bounds, jnp.asarray(start, jnp.int32), jnp.asarray(num_new, jnp.int32)))

    assert index([0, 254], [1, 1]) == 0 and index([0, 255], [1, 1]) == 0  # 256 positions fit 256
    assert index([255, 0], [0, 1]) == 0  # an idle row's length does not count, wherever it is
    assert index([256, 0], [1, 1]) == 1 and index([10, 1500], [1, 1]) == 2  # the furthest row, not the first
    assert index([1023, 5], [1, 1]) == 1 and index([1024, 5], [1, 1]) == 2
    assert index([2000, 7], [0, 0]) == 0  # no real row

    def chunk(start, num_new):  # a chunk's past (forward.past_bounds): none at 0, else the bound that holds its start
        return int(kv_bound_index(past_bounds(bounds), jnp.asarray(start, jnp.int32), jnp.asarray(num_new, jnp.int32),
                                  past_only=True))

    assert chunk([0, 0], [32, 32]) == 0 and chunk([0, 700], [32, 0]) == 0  # an idle row's past does not count
    assert chunk([1, 0], [32, 32]) == 1 and chunk([256], [32]) == 1 and index([256], [32]) == 1
    assert chunk([257], [32]) == 2 and chunk([1024], [512]) == 2 and chunk([1025], [512]) == 3
    assert chunk([1500, 0], [0, 3]) == 0 and chunk([1500, 0], [3, 3]) == 3  # the furthest real row's


def test_kv_buckets_cover_max_model_len():
    from gemmax.engine.shapes import kv_buckets

    assert kv_buckets(96) == (96,)
    assert kv_buckets(2048) == (256, 1024, 2048)
    assert kv_buckets(4096) == (256, 1024, 4096)


def test_long_prompts_and_kv_buckets_use_only_warmed_shapes(hf_checkpoints):
    """max_model_len 320: KV buckets (256, 320); a 290-token prompt prefills in chunks of 128 whose later
    starts read the 320 bucket, and decode crosses from the 256 to the 320 bucket. Every request's
    tokens equal the solo path and nothing compiles after warm-up."""
    loaded = load_model(str(hf_checkpoints["g4_plain"][0]), "float32")
    eng = BatchEngine(loaded, max_model_len=320, max_batch=2, buckets=(16, 128), steps_per_dispatch=4).start()
    try:
        assert eng.wait_ready(300)
        assert eng.shapes.kv_buckets == (256, 320)
        prompts = [tuple(int(t) for t in np.random.default_rng(n).integers(3, 96, n)) for n in (290, 250)]
        handles = [eng.submit(GenerationRequest(p, 20, ignore_eos=True)) for p in prompts]
        for prompt, handle in zip(prompts, handles, strict=True):
            result = handle.wait()
            assert not result.timings.uncompiled_shape
            assert list(result.token_ids) == _reference(loaded, prompt, 20)
    finally:
        eng.shutdown(1)


def test_a_group_step_reads_the_bound_that_holds_its_rows_and_touches_no_other_row(loaded):
    """A group's decode step (decode_forward of the rows, then draw) with the tuple of KV
    bounds (2, 4, 64) writes and reads its rows of the cache in place and, over 6 steps of rows at
    positions 0 and 3 (the step reads 4, then 64 slots; the sliding ring has 4), gives the outputs and
    the cache of the step that reads every slot; the rows outside the group stay as they were."""
    import jax

    from gemmax.engine.steps import decode_forward, draw, init_device_state

    config, params, precision = loaded.checkpoint.config, loaded.checkpoint.params, loaded.policy.precision()
    assert config.sliding_window == 4
    rows, results = jnp.asarray([1, 2], jnp.int32), {}
    for kv_len in (None, (2, 4, 64)):
        device = init_device_state(config, 4, 64, precision)
        # row 2 starts 3 positions on (its first 3 slots hold zeros): the bound follows the further row
        device = dataclasses.replace(device, tokens=jnp.asarray([5, 7, 9, 11]), remaining=jnp.full(4, 8, jnp.int32),
                                     positions=jnp.asarray([0, 0, 3, 0], jnp.int32))
        before = jax.device_get(device.cache)
        want, take = jnp.zeros(2, jnp.bool_), jnp.ones(2, jnp.bool_)
        outs = []
        for _ in range(6):
            device, logits = decode_forward(params, device, rows, config=config, precision=precision, kv_len=kv_len)
            device, out = draw(device, logits, want, rows, take, jnp.bool_(True))
            outs.append((jax.device_get(logits), jax.device_get(out[0])))
        results[kv_len] = (outs, jax.device_get(device.cache))
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(results[kv_len][1]), strict=True):
            assert np.array_equal(a[np.asarray([0, 3])], b[np.asarray([0, 3])])
    (outs_all, cache_all), (outs_bound, cache_bound) = results[None], results[(2, 4, 64)]
    for (logits_a, ids_a), (logits_b, ids_b) in zip(outs_all, outs_bound, strict=True):
        assert np.array_equal(ids_a, ids_b) and np.allclose(logits_a, logits_b, atol=1e-4)
    for a, b in zip(jax.tree.leaves(cache_all), jax.tree.leaves(cache_bound), strict=True):
        # sums over fewer (masked) slots round differently: ~2e-5 on these float32 values
        assert np.allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-4)


@pytest.mark.parametrize("every_slot", [False, True])
def test_draw_moves_what_its_step_owns_and_nothing_else(loaded, every_slot):
    """`draw`, the sampler of a prompt's first token (advance false) and of a decode step (advance
    true), on rows 1 and 2 of 4 (or every slot): a decode draw moves token, position and budget of
    the rows with budget left, and the sampling state (step, counts) of the rows that drew; a first
    token's draw moves only the sampling state of the rows taking it; a row that does not draw
    reports its token and keeps everything; the rows outside are untouched."""
    import jax

    from gemmax.engine.steps import draw, init_device_state

    config, precision = loaded.checkpoint.config, loaded.policy.precision()
    rows = None if every_slot else jnp.asarray([1, 2], jnp.int32)
    k = 4 if every_slot else 2
    logits = jnp.asarray(np.random.default_rng(5).normal(size=(k, config.vocab_size)), jnp.float32)
    best = np.asarray(jnp.argmax(logits, axis=-1))
    for advance in (True, False):
        device = init_device_state(config, 4, 64, precision)
        device = dataclasses.replace(device, tokens=jnp.asarray([5, 7, 9, 11]), positions=jnp.asarray([3, 4, 5, 6]),
                                     remaining=jnp.asarray([2, 0, 2, 2], jnp.int32))
        before = jax.device_get(device)
        take = jnp.asarray([True] * (k - 1) + [False])  # the last row of the call takes no token
        device, (ids, _, _, _, drew) = draw(device, logits, jnp.zeros(k, jnp.bool_), rows, take, jnp.bool_(advance))
        after = jax.device_get(device)
        slots = np.arange(4) if every_slot else np.asarray([1, 2])
        budget = before.remaining[slots] > 0
        expect_drew = np.asarray(take) & (budget if advance else True)
        assert list(np.asarray(drew)) == list(expect_drew)
        assert list(np.asarray(ids)) == list(np.where(expect_drew, best, before.tokens[slots]))
        moved = expect_drew & advance
        assert list(after.tokens[slots]) == list(np.where(moved, best, before.tokens[slots]))
        assert list(after.positions[slots]) == list(before.positions[slots] + moved)
        assert list(after.remaining[slots]) == list(before.remaining[slots] - moved)
        assert list(after.sampling.step[slots]) == list(before.sampling.step[slots] + expect_drew)
        for j, slot in enumerate(slots):
            assert after.sampling.output_counts[slot].sum() == expect_drew[j]
        if not every_slot:
            for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
                if a.ndim and a.shape[0] == 4:
                    assert np.array_equal(a[[0, 3]], b[[0, 3]])


@pytest.mark.parametrize("tokens", [12, 256])  # 256: attention in query blocks (forward.attend_chunk)
def test_a_first_chunk_reads_no_past(loaded, tokens):
    """A chunk with nothing cached (a prompt's first) takes the KV-bound switch's branch that reads no
    past (forward's `_attend_past`): poisoned slots of its cache row (NaN, where stale values of an
    earlier request would be) cannot reach it, and its logits are those of a clean cache; an idle row
    with a past (num_new 0) does not change the choice. The controls: a static bound reads the masked
    slots, and NaN reaches the logits through p.v (0 x NaN), so the poison would show if the branch
    read them; a chunk after a past reads it; and the clean cache read through the static bound gives
    the same logits."""
    from gemmax.model.forward import Precision, forward

    config, params = loaded.checkpoint.config, loaded.checkpoint.params
    step = jax.jit(functools.partial(forward, config=config, precision=Precision(jnp.float32, jnp.float32)),
                   static_argnames="kv_len")
    ids = jnp.asarray(np.random.default_rng(3).integers(1, config.vocab_size, (2, tokens)), jnp.int32)
    rows, num_new = jnp.asarray([1, 0], jnp.int32), jnp.asarray([tokens, 0], jnp.int32)
    clean = init_cache(config, 2, 512, jnp.float32)
    poisoned = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan) if jnp.issubdtype(a.dtype, jnp.floating) else a, clean)

    def logits(cache, kv_len, start=(0, 100)):
        out = step(params, cache, ids, jnp.asarray(start, jnp.int32), num_new, kv_len=kv_len, rows=rows)[0]
        return np.asarray(out[0])  # the real row's

    reference = logits(clean, (64, 512))
    assert np.isfinite(reference).all()
    np.testing.assert_array_equal(logits(poisoned, (64, 512)), reference)
    np.testing.assert_allclose(logits(clean, 64), reference, atol=1e-5)
    assert np.isnan(logits(poisoned, 64)).all()  # a static bound reads the poisoned past
    assert np.isnan(logits(poisoned, (64, 512), start=(4, 100))).all()  # a chunk with a past reads it


def test_a_prefill_chunk_reads_the_bounds_its_context_needs_and_touches_no_other_row(loaded):
    """prefill_step with the tuple of KV bounds (2, 8, 64): a 20-token prompt in chunks of 2, then 3
    tokens into slot 2 (chunk starts 0 .. 17: the first reads no past, the rest each bound's branch, for
    the full layers' reads after the write and the 4-slot rings' reads before it) gives each chunk's
    logits, and the cache, of the plain chunked forward of a cache of its own (which reads the past, then
    writes); the other slots, prefilled before, keep their rows."""
    import jax

    from gemmax.engine.steps import init_device_state, prefill_step
    from gemmax.model.forward import forward
    from gemmax.model.kv_cache import init_cache

    config, params, precision = loaded.checkpoint.config, loaded.checkpoint.params, loaded.policy.precision()
    assert config.sliding_window == 4 and any(spec.kv_mode == "reuse" for spec in config.layers)
    rng = np.random.default_rng(7)
    bounds, prompt = (2, 8, 64), rng.integers(1, config.vocab_size, 20)

    def chunks(ids):  # (start, real tokens, chunk [1, 3]): 2 tokens first (the next chunk reads bound 2), then 3
        start = 0
        while start < len(ids):
            real = min(2 if start == 0 else 3, len(ids) - start)
            chunk = np.zeros((1, 3), np.int32)
            chunk[0, :real] = ids[start : start + real]
            yield start, real, chunk
            start += real

    def prefill(device, slot, ids):
        logits = []
        for start, real, chunk in chunks(ids):
            device, out = prefill_step(params, device, jnp.asarray(chunk), jnp.int32(slot), jnp.int32(start),
                                       jnp.int32(real), jnp.bool_(True), config=config, precision=precision,
                                       kv_len=bounds)
            logits.append(np.asarray(out[0]))
        return device, logits

    device = init_device_state(config, 4, 64, precision)
    for slot in (0, 1, 3):
        device, _ = prefill(device, slot, rng.integers(1, config.vocab_size, 5 + 6 * slot))
    before = jax.device_get(device.cache)
    device, logits = prefill(device, 2, prompt)

    cache, expected = init_cache(config, 1, 64, precision.kv_cache), []
    for start, real, chunk in chunks(prompt):
        out, cache = forward(params, cache, jnp.asarray(chunk), jnp.asarray([start]), jnp.asarray([real]),
                             config=config, precision=precision)
        expected.append(np.asarray(out[0]))
    for got, want in zip(logits, expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)
    after = jax.device_get(device.cache)
    for old, new, alone in zip(jax.tree.leaves(before), jax.tree.leaves(after), jax.tree.leaves(cache), strict=True):
        others = np.asarray([0, 1, 3])
        assert np.array_equal(old[others], new[others])
        np.testing.assert_allclose(np.asarray(new[2], np.float32), np.asarray(alone[0], np.float32), atol=1e-4)


# ------------------------------------------------------------------------------------------ reliability
# (issue 15: one bad request must never hurt another)


def test_unrepresentable_values_are_refused_at_submit_and_nothing_else_is_hurt(engine, loaded):
    """top_k = 2**31 used to overflow inside the engine step and fail every request in flight."""
    from gemmax.engine.api import InvalidRequest

    running = engine.submit(GenerationRequest((11, 12, 13), 20, ignore_eos=True))
    next(iter(running))
    vocab = loaded.checkpoint.config.vocab_size
    for kwargs, param in [({"sampling": SamplingParams(temperature=1.0, top_k=2**31)}, "top_k"),
                          ({"sampling": SamplingParams(temperature=float("inf"))}, "temperature"),
                          ({"sampling": SamplingParams(temperature=1e9)}, "temperature"),
                          ({"sampling": SamplingParams(top_p=float("nan"))}, "top_p"),
                          ({"stop_token_ids": (vocab,)}, "stop_token_ids"),
                          ({"min_tokens": 200}, "min_tokens")]:
        with pytest.raises(InvalidRequest) as info:
            engine.submit(GenerationRequest((5, 6), 30, **kwargs))
        assert info.value.param == param
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine.submit(GenerationRequest((5, vocab), 3))
    result = running.wait()
    assert result.finish_reason == "length" and list(result.token_ids) == _reference(loaded, (11, 12, 13), 20)


def test_a_fault_in_one_request_ends_that_request_alone(engine, loaded, monkeypatch):
    """A prefill that raises while other requests decode: only that request ends with the error."""
    _fail_prefills_of(engine, monkeypatch, 98, "simulated fault in this request's step")
    others = [engine.submit(GenerationRequest((20 + i, 3, 4), 24, ignore_eos=True)) for i in range(2)]
    for handle in others:
        next(iter(handle))  # both are decoding
    failed = engine.submit(GenerationRequest((98, 3, 4), 5, ignore_eos=True)).wait()
    assert failed.finish_reason == "error" and "simulated fault" in failed.error
    for i, handle in enumerate(others):
        result = handle.wait()
        assert result.finish_reason == "length", result.error
        assert list(result.token_ids) == _reference(loaded, (20 + i, 3, 4), 24)


def test_a_fault_delivering_one_requests_tokens_ends_it_alone(engine, loaded):
    victim = engine.submit(GenerationRequest((30, 3, 4), 24, ignore_eos=True))
    other = engine.submit(GenerationRequest((31, 3, 4), 24, ignore_eos=True))
    delivered = []

    def put(event):
        if len(delivered) == 3:
            raise OSError("the consumer's queue broke")
        delivered.append(event)
        victim._deliver(event)

    victim.put = put
    failed, ok = victim.wait(), other.wait()
    assert failed.finish_reason == "error" and "consumer's queue broke" in failed.error
    assert ok.finish_reason == "length" and list(ok.token_ids) == _reference(loaded, (31, 3, 4), 24)


def test_cancellation_is_honoured_before_admission_and_between_prefill_chunks(engine, monkeypatch):
    original = engine._run_prefill
    chunks: list[int] = []
    queued = []

    def watched(tokens, *args):
        chunks.append(int(tokens[0, 0]))
        if tokens[0, 0] == 50:
            for handle in queued:  # cancelled while this one prefills: they must never prefill
                handle.cancel()
        if tokens[0, 0] == 60:
            long_one.cancel()  # cancelled after its first chunk of three
        return original(tokens, *args)

    monkeypatch.setattr(engine, "_run_prefill", watched)
    blockers = [engine.submit(GenerationRequest((40 + i, 3), 30, ignore_eos=True)) for i in range(2)]
    for handle in blockers:
        next(iter(handle))
    first = engine.submit(GenerationRequest((50, 3), 2, ignore_eos=True))
    queued += [engine.submit(GenerationRequest((70 + i, 3), 2, ignore_eos=True)) for i in range(4)]
    assert first.wait().finish_reason == "length"
    assert [h.wait().finish_reason for h in queued] == ["cancelled"] * 4
    long_one = engine.submit(GenerationRequest((60, *range(3, 72)), 5, ignore_eos=True))  # 70 ids: 32 + 32 + 8
    result = long_one.wait()
    assert result.finish_reason == "cancelled" and result.token_ids == ()
    assert not set(chunks) & {70, 71, 72, 73} and chunks.count(60) == 1
    for handle in blockers:
        handle.cancel()
        handle.wait()


def test_a_long_prompt_prefills_between_the_running_requests_decode_steps(engine, loaded, monkeypatch):
    """While a request decodes, a prompt of three chunks (32 + 32 + 6) prefills in loop iterations of
    at most `prefill_token_budget` bucket tokens (32 here: one chunk each), between decode dispatches: the running request gets tokens between its chunks (it
    never waits for the whole prompt), and both give exactly their tokens alone."""
    original = engine._run_prefill
    at_chunk: list[tuple[int, int]] = []  # (chunk start, tokens the engine had given the running request)

    def watched(tokens, slot, start, *args):
        if tokens.shape[1] == 32 or start >= 32:  # the long prompt's chunks (the running one's is 8)
            given = [len(s.tokens) for s in engine._slots if s is not None and s.handle is running]
            at_chunk.append((int(start), given[0] if given else -1))
        return original(tokens, slot, start, *args)

    monkeypatch.setattr(engine, "_run_prefill", watched)
    monkeypatch.setattr(engine, "prefill_token_budget", 32)  # one 32-token chunk per iteration (default: 64)
    running = engine.submit(GenerationRequest((7, 3, 4), 40, ignore_eos=True))
    next(iter(running))
    long_prompt = tuple(int(t) for t in np.random.default_rng(9).integers(3, 128, 70))
    result = engine.submit(GenerationRequest(long_prompt, 6, ignore_eos=True)).wait()
    assert [start for start, _ in at_chunk] == [0, 32, 64]
    assert 0 < at_chunk[0][1] < at_chunk[1][1] < at_chunk[2][1] < 40, at_chunk  # decode ran between the chunks
    assert list(result.token_ids) == _reference(loaded, long_prompt, 6)
    assert list(running.wait().token_ids) == _reference(loaded, (7, 3, 4), 40)


def test_a_flood_of_one_token_requests_does_not_starve_decoding(engine):
    """max_tokens=1 requests finish at their prefill and free their slot at once; admission used to
    refill it in the same loop iteration, forever, while the running request got no decode step."""
    running = engine.submit(GenerationRequest((80, 3, 4), 30, ignore_eos=True))
    next(iter(running))
    flood = [engine.submit(GenerationRequest((81, 3), 1, ignore_eos=True)) for _ in range(90)]
    running.wait()
    done_before = sum(h.result is not None for h in flood)
    assert done_before < len(flood), "the running request waited for the whole flood"
    assert all(h.wait().finish_reason == "length" for h in flood)


def test_an_arrival_waits_for_the_step_in_flight_and_no_step_runs_past_the_last_token_owed(engine, loaded, monkeypatch):
    """A dispatch runs up to steps_per_dispatch (3 here) decode steps, LOOKAHEAD_STEPS (2) of them
    in flight (the next queued behind the one being delivered); once a queued request could take a free slot no
    further step is enqueued, so a request arriving during the first step of a dispatch is prefilled
    after the one other step already enqueued (before: after the dispatch's other 2 steps). And no
    dispatch runs a step past the last token any row owes: a lone request of max_tokens n runs n - 1
    decode steps (its first token comes from the prefill), not a multiple of 3. Both requests still
    give exactly their tokens alone."""
    late_prompt = (9, 8, 7, 6)
    watch = ArrivalWatch(engine, monkeypatch, GenerationRequest(late_prompt, 4, ignore_eos=True))
    for max_tokens in (2, 5):
        watch.events.clear()
        assert len(engine.submit(GenerationRequest((5, 6, 7), max_tokens, ignore_eos=True)).wait().token_ids) == max_tokens
        assert watch.events.count("forward") == max_tokens - 1, (max_tokens, watch.events)

    watch.arm()
    running = engine.submit(GenerationRequest((7, 3, 4), 20, ignore_eos=True))
    assert list(running.wait().token_ids) == _reference(loaded, (7, 3, 4), 20)
    assert engine_module.LOOKAHEAD_STEPS == 2 and engine.steps_per_dispatch == 3
    assert watch.after_arrival().index("prefill") == 1, watch.events  # the step already enqueued, then the prefill
    assert list(watch.handle.wait().token_ids) == _reference(loaded, late_prompt, 4)


def test_a_prefill_chunk_reads_and_writes_what_the_whole_row_would(loaded):
    """`prefill_step` writes its chunk into the slot's row of the cache in place and reads, layer by
    layer, the KV bucket that holds its start (a ring's past read before the write, a full layer's
    after it). With the sliding windows widened to 512 (rings of 512 + slack slots, of which the
    256 bucket reads the first 256) and full layers of 1,024 slots, a 300-token prompt in 32-token
    chunks with the engine's KV buckets gives the logits and cache of the plain chunked forward (read
    the past up to a static bound, then write) on the whole row copied out and back (to float
    rounding): a float32 cache without ring slack and an int8 one (scales [B, S, nkv]) with 4 slots
    of slack."""
    from gemmax.engine.shapes import kv_buckets
    from gemmax.engine.steps import init_device_state, prefill_step
    from gemmax.model.forward import Precision, forward

    base = loaded.checkpoint.config
    config = dataclasses.replace(base, layers=tuple(
        dataclasses.replace(spec, sliding_window=512) if spec.sliding_window else spec for spec in base.layers))
    params = loaded.checkpoint.params
    prompt = np.random.default_rng(3).integers(3, config.vocab_size, 300)

    @functools.partial(jax.jit, static_argnames=("precision", "kv_len"))
    def whole_row(device, tokens, slot, start, num_new, last, *, precision, kv_len):
        logits, row = forward(params, device.cache.rows(slot), tokens, start[None], num_new[None], config=config,
                              precision=precision, kv_len=kv_len, head_on=last)
        return dataclasses.replace(device, cache=device.cache.put_rows(row, slot)), logits

    def in_place(device, *args, precision, kv_len):
        return prefill_step(params, device, *args, config=config, precision=precision, kv_len=kv_buckets(1024))

    assert kv_buckets(1024)[0] == 256
    for kv_dtype, slack in ((jnp.float32, 0), (jnp.int8, 4)):
        precision = Precision(jnp.float32, kv_dtype)
        runs = []
        for step in (in_place, whole_row):
            device = init_device_state(config, 2, 1024, precision, slack)
            for start in range(0, len(prompt), 32):
                n = min(32, len(prompt) - start)
                tokens = np.zeros((1, 32), np.int32)
                tokens[0, :n] = prompt[start : start + n]
                device, logits = step(device, jnp.asarray(tokens), jnp.int32(1), jnp.int32(start), jnp.int32(n),
                                      jnp.bool_(start + n == len(prompt)), precision=precision,
                                      kv_len=next(b for b in kv_buckets(1024) if b >= start))
            runs.append((np.asarray(logits), jax.tree.leaves(device.cache)))
        (logits, cache), (whole_logits, whole_cache) = runs  # XLA fuses the two shapes' sums apart: ~1e-6
        # an int8 value at a rounding boundary may round the other way (the two paths' float sums
        # differ by ~1e-6), and one step of it moved these logits by up to 2e-3
        tolerance = 5e-3 if kv_dtype == jnp.int8 else 1e-4
        np.testing.assert_allclose(logits, whole_logits, rtol=1e-4, atol=tolerance)
        for a, b in zip(cache, whole_cache, strict=True):
            a, b = np.asarray(a), np.asarray(b)
            if a.dtype == np.int8:
                assert np.abs(a.astype(np.int32) - b).max() <= 1 and np.mean(a != b) < 1e-3
            else:
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_the_wait_queue_is_bounded(engine, monkeypatch):
    """Requests that free slots will take do not wait (the loop may not have placed them yet), so
    max_batch + 2 enter a queue bounded at 2 (none can finish meanwhile: decoding is held until the
    end); a call of several requests (`submit_all`) at the bound, or with one invalid request, queues
    none of them."""
    from gemmax.engine.api import Admission, InvalidRequest, QueueFull

    monkeypatch.setattr(engine, "admission", Admission(2, engine.max_batch))
    decode, go = engine._decode_dispatch, threading.Event()

    def held_decode() -> None:
        go.wait(60)
        decode()

    monkeypatch.setattr(engine, "_decode_dispatch", held_decode)
    handles = []
    with pytest.raises(QueueFull) as info:
        for i in range(engine.max_batch + 20):
            handles.append(engine.submit(GenerationRequest((90 + i, 3), 400, ignore_eos=True)))
    assert len(handles) == engine.max_batch + 2
    assert 1 <= info.value.retry_after <= 60 and (info.value.max_queue, info.value.waiting) == (2, 2)

    def held() -> int:
        stats = engine.stats()  # one read: the loop moves queued requests into slots meanwhile
        return stats.running + stats.waiting

    before = held()
    with pytest.raises(QueueFull):
        engine.submit_all([GenerationRequest((5, 3), 4), GenerationRequest((6, 3), 4)])
    with pytest.raises(InvalidRequest):
        engine.submit_all([GenerationRequest((5, 3), 4), GenerationRequest((6, 3), 4, SamplingParams(temperature=-1))])
    assert held() == before == engine.max_batch + 2
    go.set()
    for handle in handles:
        handle.cancel()
        handle.wait()
    assert engine.submit(GenerationRequest((7, 3), 2)).wait().finish_reason in ("length", "stop")


def test_a_context_beyond_the_models_positions_is_refused_at_start(loaded):
    """max_model_len past max_position_embeddings is refused with the numbers before anything is
    allocated (as `gemmax fit` refuses to plan it), not served with positions the model never saw."""
    positions = loaded.checkpoint.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"max_model_len {positions + 1:,} exceeds the {positions:,} positions"):
        BatchEngine(loaded, max_model_len=positions + 1, max_batch=1)
