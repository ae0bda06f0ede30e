"""Shape planning, pure functions of the deployment's sizes: the prefill buckets, how a prompt is
split into chunks of them, the KV-length buckets, and the batched prefill shapes a warm-up must
compile. Nothing here touches a device."""

from __future__ import annotations

import dataclasses
import functools


def prefill_buckets(max_model_len: int, buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The declared prefill lengths that fit max_model_len (at least one). A chunk of one token would
    take the forward's decode path (write, then attend), whose KV bound must cover the new position,
    where a prefill chunk's covers only the past: a bucket of 1 is refused."""
    if min(buckets, default=2) < 2:
        raise ValueError(f"prefill buckets must be at least 2 tokens, got {tuple(buckets)}")
    fitting = tuple(b for b in sorted(buckets) if b <= max_model_len)
    return fitting or (max_model_len,)


def plan_chunks(prompt_len: int, buckets: tuple[int, ...]) -> list[tuple[int, int]]:
    """[(real tokens, bucket)] covering the prompt: full chunks of the largest bucket while more than
    it remains, then the cheapest cover of the rest (`_tail_plans`)."""
    largest = buckets[-1]
    full = max(0, -(-prompt_len // largest) - 1)
    return [(largest, largest)] * full + list(_tail_plans(buckets)[prompt_len - full * largest])


@functools.lru_cache(maxsize=8)
def _tail_plans(buckets: tuple[int, ...]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """plans[r] for r = 0 .. the largest bucket: the chunks covering r tokens that cost the fewest bucket
    tokens plus, per chunk, the smallest bucket's worth (a chunk's fixed cost: one pass over the
    weights); ties go to fewer chunks. Full chunks come first, the partial one last. With buckets
    (32, 128, 512, 2048) a 521-token prompt prefills as 512 + 32 (9 real) instead of one 2048."""
    overhead = buckets[0]
    best: list[tuple[tuple[int, int], tuple[tuple[int, int], ...]]] = [((0, 0), ())]
    for r in range(1, buckets[-1] + 1):
        fits = next(b for b in buckets if b >= r)
        options = [((overhead + fits, 1), ((r, fits),))]
        for b in reversed(buckets):  # on a tie, the larger full chunk first
            if b < r:
                (tokens, count), rest = best[r - b]
                options.append(((tokens + overhead + b, count + 1), ((b, b), *rest)))
        best.append(min(options, key=lambda option: option[0]))
    return tuple(chunks for _, chunks in best)


MIN_BATCHED_ROWS = 2  # a batched prefill shape takes 2 prompts or more (a policy may ask more)


def prefill_groups(buckets: tuple[int, ...], decode_groups: tuple[int, ...], group_kv: int,
                   batched: tuple[int, ...] | None = None, min_rows: int | None = None) -> tuple[tuple[int, int], ...]:
    """(rows, bucket) of the batched prefill shapes: one chunk of several prompts in one forward
    (steps.prefill_rows), for every decode group size of `min_rows` rows or more (None:
    MIN_BATCHED_ROWS) whose rows x bucket tokens fit in the largest bucket (the token budget one
    prefill chunk has, so a batched chunk takes no more activation memory than the largest chunk,
    and no longer than it), and every bucket of `batched` (None: every bucket) whose chunks can end
    within `group_kv` (the smallest KV bound: the one KV bound they are compiled for)."""
    budget, least = buckets[-1], max(MIN_BATCHED_ROWS, min_rows or 0)
    return tuple((rows, bucket) for bucket in buckets if bucket <= group_kv and (batched is None or bucket in batched)
                 for rows in decode_groups if rows >= least and rows * bucket <= budget)


def kv_buckets(max_model_len: int) -> tuple[int, ...]:
    """Static bounds on the cache slots a step reads: 256, 1024, 4096 ... (x4), capped by and ending
    at max_model_len. Attention then costs what the context uses."""
    buckets, size = [], 256
    while size < max_model_len:
        buckets.append(size)
        size *= 4
    return (*buckets, max_model_len)


# Compiled decode group sizes below the slot count: a decode step costs about its batch on CPU.
GROUP_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclasses.dataclass(frozen=True)
class ShapePlan:
    """The compiled-shape set of one deployment, and the rules that map work onto it."""

    max_model_len: int
    slots: int
    buckets: tuple[int, ...]  # prefill chunk lengths (`prefill_buckets`)
    decode_groups: tuple[int, ...]  # slot counts a decode step is compiled for; the last is every slot
    kv_buckets: tuple[int, ...]  # KV-length bounds (`kv_buckets`)
    prefill_groups: tuple[tuple[int, int], ...] = ()  # (rows, bucket) of batched prefills (`prefill_groups`)

    @classmethod
    def create(cls, max_model_len: int, slots: int, buckets: tuple[int, ...], batched_prefill: bool = True,
               batched_buckets: tuple[int, ...] | None = None, batched_min_rows: int | None = None) -> ShapePlan:
        """`batched_buckets`: the buckets with batched prefill shapes (None: every one);
        `batched_min_rows`: the fewest prompts such a shape takes (None: MIN_BATCHED_ROWS)."""
        fitting = prefill_buckets(max_model_len, buckets)
        decode_groups = tuple(g for g in GROUP_SIZES if g < slots) + (slots,)
        return cls(max_model_len=max_model_len, slots=slots, buckets=fitting, decode_groups=decode_groups,
                   kv_buckets=kv_buckets(max_model_len),
                   prefill_groups=prefill_groups(fitting, decode_groups, kv_buckets(max_model_len)[0], batched_buckets,
                                                 batched_min_rows)
                   if batched_prefill else ())

    def kv_bound(self, tokens: int) -> int:
        """The smallest KV-length bucket that holds `tokens` cached positions."""
        return next((b for b in self.kv_buckets if b >= tokens), self.max_model_len)

    def group_size(self, active: int) -> int:
        """The smallest compiled decode group that holds `active` slots."""
        return next(g for g in self.decode_groups if g >= active)

    def warm_starts(self, bucket: int) -> tuple[int, ...]:
        """The chunk starts at which warm-up runs the one-slot prefill program of `bucket`, one for each
        past its chunks can read (XLA:CPU sets up each branch of a program on its first run): 0 reads
        none, a start s > 0 the first KV bound that holds it (`forward.past_bounds`), so 0, 1 and one
        past each bound below the largest. The largest bucket runs at 0 only: three more 512-token
        chunks would cost every start about 1.3 s on the built-in model, where their branches' set-up
        costs a 2,000-token prompt's first request 0.4 s."""
        if bucket == self.buckets[-1]:
            return (0,)
        return (0, 1, *(bound + 1 for bound in self.kv_buckets[:-1] if bound + 1 < self.max_model_len))

    @property
    def group_kv(self) -> int:
        """The KV bound of every batched prefill shape (the smallest KV bucket)."""
        return self.kv_buckets[0]

    def group_buckets(self, chunks: list[tuple[int, int]]) -> tuple[int, ...] | None:
        """The bucket of each chunk of a prompt's plan (`plan_chunks`) when a batched prefill can take
        it, chunk by chunk with prompts of the same plan: every chunk has a group shape and ends
        within `group_kv`, and every chunk but the last is full (the batched forward starts a chunk
        at the same position in every prompt). None: it prefills alone."""
        have = {bucket for _, bucket in self.prefill_groups}
        start = 0
        for index, (real, bucket) in enumerate(chunks):
            if bucket not in have or start + bucket > self.group_kv or (real < bucket and index < len(chunks) - 1):
                return None
            start += real
        return tuple(bucket for _, bucket in chunks)

    def prefill_group(self, prompts: int, buckets: tuple[int, ...]) -> int | None:
        """Rows of the batched shapes that take `prompts` prompts whose chunks have `buckets`: the
        smallest group size compiled for every one of those buckets that holds them all, else the
        largest (the rest go in a next group); None when they are fewer than the smallest (they
        prefill one at a time: its idle rows would cost more than the prompts share)."""
        sizes = sorted(set.intersection(*({rows for rows, b in self.prefill_groups if b == bucket}
                                          for bucket in buckets)))
        if prompts < sizes[0]:
            return None
        return next((rows for rows in sizes if rows >= prompts), sizes[-1])
