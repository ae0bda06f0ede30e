"""gemmax: a pure-JAX inference engine for Gemma 4 (and Gemma 3) text models.

Layers (see docs/architecture.md): model -> checkpoint -> engine -> server; bench, rigs, profile and
mcp sit beside them and talk over HTTP or the CLI.
"""

__version__ = "0.1.0"
