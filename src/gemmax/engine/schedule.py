"""Serving across processes: process 0 schedules, every other process follows its schedule.

With `jax.distributed` every process must run the same compiled steps in the same order, each on its
own devices of the global mesh. Process 0 runs the HTTP server and the `BatchEngine`; the engine's
device calls (state reset, the warm-up's ahead-of-time compile, a slot's sampling row, a prefill chunk, a decode dispatch, a slot's
token / position / budget) are its `REPLAYED` methods. On process 0 each of them first sends its
name and arguments to the other processes (`Leader`); there, `follow` runs the same method of an
engine built the same way, with the same arguments, until process 0 sends `STOP`. The host-side
scheduling (queue, admissions, stop tokens, streaming) runs on process 0 only; the followers never
see a request, only device calls.

The channel is JAX's own: `multihost_utils.broadcast_one_to_all` of a header (the payload's length)
and then of the pickled call, padded to a power of two of int32 words so that few message shapes
compile. Pickle is safe here: the only writer is process 0 of the same job, running the same code.
A single process (no `jax.distributed`) never comes here: its engine has no `Leader`.
"""

from __future__ import annotations

import logging
import pickle
import time
from typing import Any

import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger("gemmax.engine")

STOP = "stop"
# Process 0 with nothing to run says so every IDLE_SECONDS, so that no follower waits in one collective
# for as long as the server is idle (collectives time out).
IDLE = "idle"
IDLE_SECONDS = 5.0
# The engine's device calls a follower replays, by method name (gemmax.engine.engine.BatchEngine).
REPLAYED = frozenset({"_init_device_state", "_compile_declared", "_set_sampling_row", "_run_prefill", "_dispatch_decode",
                      "_set_slot"})
_MIN_WORDS = 64  # the smallest payload shape (int32 words); larger ones are powers of two


def _words(length: int) -> int:
    """int32 words of the payload shape for `length` bytes: the next power of two, at least _MIN_WORDS."""
    return max(_MIN_WORDS, 1 << (-(-length // 4) - 1).bit_length())


def _broadcast(words: np.ndarray) -> np.ndarray:
    return np.asarray(multihost_utils.broadcast_one_to_all(words))


class Leader:
    """Process 0's end: sends each replayed call before the engine runs it."""

    def send(self, name: str, args: tuple = (), kwargs: dict | None = None) -> None:
        payload = pickle.dumps((name, args, kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL)
        buffer = np.zeros(_words(len(payload)) * 4, np.uint8)
        buffer[: len(payload)] = np.frombuffer(payload, np.uint8)
        _broadcast(np.asarray([len(payload)], np.int32))
        _broadcast(buffer.view(np.int32))


def receive() -> tuple[str, tuple, dict]:
    """A follower's end: the next call process 0 sent (blocks until it sends one)."""
    length = int(_broadcast(np.zeros(1, np.int32))[0])
    buffer = _broadcast(np.zeros(_words(length), np.int32)).view(np.uint8)
    return pickle.loads(buffer[:length].tobytes())


def follow(engine: Any) -> int:
    """Replay process 0's device calls on `engine` (a BatchEngine built as process 0's, never
    started) until process 0 sends STOP; returns the number of calls replayed. A call that fails
    here failed on process 0 too (same code, same arguments): it is logged and the loop goes on."""
    replayed = 0
    started = time.perf_counter()
    while True:
        name, args, kwargs = receive()
        if name == STOP:
            log.info("process 0 stopped: %d device calls replayed in %.0f s", replayed, time.perf_counter() - started)
            return replayed
        if name == IDLE:
            continue
        if name not in REPLAYED:
            raise ValueError(f"process 0 sent an unknown call {name!r}")
        try:
            getattr(engine, name)(*args, **kwargs)
        except Exception:
            log.exception("replayed %s failed", name)
        replayed += 1
