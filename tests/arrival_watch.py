"""Watches a running engine's device calls for the tests of when an arrival is prefilled: every
decode forward and prefill chunk in order, and one request submitted during the first forward of the
engine's second decode dispatch after `arm()`."""

from __future__ import annotations

from gemmax.engine.api import GenerationRequest


class ArrivalWatch:
    def __init__(self, engine, monkeypatch, late: GenerationRequest):
        self.engine, self.late = engine, late
        self.events: list[str] = []  # "forward", "prefill", "arrived"
        self.handle = None  # the late request's, once submitted
        self._armed = self._fresh = False
        self._dispatches = 0
        forward, prefill, dispatch = engine._forward, engine._run_prefill, engine._decode_dispatch

        def watched_dispatch():
            self._dispatches += 1
            self._fresh = True
            return dispatch()

        def watched_forward(*args):
            self.events.append("forward")
            if self._armed and self._fresh and self._dispatches == 2:  # the second dispatch's first step
                self._armed = False
                self.handle = engine.submit(late)
                self.events.append("arrived")
            self._fresh = False
            return forward(*args)

        def watched_prefill(tokens, *args):
            self.events.append("prefill")
            return prefill(tokens, *args)

        monkeypatch.setattr(engine, "_forward", watched_forward)
        monkeypatch.setattr(engine, "_run_prefill", watched_prefill)
        monkeypatch.setattr(engine, "_decode_dispatch", watched_dispatch)

    def arm(self) -> None:
        """The late request arrives during the next request's second dispatch."""
        self.events.clear()
        self._armed, self._dispatches = True, 0

    def after_arrival(self) -> list[str]:
        assert "arrived" in self.events, self.events
        return self.events[self.events.index("arrived") + 1 :]
