"""Where weights come from: a `--model` resolved once into a `ModelSource`, then read by its loader
(HF safetensors directory, GGUF file, the built-in model) with its tokenizer."""
