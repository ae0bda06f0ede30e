"""Other runtimes behind the same OpenAI-compatible API, for side-by-side benchmarks:
`transformers_server` (HF transformers reference server), `vllm` (the `vllm serve` command line),
`registry` (rigs by name: list, build the command, start, wait for /health)."""
