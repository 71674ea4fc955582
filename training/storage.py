"""Writes that fail (a full disk, a read-only folder, a file size limit) as one clear error naming what and where."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class StorageError(OSError):
    """A write failed; the message names the file, the cause, and that earlier results were left as they were."""


@contextmanager
def writing(what: str, where: str | os.PathLike) -> Iterator[None]:
    """Turn an OSError raised while writing ``what`` to ``where`` into a StorageError that says so."""
    try:
        yield
    except StorageError:
        raise
    except OSError as err:
        target = err.filename or where
        cause = {28: "the disk is full", 30: "the file system is read-only", 13: "permission denied (a read-only folder?)",
                 27: "the file is larger than the size limit (ulimit -f)"}.get(err.errno, err.strerror or str(err))
        raise StorageError(err.errno, f"could not write {what} to {Path(target)}: {cause}; earlier results are untouched") from err
