"""Incremental detokenizer and stop-string matcher (no server): deltas are final text, never revised,
their concatenation is the full decode, multi-byte characters and stop strings are held back."""

from __future__ import annotations

import random
import re

import pytest

from gemmax.server.detokenize import MAX_HELD_TOKENS, IncrementalDetokenizer, StopStringMatcher, TokenTable
from gemmax.server.protocol import ChatCompletionRequest, validation_message
from tiny_checkpoint import BYTE_OFFSET, VOCAB_SIZE


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    """A GPT-2 style byte-level BPE tokenizer (no byte-fallback tokens): the other decoder family."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from gemmax.weights.tokenizer import Tokenizer as Wrapper

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(["hello world, the cat sat on the mat"] * 10, trainer)
    return Wrapper(backend, None)


def stream_text(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str]:
    deltas = [detok.push(i) for i in ids]
    return deltas, "".join(deltas) + detok.flush()


@pytest.mark.parametrize("skip_special", [True, False])
def test_deltas_are_final_and_add_up_to_the_full_decode(tokenizer, skip_special):
    """Random ids, biased to byte-fallback tokens (whose runs decode as a whole) and specials."""
    table = TokenTable(tokenizer)
    rng = random.Random(0)
    for _ in range(400):
        ids = [rng.randrange(BYTE_OFFSET, BYTE_OFFSET + 256) if rng.random() < 0.6 else rng.randrange(VOCAB_SIZE)
               for _ in range(rng.randint(1, 40))]
        detok = IncrementalDetokenizer(tokenizer, skip_special, table)
        emitted = ""
        for k, token in enumerate(ids):
            emitted += detok.push(token)
            # what went out is never revised by later ids
            assert tokenizer.decode(ids[: k + 1], skip_special_tokens=skip_special).startswith(emitted)
        assert emitted + detok.flush() == tokenizer.decode(ids, skip_special_tokens=skip_special)


def test_multibyte_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("a € b", add_bos=False)
    pieces = [tokenizer.backend.id_to_token(i) for i in ids]
    assert pieces.count("<0xE2>") == 1  # "€" is three byte-fallback tokens
    deltas, text = stream_text(IncrementalDetokenizer(tokenizer), ids)
    assert text == "a € b"
    assert all("\ufffd" not in d for d in deltas)
    assert any("€" in d for d in deltas)  # whole, in one delta


def test_invalid_bytes_are_released_not_held_forever(tokenizer):
    """A stray continuation byte can never become valid: it goes out at once as U+FFFD."""
    stray = BYTE_OFFSET + 0x82
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(stray) == "\ufffd"


def test_byte_level_decoder(byte_level):
    ids = byte_level.encode("hello € world", add_bos=False)
    deltas, text = stream_text(IncrementalDetokenizer(byte_level), ids)
    assert text == "hello € world"
    assert all("\ufffd" not in d for d in deltas)
    # junk bytes that never complete are released after MAX_HELD_TOKENS ids, not at the end
    lead = byte_level.encode("€", add_bos=False)[0]  # an id whose bytes start a 3-byte character
    detok = IncrementalDetokenizer(byte_level)
    out = [detok.push(lead) for _ in range(MAX_HELD_TOKENS + 1)]
    assert "".join(out).count("\ufffd") >= 1


def test_without_tokenizer_text_is_empty():
    detok = IncrementalDetokenizer(None)
    assert detok.push(5) == "" and detok.flush() == ""


def feed_all(matcher: StopStringMatcher, parts: list[str]) -> tuple[list[str], str | None]:
    out = []
    for part in parts:
        text, stop = matcher.feed(part)
        out.append(text)
        if stop is not None:
            return out, stop
    out.append(matcher.flush())
    return out, None


def test_stop_string_never_leaks_partially():
    out, stop = feed_all(StopStringMatcher(["STOP"]), ["ab", "S", "T", "O", "P", "cd"])
    assert stop == "STOP" and "".join(out) == "ab"
    assert out == ["ab", "", "", "", ""]


def test_partial_match_that_fails_is_released():
    out, stop = feed_all(StopStringMatcher(["STOP"]), ["xS", "T", "x", "y"])
    assert stop is None and "".join(out) == "xSTxy"
    assert out[:2] == ["x", ""]  # "S", "ST" held while they could still start "STOP"


def test_earliest_stop_wins_and_include_stop():
    out, stop = feed_all(StopStringMatcher(["world", "o w"]), ["hello world"])
    assert stop == "o w" and out == ["hell"]
    out, stop = feed_all(StopStringMatcher(["world"], include_stop=True), ["hello wor", "ld!"])
    assert stop == "world" and "".join(out) == "hello world"


def test_held_text_is_flushed_at_the_end():
    out, stop = feed_all(StopStringMatcher(["STOP"]), ["abST"])
    assert stop is None and out == ["ab", "ST"]


def test_opaque_strings_pass_through_and_never_match():
    """With the special tokens' strings opaque, stop strings match on the text without them (here
    "ab" across a marker), never inside them ("<|" is never a match nor held), and the text released
    keeps them; what is held, or cut, starts at a visible character, so a marker before it is
    released whatever the deltas' grouping and whichever other stop strings there are."""
    opaque = re.compile(r"<\|channel>|<\|tool_call>")
    out, stop = feed_all(StopStringMatcher(["<|", "zz"], opaque=opaque), ["x<|channel>y", "<|tool_call>w"])
    assert stop is None and out == ["x<|channel>y", "<|tool_call>w", ""]
    out, stop = feed_all(StopStringMatcher(["ab"], opaque=opaque), ["xa", "<|tool_call>", "b!"])
    assert stop == "ab" and out == ["x", "", ""]
    for stops in (["abc", "xy"], ["xy"]):
        out, stop = feed_all(StopStringMatcher(stops, opaque=opaque), ["a", "<|tool_call>", "x", "y"])
        assert stop == "xy" and "".join(out) == "a<|tool_call>", stops
    out, stop = feed_all(StopStringMatcher(["ab"], include_stop=True, opaque=opaque), ["xa<|tool_call>b<|channel>c"])
    assert stop == "ab" and out == ["xa<|tool_call>b"]
    out, stop = feed_all(StopStringMatcher(["ab"], opaque=opaque), ["xa<|tool_call>", "c"])
    assert stop is None and "".join(out) == "xa<|tool_call>c" and out[0] == "x"
    out, stop = feed_all(StopStringMatcher(["ab"], opaque=opaque), ["x<|channel>ab"])
    assert stop == "ab" and out == ["x<|channel>"]


def test_validation_message_has_no_pydantic_internals():
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"})
    message, param = validation_message(info.value)
    assert param == "temperature"
    assert message.startswith("temperature: ") and "'hot'" in message
    for leak in ("pydantic", "https://", "float_type", "ValidationError", "input_value"):
        assert leak not in message
