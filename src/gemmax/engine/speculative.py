"""Host side of speculative decoding: the prompt-lookup proposer and each request's adaptive state
(the draft-model proposer is gemmax.engine.draft).

Prompt lookup (n-gram) proposes, for a context (prompt + output so far, ending with the token the
next step reads), the tokens that followed the most recent earlier occurrence of the context's last
n tokens, for n = 3, 2, 1 (the longest that matches). It needs no model and costs a few vectorised
comparisons over the context; it pays off where the output copies its input (rewrites, edits, code).

Adaptive k: a verify step costs more than a decode step (k + 1 positions per row, one host round
trip per step, where plain decoding keeps its next step queued behind the one being delivered), so a request whose proposals keep being
rejected backs off to plain decoding for a while (`RequestSpeculation`), doubling the pause each
time it backs off again, so a free-form request is never much slower than plain decoding.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gemmax.engine.api import SPEC_KS, SpeculationStats

MAX_NGRAM = 3
BACKOFF_BELOW = 0.5  # back off when the mean accepted proposals per verify step drops below this
BACKOFF_TOKENS = 16  # the first pause, in generated tokens; doubled at each further back-off
MAX_BACKOFF_TOKENS = 512
_DECAY = 0.7  # weight of the past in the running mean of accepted proposals per step


def propose_ngram(context: np.ndarray, k: int, max_n: int = MAX_NGRAM) -> np.ndarray:
    """Up to k tokens that followed an earlier occurrence of the context's last n tokens, for the
    largest n <= max_n that occurs earlier: the latest occurrence with k tokens after it, else the
    latest (in a loop the latest occurrence ends right before the suffix, so it would propose one
    token where an earlier one of the same loop proposes k); empty when no suffix token occurs
    earlier. context [L] int -> [<= k] int32."""
    length = len(context)
    for n in range(min(max_n, length - 1), 0, -1):
        suffix = context[length - n:]
        # Candidate starts i of an earlier occurrence: context[i : i + n] == suffix with i + n < length.
        windows = np.lib.stride_tricks.sliding_window_view(context[: length - 1], n)  # [L - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= length]
            start = (full[-1] if full.size else hits[-1]) + n
            return np.asarray(context[start : start + k], np.int32)
    return np.zeros(0, np.int32)


@dataclasses.dataclass
class RequestSpeculation:
    """One request's speculation: its method and k, the running acceptance and the back-off pause,
    and the counts reported in its result."""

    method: str
    k: int
    mean_accepted: float = float(BACKOFF_BELOW) * 2  # optimistic start: try before judging
    pause_until: int = 0  # generated-token count before which it decodes plainly
    pause: int = BACKOFF_TOKENS
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    accepted_lengths: list[int] = dataclasses.field(default_factory=lambda: [0] * (max(SPEC_KS) + 1))

    def active(self, generated: int) -> bool:
        """Whether the request speculates at its next step (False: inside a back-off pause)."""
        return generated >= self.pause_until

    def propose(self, context: np.ndarray, generated: int) -> np.ndarray:
        """Prompt lookup's proposals for the next verify step (empty: decode plainly this time); a
        draft model's are drawn on the device (gemmax.engine.draft)."""
        if not self.active(generated):
            return np.zeros(0, np.int32)
        return propose_ngram(context, self.k)

    def observe(self, proposed: int, accepted: int, generated: int) -> None:
        """One verify step's outcome; may start a back-off pause from `generated` tokens on."""
        self.steps += 1
        self.proposed += proposed
        self.accepted += accepted
        self.accepted_lengths[accepted] += 1
        self.mean_accepted = _DECAY * self.mean_accepted + (1 - _DECAY) * accepted
        if self.mean_accepted < BACKOFF_BELOW:
            self.pause_until = generated + self.pause
            self.pause = min(2 * self.pause, MAX_BACKOFF_TOKENS)
            self.mean_accepted = float(BACKOFF_BELOW) * 2

    def stats(self) -> SpeculationStats:
        used = max((n for n, count in enumerate(self.accepted_lengths) if count), default=0)
        return SpeculationStats(steps=self.steps, proposed=self.proposed, accepted=self.accepted,
                                accepted_lengths=tuple(self.accepted_lengths[: used + 1]))
