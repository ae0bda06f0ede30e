"""Device faults injected into a running BatchEngine, for the tests of its recovery paths
(tests/test_engine.py, tests/test_prefix_cache.py)."""

from __future__ import annotations

from collections.abc import Callable

import jax


def consume_the_state_and_fail(engine, *more) -> None:
    """What a device call that failed after XLA consumed its donated buffers leaves behind: the
    engine's state (and the trees in `more`, e.g. the prefix cache's pool) deleted, then the error."""
    for leaf in jax.tree.leaves((engine.device, *more)):
        leaf.delete()
    raise RuntimeError("simulated fault after donation")


def fail_the_start_of(engine, monkeypatch, doomed: Callable[[object], bool]) -> list[int]:
    """Make starting a prefilled request for which `doomed(request)` holds take the state and fail
    (as a draft model's prefill that consumed it would); returns the prefill batch size of each such
    start, as they happen."""
    original, batches = engine._begin, []

    def begin(slot_index, slot, *rest):
        if doomed(slot.request):
            batches.append(slot.prefill_batch)
            consume_the_state_and_fail(engine)
        return original(slot_index, slot, *rest)

    monkeypatch.setattr(engine, "_begin", begin)
    return batches


def fail_the_next_rebuild(engine, monkeypatch) -> None:
    """Make the engine's next `_init_device_state` raise, once."""
    original = engine._init_device_state

    def init_once():
        monkeypatch.setattr(engine, "_init_device_state", original)
        raise RuntimeError("simulated rebuild failure")

    monkeypatch.setattr(engine, "_init_device_state", init_once)
