"""The engine's steps compiled ahead of time (gemmax.engine.executables): warm-up compiles every
declared shape, runs each once before ready (XLA:CPU's first run of a program sets up its GEMMs),
keeps each as a serialised executable in the compile cache, and the next start loads them instead
of compiling; a damaged entry is compiled anew. Outputs stay those of the plain solo path
throughout."""

from __future__ import annotations

import dataclasses
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmax.engine.api import GenerationRequest
from gemmax.engine.engine import BatchEngine
from gemmax.engine.executables import STORE_DIR, ExecutableStore, signature
from gemmax.engine.generate import generate
from gemmax.engine.loading import load_model
from gemmax.engine.sampling import SamplingParams

PREFIX_CACHE_BYTES = 1 << 20  # the prefix cache on: its copy programs are stored and loaded too
PROMPTS = [tuple(int(t) for t in np.random.default_rng(n).integers(3, 96, n)) for n in (5, 40)]  # 40: two chunks


@pytest.fixture(scope="module")
def loaded(hf_checkpoints):
    return load_model(str(hf_checkpoints["g4_shared"][0]), "float32")  # KV sharing and a sliding ring


def _start(loaded, cache, **options) -> BatchEngine:
    options = {"prefix_cache_bytes": 0, **options}
    return BatchEngine(loaded, max_model_len=64, max_batch=2, buckets=(8, 32), compile_cache_dir=str(cache),
                       **options).start(background=False)


def _serve(engine: BatchEngine) -> list[tuple[list[int], bool]]:
    try:
        handles = [engine.submit(GenerationRequest(p, max_tokens=12, ignore_eos=True)) for p in PROMPTS]
        return [(list(r.token_ids), r.timings.uncompiled_shape) for r in (h.wait() for h in handles)]
    finally:
        engine.shutdown(1)


def test_a_restart_loads_every_step_and_a_damaged_one_is_compiled_anew(loaded, tmp_path):
    ck = loaded.checkpoint
    solo = [generate(ck.params, ck.config, list(p), 12, SamplingParams(), loaded.policy.precision(), stop_ids=())
            for p in PROMPTS]
    served = []

    def start():
        engine = _start(loaded, tmp_path)
        served.append(_serve(engine))
        return engine.warmup_report

    cold = start()
    shapes = cold["shapes"]
    assert cold["executables_compiled"] == shapes and cold["executables_loaded"] == 0 and cold["executables"] == shapes
    assert cold["executables_never_run"] == 0  # every program's first run (YNNPACK's set-up) before ready
    stored = sorted((tmp_path / STORE_DIR).glob("*.exe"))
    assert len(stored) == shapes

    warm = start()  # nothing traced, lowered or compiled for the declared shapes
    assert warm["executables_loaded"] == shapes and warm["executables_compiled"] == 0
    assert warm["executables_never_run"] == 0
    assert warm["cache_hit"] and warm["cache_misses"] == 0

    stored[0].write_bytes(stored[0].read_bytes()[:200])  # truncated
    damaged = start()
    assert damaged["executables_rejected"] == 1 and damaged["executables_compiled"] == 1
    assert damaged["executables_loaded"] == shapes - 1
    assert stored[0].stat().st_size > 200  # written anew

    for run in served:  # the same tokens from compiled, loaded and recompiled programs; nothing compiled late
        assert [tokens for tokens, _ in run] == solo
        assert not any(late for _, late in run)


def test_warm_up_runs_every_program_but_prefill_chunks_over_the_run_once_limit(loaded, tmp_path, monkeypatch):
    """Every declared program runs before ready except prefill chunks of more than RUN_ONCE_TOKENS
    tokens, one prompt's or a batched group's (their compute would cost every start more than the
    set-up it saves); a chunk of exactly that many runs. A one-slot chunk's program runs at every
    start of `ShapePlan.warm_starts`, one per past its chunks can read."""
    from gemmax.engine.engine import RUN_ONCE_TOKENS
    from gemmax.engine.executables import CompiledStep

    assert RUN_ONCE_TOKENS == 512  # the shapes below straddle it
    runs, call = [], CompiledStep.__call__

    def recorded(step, *args, **statics):  # warm-up's first runs call the steps; requests use `run`
        if step.name == "prefill_step":
            runs.append((args[2].shape[1], int(args[4])))  # (bucket, start)
        return call(step, *args, **statics)

    monkeypatch.setattr(CompiledStep, "__call__", recorded)
    engine = BatchEngine(loaded, max_model_len=1088, max_batch=4, buckets=(128, 256, 1024),
                         compile_cache_dir=str(tmp_path), prefix_cache_bytes=0).start(background=False)
    try:
        plan = engine.shapes
        assert sorted(runs) == sorted((bucket, start) for bucket in (128, 256) for start in plan.warm_starts(bucket))
        big_chunks = [bucket for bucket in plan.buckets if bucket > RUN_ONCE_TOKENS]
        big_groups = [(rows, bucket) for rows, bucket in plan.prefill_groups if rows * bucket > RUN_ONCE_TOKENS]
        assert big_chunks and big_groups == [(4, 256)]
        assert {(4, 128), (2, 256)} <= set(plan.prefill_groups)  # 512 tokens each: run
        assert engine.steps.prefill_step.never_run() == len(big_chunks)
        assert engine.steps.prefill_rows.never_run() == 1
        assert engine.warmup_report["executables_never_run"] == len(big_chunks) + 1
    finally:
        engine.shutdown(1)


def test_a_program_read_back_from_jax_cache_is_stored_with_the_bytes_of_its_entry(loaded, tmp_path, monkeypatch):
    """After a code change that leaves the programs as they were, the store misses and JAX's own cache
    hits. XLA:CPU serialises such a read-back executable without all its kernels ("Function ... not
    found" when it runs), so the store keeps the bytes JAX's cache entry held: the next start loads
    every program from the store, and runs them. Every start serves the solo path's tokens.

    Then the store is given those incomplete serialisations (entries that load but fail when they
    run): warm-up compiles each failing program anew, also those its throwaway requests run first
    (the prefix cache's copies, on here), and is ready with the same tokens; without warm-up each
    fails the request running when it first runs, and the engine keeps serving."""
    from jax.experimental import serialize_executable

    incomplete = {}  # store key -> the read-back program serialised again, as the store once wrote it
    save = ExecutableStore.save

    def save_and_keep_incomplete(store, key, compiled, executable=None, devices=None):
        save(store, key, compiled, executable, devices)
        if executable is not None:
            incomplete[key] = pickle.dumps(serialize_executable.serialize(compiled))

    ck = loaded.checkpoint
    solo = [generate(ck.params, ck.config, list(p), 12, SamplingParams(), loaded.policy.precision(), stop_ids=())
            for p in PROMPTS]
    jax.clear_caches()  # compiled for real (earlier tests' programs are in memory), so JAX's cache is written
    cold = _start(loaded, tmp_path, prefix_cache_bytes=PREFIX_CACHE_BYTES)
    shapes = cold.warmup_report["shapes"]
    assert cold.warmup_report["executables_from_jax_cache_stored"] == 0
    assert _serve(cold) == [(tokens, False) for tokens in solo]
    for entry in (tmp_path / STORE_DIR).glob("*.exe"):  # as a changed code hash would leave it
        entry.unlink()

    jax.clear_caches()  # as a new process: compiling reads JAX's persistent cache, not its memory
    monkeypatch.setattr(ExecutableStore, "save", save_and_keep_incomplete)
    after_change = _start(loaded, tmp_path, prefix_cache_bytes=PREFIX_CACHE_BYTES)
    monkeypatch.undo()
    report = after_change.warmup_report
    assert report["cache_hits"] >= shapes and report["executables_loaded"] == 0
    assert report["executables_from_jax_cache_stored"] == shapes and report["executables_from_jax_cache_unstored"] == 0
    assert len(list((tmp_path / STORE_DIR).glob("*.exe"))) == shapes
    assert _serve(after_change) == [(tokens, False) for tokens in solo]

    jax.clear_caches()
    # the store's copies: nothing traced, lowered or compiled
    next_start = _start(loaded, tmp_path, prefix_cache_bytes=PREFIX_CACHE_BYTES)
    report = next_start.warmup_report
    assert report["executables_loaded"] == shapes and report["executables_compiled"] == 0
    assert report["executables_never_run"] == 0  # every loaded copy ran at warm-up, and served below
    assert report["executables_discarded"] == 0
    assert _serve(next_start) == [(tokens, False) for tokens in solo]

    def store_incomplete_copies():
        assert len(incomplete) == shapes
        for key, blob in incomplete.items():
            (tmp_path / STORE_DIR / f"{key}.exe").write_bytes(blob)

    store_incomplete_copies()
    jax.clear_caches()
    healed = _start(loaded, tmp_path, prefix_cache_bytes=PREFIX_CACHE_BYTES)
    report = healed.warmup_report
    failing = report["executables_discarded"]
    assert failing >= 1 and report["executables_loaded"] == shapes  # loaded, then failed their first run
    assert report["executables_compiled"] == failing and report["executables"] == shapes
    assert report["executables_never_run"] == 0
    assert healed.prefix_cache.steps.summary()["executables_compiled"] >= 1  # a copy, first run by a throwaway request
    assert _serve(healed) == [(tokens, False) for tokens in solo]

    store_incomplete_copies()
    jax.clear_caches()
    lazy = BatchEngine(loaded, max_model_len=64, max_batch=2, buckets=(8, 32), compile_cache_dir=str(tmp_path),
                       prefix_cache_bytes=PREFIX_CACHE_BYTES, warm_up=False).start(background=False)
    try:
        results = [lazy.submit(GenerationRequest(PROMPTS[1], max_tokens=12, ignore_eos=True)).wait()
                   for _ in range(failing + 2)]
        failed = [r for r in results if r.finish_reason == "error"]  # a cache hit's copy fails after a success
        assert len(failed) == lazy.info["executables_now"]["executables_discarded"] >= 1  # /health's, live
        assert all("LoadedProgramFailed" in r.error and "failed its first run" in r.error for r in failed)
        assert [list(r.token_ids) for r in results if r.finish_reason != "error"] == [solo[1]] * (len(results) - len(failed))
        assert results[-1].finish_reason == "length"
    finally:
        lazy.shutdown(1)


def test_only_a_program_read_back_from_jax_cache_reports_its_entry_bytes(tmp_path):
    """`_compile` hands over the bytes of JAX's cache entry for the program JAX read back, and none for
    one compiled after it in the same thread (what it kept for the first is not reported again)."""
    from jax._src import compilation_cache as jax_cache

    from gemmax.engine import compile_cache
    from gemmax.engine.executables import _compile

    compile_cache.enable(tmp_path)
    jax_cache.reset_cache()  # JAX's cache opens the directory now set
    times_three, minus_seven = jax.jit(lambda x: x * 3 + 1), jax.jit(lambda x: x - 7)
    x = jnp.arange(8.0)
    _, hit, kept = _compile(times_three, (x,), {})  # compiled, written to JAX's cache
    assert not hit and kept is None
    jax.clear_caches()  # as a new process would: the next compile reads JAX's cache
    program, hit, kept = _compile(times_three, (x,), {})
    assert hit and isinstance(kept, bytes) and len(kept) > 0
    assert np.array_equal(program(x), x * 3 + 1)
    _, hit, kept = _compile(minus_seven, (x,), {})
    assert not hit and kept is None


def test_the_key_changes_with_what_decides_the_program(loaded, tmp_path):
    store = ExecutableStore(tmp_path)
    config = loaded.checkpoint.config
    args = (jnp.zeros((1, 8), jnp.int32), jnp.int32(0))
    statics = {"config": config, "kv_len": 64}
    base = store.key("prefill_step", signature(args, statics), [])
    assert base == store.key("prefill_step", signature((jnp.ones((1, 8), jnp.int32), jnp.int32(3)), statics), [])
    other_config = dataclasses.replace(config, final_logit_softcapping=(config.final_logit_softcapping or 30.0) + 1.0)
    changed = [
        store.key("decode_step", signature(args, statics), []),  # another step
        store.key("prefill_step", signature((jnp.zeros((1, 16), jnp.int32), jnp.int32(0)), statics), []),  # shape
        store.key("prefill_step", signature((jnp.zeros((1, 8), jnp.float32), jnp.int32(0)), statics), []),  # dtype
        store.key("prefill_step", signature(args, {**statics, "kv_len": 32}), []),  # a static argument
        store.key("prefill_step", signature(args, {**statics, "config": other_config}), []),  # the model
        store.key("prefill_step", signature((*args, None), statics), []),  # the argument tree
    ]
    assert len({base, *changed}) == len(changed) + 1
