"""Atomic file writes: a reader (or a run killed mid-write) sees the old file or the new, never
half of one."""

import json
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Optional


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Call write(file) on a temporary file beside `path`, fsync it, then rename it over `path`.

    The file gets the permissions of any new file under the umask (mkstemp's are owner-only, which
    would hide a run's summary and checkpoints from the rest of a shared group). If anything fails
    the temporary file is closed and removed at once, so a full disk gets its space back for the
    writes that report the failure; an OSError names `path`, not the temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.chmod(tmp, 0o666 & ~_umask())
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if (cause := _os_error(e)) is not None:
            raise OSError(cause.errno, cause.strerror, str(path)) from None
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))


def atomic_write_json(path: Path, obj: dict) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def _os_error(e: BaseException) -> Optional[OSError]:
    """The OSError behind e, if any: a writer may fail again while handling it (torch.save's zip
    writer raises a RuntimeError on closing after a write the disk refused)."""
    while e is not None:
        if isinstance(e, OSError) and e.errno is not None:
            return e
        e = e.__cause__ or e.__context__
    return None


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it
    os.umask(mask)
    return mask
