"""Run the app with uvicorn while the model loads in the background.

uvicorn binds at once, so `/health` answers 503 ("loading", then "warming") from the first second;
`load()` (load weights, build and start the engine) runs in a thread and its engine is attached when
it returns. If loading or the engine's warm-up fails the server exits with status 1 and the error is
logged. SIGTERM / Ctrl-C:
uvicorn stops accepting, waits up to `settings.drain_timeout` seconds for in-flight requests, then
the app's shutdown drains and stops the engine, and the process exits with status 0.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from gemmax.server.app import ServerSettings, create_app, is_loopback

log = logging.getLogger("gemmax.server")


def serve(load: Callable[[], tuple[Any, Any]], settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", uds: str | None = None) -> int:
    """`load() -> (engine, tokenizer)`; returns the process exit status. `uds`: listen on this Unix
    socket instead of host:port (a machine that refuses TCP sockets, loopback included, as the TPU
    machines gemmax was checked on do; a reverse proxy on the same host). A socket reaches only this
    machine, so the app treats it as a loopback bind (the Host header must name loopback)."""
    import uvicorn

    settings = dataclasses.replace(settings, host="127.0.0.1" if uds is not None else host)
    if uds is None and not is_loopback(host) and not settings.api_key:
        log.warning("serving on %s without an API key: anyone who can reach this address can use the model "
                    "(set --api-key or GEMMAX_API_KEY; docs/server.md, threat model)", host)
    app = create_app(None, None, settings)
    state = app.state.gemmax
    bind = {"uds": uds} if uds is not None else {"host": host, "port": port}
    server = uvicorn.Server(uvicorn.Config(app, **bind, log_level=log_level, access_log=False,
                                           timeout_graceful_shutdown=settings.drain_timeout))

    def loader() -> None:
        try:
            engine, tokenizer = load()
        except BaseException as exc:  # report it, and stop serving a model that will never be ready
            log.exception("loading the model failed")
            state.fail(f"{type(exc).__name__}: {exc}")
            server.should_exit = True
            return
        state.attach(engine, tokenizer)
        log.info("model loaded; the engine is warming up (GET /health turns 200 when it is ready)")
        try:
            engine.wait_ready()
        except BaseException as exc:  # warm-up failed: exit like a failed load, not a zombie 503
            log.exception("engine warm-up failed")
            state.fail(f"{type(exc).__name__}: {exc}")
            server.should_exit = True

    threading.Thread(target=loader, name="gemmax-load", daemon=True).start()
    # uvicorn handles SIGTERM / SIGINT while it runs (graceful drain), then re-raises the signal into the
    # handler that was installed before it: with this no-op one, a drained server exits with status 0.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if state.load_error is not None else 0
