"""A tiny random Gemma 4 checkpoint with a real tokenizer and chat template, for end-to-end tests.

`write_tokenizer(dir)` writes a Gemma-style tokenizer (byte-fallback BPE, `▁` for spaces, specials
`<pad> <eos> <bos> <unk> <|turn> <turn|>`), `tokenizer_config.json` and a `chat_template.jinja` that
renders the Gemma 4 turn format (`<bos><|turn>user\\nHello<turn|>\\n<|turn>model\\n`).
`write_tiny_checkpoint(dir)` adds random weights from transformers (tests/hf_reference.py configs) whose
vocabulary matches the tokenizer, so `gemmax.engine.loading.load_model(dir)` loads model and tokenizer
together. Characters outside the learned vocabulary (e.g. "é", "€") fall back to byte tokens, so a
multi-byte character spans several tokens, which is what the server's UTF-8 hold-back must handle.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>")
PAD_ID, EOS_ID, BOS_ID, UNK_ID, TURN_OPEN_ID, TURN_CLOSE_ID = range(len(SPECIALS))
BYTE_OFFSET = len(SPECIALS)  # ids 6..261 are <0x00>..<0xFF>
VOCAB_SIZE = 512

# Gemma 4 turn format; one line so trim_blocks / lstrip_blocks cannot eat a newline.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\\n' + message['content'] | trim + '<turn|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|turn>model\\n' }}{% endif %}"
)

CORPUS = [
    "Hello world, this is a tiny model that speaks in short sentences.",
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "Once upon a time there was a small server that answered every request with care.",
    "Numbers like 12, 345 and 6789 appear in text; so do words such as token, stream and batch.",
    "What is the capital of France? Paris is the capital of France.",
    "She said: please stop here. He said: go on, keep going, until the end of the line.",
    "def main():\n    print('hello')\n    return 0\n",
] * 4


def write_tokenizer(directory: Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """tokenizer.json + tokenizer_config.json + chat_template.jinja with exactly `vocab_size` tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    learned_size = vocab_size - BYTE_OFFSET - 256
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Replace(" ", "▁")
    alphabet = [chr(c) for c in range(0x21, 0x7F)] + ["▁", "\n"]
    trainer = trainers.BpeTrainer(vocab_size=learned_size, initial_alphabet=alphabet, show_progress=False)
    trainer_tok.train_from_iterator(CORPUS, trainer)
    learned = json.loads(trainer_tok.to_str())["model"]
    learned_tokens = sorted(learned["vocab"], key=learned["vocab"].get)

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"<0x{b:02X}>": BYTE_OFFSET + b for b in range(256)})
    for tok in learned_tokens:
        vocab.setdefault(tok, len(vocab))
    if len(vocab) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(vocab)} tokens, wanted {vocab_size}: adjust the corpus")
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "model_max_length": 4096,
    }, indent=1))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return directory


def write_tiny_checkpoint(directory: Path, name: str = "g4_shared", seed: int = 0,
                          vocab_size: int = VOCAB_SIZE) -> Path:
    """Random Gemma 4 weights (a tests/hf_reference.py config with the vocabulary widened to the
    tokenizer's) plus the tokenizer files; eos is `<eos>` and `<turn|>` as in the real chat models."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from hf_reference import GEMMA4_CONFIGS, randomize_norms

    torch.manual_seed(seed)
    fields = dict(GEMMA4_CONFIGS[name], vocab_size=vocab_size)
    if fields.get("hidden_size_per_layer_input"):
        fields["vocab_size_per_layer_input"] = vocab_size
    config = Gemma4TextConfig(**fields, attn_implementation="eager", pad_token_id=PAD_ID, bos_token_id=BOS_ID,
                              eos_token_id=[EOS_ID, TURN_CLOSE_ID])
    model = Gemma4ForCausalLM(config).eval()
    randomize_norms(model, seed)
    model.save_pretrained(directory)
    write_tokenizer(directory, vocab_size)
    return directory
