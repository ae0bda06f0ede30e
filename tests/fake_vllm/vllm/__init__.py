"""A stand-in for vLLM in the rig tests (tests/test_rigs_vllm.py): only its OpenAI server module."""

__version__ = "0.0.0+fake"
