"""JAX's persistent compilation cache: where it lives, whether a start hit it, and moving it.

The first request must not pay compilation: the engine compiles every declared shape at start-up,
and the persistent cache makes a restart skip the XLA work. `track` counts cache hits and misses
through JAX's own monitoring events during warm-up. Before that, `scrub` checks every entry (each is
compressed with a checksum): JAX would read a corrupted one, warn, recompile and keep the corrupt file
forever (it never overwrites an entry); scrubbed entries are logged once and removed, so the
compilation that follows writes them anew. `export_cache` / `import_cache` move the cache
directory as a tarball, to a local path or any URL fsspec understands (s3://, gs://, ...).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import logging
import os
import tarfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import jax
import platformdirs
from jax import monitoring

log = logging.getLogger("gemmax.engine")

_HIT = "/jax/compilation_cache/cache_hits"
_MISS = "/jax/compilation_cache/cache_misses"


def cache_root() -> Path:
    """gemmax's cache directory ($GEMMAX_COMPILE_CACHE, else the user cache dir)."""
    return Path(os.environ.get("GEMMAX_COMPILE_CACHE", platformdirs.user_cache_dir("gemmax")))


def default_cache_dir() -> Path:
    return cache_root() / "xla"


def enable(directory: str | Path | None = None) -> Path:
    """Point JAX's persistent compilation cache at `directory` (default: the user cache dir)."""
    path = Path(directory) if directory else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


class Tracker:
    def __init__(self, directory: Path):
        self.directory = directory
        self.hits = 0
        self.misses = 0
        self.scrubbed: list[str] = []

    def __call__(self, event: str, **_: object) -> None:
        if event == _HIT:
            self.hits += 1
        elif event == _MISS:
            self.misses += 1

    def summary(self) -> dict[str, object]:
        return {"cache_dir": str(self.directory), "cache_hits": self.hits, "cache_misses": self.misses,
                "cache_hit": self.hits > 0 and self.misses == 0, "corrupt_entries_replaced": len(self.scrubbed)}


ENTRY_SUFFIX = "-cache"  # JAX's file cache: KEY-cache (the entry) and KEY-atime (its access time)


def scrub(directory: str | Path) -> list[str]:
    """Remove the entries of the cache at `directory` that do not decompress (truncated, overwritten,
    bit-flipped: the compression's checksum fails) or hold no executable; one warning names them.
    Returns the removed entries' names."""
    from jax._src.compilation_cache import decompress_executable

    corrupt = []
    for entry in sorted(Path(directory).glob(f"*{ENTRY_SUFFIX}")):
        try:
            if len(decompress_executable(entry.read_bytes())) <= 8:  # 8 bytes of compile time, then the executable
                raise ValueError("no executable")
        except Exception:  # zlib.error, zstd errors, OSError
            corrupt.append(entry.name)
            entry.unlink(missing_ok=True)
            entry.with_name(entry.name.removesuffix(ENTRY_SUFFIX) + "-atime").unlink(missing_ok=True)
    if corrupt:
        log.warning("compile cache %s: %d corrupted entries removed, they are compiled and written anew: %s",
                    directory, len(corrupt), ", ".join(corrupt))
    return corrupt


@contextlib.contextmanager
def track(directory: str | Path | None = None) -> Iterator[Tracker]:
    """Enable the persistent cache (its corrupted entries scrubbed first) and count its hits / misses
    while the block runs."""
    path = enable(directory)
    tracker = Tracker(path)
    tracker.scrubbed = scrub(path)
    monitoring.register_event_listener(tracker)
    try:
        yield tracker
    finally:
        monitoring.unregister_event_listener(tracker)


def export_cache(dest: str, directory: str | Path | None = None) -> int:
    """Write the cache directory as a .tar.gz to a local path or fsspec URL; returns bytes written."""
    source = Path(directory) if directory else default_cache_dir()
    if not source.is_dir():
        raise FileNotFoundError(f"no compilation cache at {source}")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(source, arcname="xla")
    data = buffer.getvalue()
    with _open(dest, "wb") as f:
        f.write(data)
    return len(data)


def import_cache(src: str, directory: str | Path | None = None) -> int:
    """Unpack a tarball made by export_cache into the cache directory; returns files restored."""
    target = (Path(directory) if directory else default_cache_dir())
    target.mkdir(parents=True, exist_ok=True)
    target = target.resolve()
    with _open(src, "rb") as f:
        data = f.read()
    count = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            # every header first: that reads the whole stream, so a truncated or damaged archive
            # is refused before any file is written
            members = [m for m in tar.getmembers()
                       if m.isfile() and m.name.startswith("xla/") and ".." not in Path(m.name).parts]
            for member in members:
                out = target / Path(member.name).relative_to("xla")
                out.parent.mkdir(parents=True, exist_ok=True)
                if not out.parent.resolve().is_relative_to(target):  # a symlinked folder inside the cache
                    raise ValueError(f"{member.name} would be written outside {target}")
                out.unlink(missing_ok=True)  # never write through a symlink left at that name
                out.write_bytes(tar.extractfile(member).read())
                count += 1
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ValueError(f"{src} is not a complete compile-cache tarball (`gemmax cache export` writes one): "
                         f"{type(exc).__name__}: {exc}") from None
    return count


def _open(url: str, mode: str):
    if "://" in url and not url.startswith("file://"):
        try:
            import fsspec
        except ImportError as exc:  # pragma: no cover - fsspec is a dependency
            raise RuntimeError("URLs need fsspec installed") from exc
        # auto_mkdir off: fsspec would otherwise create a missing S3 bucket (a typo'd name) on write
        return fsspec.open(url, mode, auto_mkdir=False).open()
    path = Path(url.removeprefix("file://"))
    if "w" in mode:
        path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, mode)
