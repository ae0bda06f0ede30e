"""The degeneracy check every result passes: HTTP 200 is not evidence of a sane answer.

Two signatures of a broken model or cache (the "The The The" bug): a short-period token loop in the
tail of the output, and a collapse of distinct tokens over a long output. Short outputs are never
judged (too little evidence). The verdict is pure data; the engine attaches it to every result.
"""

from __future__ import annotations

from collections.abc import Sequence

from gemmax.engine.api import DegeneracyVerdict

MAX_PERIOD = 8  # token loops of period 1..8 ("The The The", "a b a b", short phrases)
MIN_REPEATS = 6  # the period must repeat this many times back to back at the end of the output
MIN_LOOP_TOKENS = 16  # ... covering at least this many tokens
COLLAPSE_MIN_TOKENS = 64
COLLAPSE_MAX_DISTINCT_RATIO = 0.08  # fewer than 8% distinct tokens over >= 64 tokens


def tail_period(tokens: Sequence[int]) -> tuple[int, int] | None:
    """(period, repeats) of the shortest period that repeats >= MIN_REPEATS times at the end, or None."""
    n = len(tokens)
    for period in range(1, MAX_PERIOD + 1):
        length = period
        while length + period <= n and tokens[n - length - period : n - length] == tokens[n - period :]:
            length += period
        # `length` tokens at the end are `length / period` copies of the last `period` tokens
        repeats = length // period
        if repeats >= MIN_REPEATS and length >= MIN_LOOP_TOKENS:
            return period, repeats
    return None


def check_degeneracy(tokens: Sequence[int]) -> DegeneracyVerdict:
    tokens = list(tokens)
    loop = tail_period(tokens)
    if loop is not None:
        period, repeats = loop
        return DegeneracyVerdict(True, f"token loop: period {period} repeated {repeats} times at the end of the output")
    if len(tokens) >= COLLAPSE_MIN_TOKENS:
        distinct = len(set(tokens))
        if distinct / len(tokens) < COLLAPSE_MAX_DISTINCT_RATIO:
            return DegeneracyVerdict(True, f"token collapse: {distinct} distinct tokens in {len(tokens)}")
    return DegeneracyVerdict(False, None)
