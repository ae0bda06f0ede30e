"""The model: a frozen config, parameter specs, the KV cache and the Gemma 4 / Gemma 3 text decoder as
pure functions over pytrees. Imports nothing else of gemmax: every layer above builds on it."""
