"""The state directory and the record files in it: one JSON file of named records per registry (local
deployments in gemmax.mcp, remote ones in gemmax.deploy.registry), read without a lock and changed
under an exclusive lock, the new content replacing the file atomically.

`filelock` rather than `fcntl.flock`: the same lock on every platform (and the one huggingface_hub
already brings), and the lock file is its own, never the data file a reader opens."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Generic, TypeVar

import platformdirs
from filelock import FileLock
from pydantic import BaseModel

Record = TypeVar("Record", bound=BaseModel)


def state_dir() -> Path:
    """$GEMMAX_STATE_DIR, else the user state directory: where every registry, log and result lives."""
    return Path(os.environ.get("GEMMAX_STATE_DIR") or platformdirs.user_state_dir("gemmax"))


class RecordFile(Generic[Record]):
    """`{"deployments": {name: record}}` in `file`. `private`: written owner-only (0600): it holds secrets."""

    def __init__(self, file: Path, model: type[Record], dump: Callable[[Record], dict] | None = None,
                 private: bool = False):
        self.file, self.model, self.private = Path(file), model, private
        self.dump = dump or (lambda record: record.model_dump())

    def read(self) -> dict[str, Record]:
        try:
            data = json.loads(self.file.read_text())
        except FileNotFoundError:
            return {}
        return {name: self.model(**fields) for name, fields in data.get("deployments", {}).items()}

    @contextlib.contextmanager
    def locked(self) -> Iterator[dict[str, Record]]:
        """Read-modify-write under the exclusive lock: the yielded dict is written back on a clean exit."""
        self.file.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(self.file.with_suffix(".lock")):
            records = self.read()
            yield records
            tmp = self.file.with_suffix(f".tmp{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if self.private else 0o644)
            with os.fdopen(fd, "w") as out:
                json.dump({"deployments": {name: self.dump(r) for name, r in records.items()}}, out, indent=1)
            os.replace(tmp, self.file)
