"""Prompts of an exact token count, each opening with a unique nonce.

The count is the server's: the number of tokens its `/tokenize` returns for the text, which is what
its `/v1/completions` will prefill (special tokens such as `<bos>` included, as vLLM counts them).
Every prompt starts with a nonce that differs between every request of a run (warm-ups included),
so no prefix cache can serve one request from another and flatter a runtime: a block cache shares
nothing, a token-level (radix) cache at most the few tokens two nonces happen to share.

Three sources, chosen in this order by `mode="auto"`:

- `server` text: the server answers `/tokenize`. Text = nonce + a slice of seeded filler prose;
  the slice length in characters is searched (gallop from the last hit, then bisect) until the
  server counts exactly `n` tokens.
- `local` text: same search, counting with a local tokenizer directory (`--tokenizer DIR`,
  `<bos>` prepended as gemmax and the Gemma servers do).
- `ids`: no tokenizer anywhere (tiny random test checkpoints). The prompt is a list of `n` token ids
  sent as is (OpenAI's `prompt: [int, ...]`): 4 nonce ids (the run salt plus the request index
  written in base `vocab_size - 4`, lowest digit first, so consecutive requests differ at the first
  id), then seeded random filler ids. All ids lie in
  [4, vocab_size) so none is pad / eos / bos / unk in the Gemma vocabularies. `vocab_size` comes
  from `/v1/models` (`vocab_size` of the model entry) or `--vocab-size`.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

FIRST_ID = 4  # ids below this are pad / eos / bos / unk in Gemma vocabularies
NONCE_IDS = 4

FILLER_WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from",
    "his", "her", "they", "this", "which", "an", "be", "or", "are", "had", "not", "but", "were", "their",
    "one", "all", "there", "been", "has", "when", "who", "will", "more", "no", "if", "out", "so", "said",
    "what", "up", "its", "about", "into", "than", "them", "can", "only", "other", "new", "some", "could",
    "time", "these", "two", "may", "then", "do", "first", "any", "my", "now", "such", "like", "our",
    "over", "man", "me", "even", "most", "made", "after", "also", "did", "many", "before", "must",
    "through", "back", "years", "where", "much", "your", "way", "well", "down", "should", "because",
    "each", "just", "those", "people", "how", "too", "little", "state", "good", "very", "make", "world",
    "still", "own", "see", "men", "work", "long", "get", "here", "between", "both", "life", "being",
    "under", "never", "day", "same", "another", "know", "while", "last", "might", "us", "great", "old",
    "year", "off", "come", "since", "against", "go", "came", "right", "used", "take", "three", "river",
    "garden", "window", "morning", "letter", "station", "village", "mountain", "harbor", "lantern",
    "engine", "bridge", "quiet", "bright", "narrow", "gentle", "distant", "early", "heavy", "simple",
    "careful",
)


def filler_text(n_chars: int, seed: int) -> str:
    """Seeded prose-like filler of at least `n_chars` characters."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_chars:
        sentence = " ".join(rng.choice(FILLER_WORDS) for _ in range(rng.randint(6, 14))).capitalize() + ". "
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)


CountFn = Callable[[str], Awaitable[int]]


def server_counter(client: httpx.AsyncClient, model: str) -> CountFn:
    async def count(text: str) -> int:
        response = await client.post("/tokenize", json={"model": model, "prompt": text})
        response.raise_for_status()
        body = response.json()
        return int(body["count"]) if "count" in body else len(body["tokens"])

    return count


def local_counter(tokenizer_dir: Path) -> CountFn:
    from gemmax.weights.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(Path(tokenizer_dir))
    if tokenizer is None:
        raise ValueError(f"no tokenizer.json in {tokenizer_dir}")

    async def count(text: str) -> int:
        return len(tokenizer.encode(text))

    return count


class TextPrompts:
    """Exact-count text prompts, counted by `count` (the server's /tokenize or a local tokenizer)."""

    def __init__(self, count: CountFn, mode: str, seed: int = 0):
        self.count, self.mode, self.seed = count, mode, seed
        self.salt = secrets.randbits(32)
        self._hint: dict[int, int] = {}  # target tokens -> characters of filler that hit it last time

    def nonce(self, index: int) -> str:
        """8 hex digits, a bijection of the request index (odd multiplier mod 2^32, xor a run salt):
        unique within the run, and two requests usually differ from the first character on."""
        return f"{((index + 1) * 0x9E3779B1 ^ self.salt) & 0xFFFFFFFF:08x}"

    async def build(self, n: int, index: int) -> str:
        prefix = f"{self.nonce(index)} "
        filler = filler_text(8 * n + 256, self.seed + n)
        text = await self._fit(prefix, filler, n)
        return text

    async def _fit(self, prefix: str, filler: str, n: int) -> str:
        counts: dict[int, int] = {}

        async def at(chars: int) -> int:
            if chars not in counts:
                counts[chars] = await self.count(prefix + filler[:chars])
            return counts[chars]

        if await at(0) > n:
            raise ValueError(f"cannot build a {n}-token prompt: the nonce alone is {counts[0]} tokens")
        # Gallop from the last hit to a bracket at(lo) <= n < at(hi), then bisect.
        c = min(self._hint.get(n, 4 * n), len(filler))
        step = 2 if n in self._hint else 64
        if await at(c) <= n:
            lo, hi = c, None
            while hi is None:
                probe = min(lo + step, len(filler))
                if await at(probe) > n:
                    hi = probe
                elif probe == len(filler):
                    raise ValueError(f"filler too short for a {n}-token prompt")
                else:
                    lo, step = probe, step * 2
        else:
            lo, hi = None, c
            while lo is None:
                probe = max(hi - step, 0)
                if await at(probe) <= n:
                    lo = probe
                else:
                    hi, step = probe, step * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if await at(mid) <= n:
                lo = mid
            else:
                hi = mid
        # Token counts are near-monotone in the cut; where one character adds two tokens, look nearby.
        for chars in sorted(range(max(lo - 16, 0), min(lo + 17, len(filler) + 1)), key=lambda x: abs(x - lo)):
            if await at(chars) == n:
                self._hint[n] = chars
                return prefix + filler[:chars]
        raise ValueError(f"no cut of the filler gives exactly {n} tokens (closest: {counts[lo]} at {lo} chars)")


class IdPrompts:
    """Exact-length token-id prompts for servers without a tokenizer (see the module docstring)."""

    mode = "ids"

    def __init__(self, vocab_size: int, seed: int = 0):
        if vocab_size <= FIRST_ID + 1:
            raise ValueError(f"vocab_size {vocab_size} leaves no ids >= {FIRST_ID} for prompts")
        self.vocab_size, self.seed = vocab_size, seed
        self.salt = secrets.randbelow((vocab_size - FIRST_ID) ** NONCE_IDS)

    def nonce(self, index: int) -> list[int]:
        base = self.vocab_size - FIRST_ID
        value = (self.salt + index) % base**NONCE_IDS
        digits = []
        for _ in range(NONCE_IDS):
            value, digit = divmod(value, base)
            digits.append(FIRST_ID + digit)
        return digits

    async def build(self, n: int, index: int) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + n)
        filler = [rng.randrange(FIRST_ID, self.vocab_size) for _ in range(max(n - NONCE_IDS, 0))]
        return (self.nonce(index) + filler)[:n]


async def resolve_prompts(client: httpx.AsyncClient, model: str, mode: str, tokenizer: Path | None,
                          vocab_size: int | None, seed: int) -> TextPrompts | IdPrompts:
    """Pick the prompt source (`auto`: server /tokenize, else local tokenizer, else token ids)."""
    if mode not in ("auto", "server", "local", "ids"):
        raise ValueError(f"prompt mode must be auto, server, local or ids, got {mode!r}")
    if mode in ("auto", "server"):
        counter = server_counter(client, model)
        try:
            await counter("hello")
            return TextPrompts(counter, "server", seed)
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            if mode == "server":
                raise ValueError(f"the server's /tokenize does not count text: {exc}") from exc
    if mode == "local" or (mode == "auto" and tokenizer is not None):
        if tokenizer is None:
            raise ValueError("--prompt-mode local needs --tokenizer DIR")
        return TextPrompts(local_counter(tokenizer), "local", seed)
    if vocab_size is None:
        raise ValueError("the server has no /tokenize and no --tokenizer was given: token-id prompts "
                         "need the vocabulary size (the model entry's `vocab_size` or --vocab-size)")
    return IdPrompts(vocab_size, seed)
