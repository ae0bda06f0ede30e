"""OpenAI-compatible HTTP server over one engine (docs/server.md).

`create_app(engine, tokenizer, settings)` builds the FastAPI app; `gemmax serve` (gemmax.cli) loads a
model, starts the batch engine and runs the app with uvicorn.
"""

from gemmax.server.app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
