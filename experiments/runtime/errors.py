"""Errors a user can fix. They are reported as one message (what, where, how to fix), never as a
traceback, and recorded in summary.json."""

import errno
from typing import Optional

# writes the file system refused: a full disk or quota, a file-size limit, a read-only mount
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_READ_ONLY = {errno.EROFS}


class UserError(Exception):
    """Bad input: a config value, a missing file, a checkpoint that does not fit."""


class TrainingError(Exception):
    """Training cannot go on (a non-finite loss, say); the last good checkpoint is kept."""


def storage_problem(exc: BaseException) -> Optional[str]:
    """One line for a write the file system refused, or None for any other error."""
    if not isinstance(exc, OSError) or exc.errno not in _NO_ROOM | _READ_ONLY:
        return None
    what = f"{exc.strerror} writing {exc.filename}" if exc.filename else exc.strerror
    fix = ("free some space (or choose a hydra.run.dir on another disk)" if exc.errno in _NO_ROOM
           else "choose a hydra.run.dir on a writable disk")
    return f"{what}: {fix}, then rerun the same command to go on from the last checkpoint"
