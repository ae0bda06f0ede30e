"""`gemmax bench`: times any OpenAI-compatible endpoint from the wire, the same way for every
runtime (gemmax, the HF transformers rig, vLLM), so the runtime is the only variable.

timing   one streamed request -> TTFT, ITL, TPOT, latency (vllm bench serve's definitions)
prompts  exact-token-count prompts with unique nonces (server /tokenize, local tokenizer, or ids)
sweep    input lengths x load levels, warm-up rounds, repeats, decode source (stream/gauge/both/auto)
metrics  vLLM-named per-cell metrics, spread, gauge resolution
report   rich table, JSON file, one-line summary
compare  side-by-side tables across result files (wire figures only across rigs)
plots    decode tok/s and TTFT against input length, one line per rig
"""
