"""Errors a user can fix. They are reported as one message (what, where, how to fix), never as a
traceback, and recorded in summary.json."""


class UserError(Exception):
    """Bad input: a config value, a missing file, a checkpoint that does not fit."""


class TrainingError(Exception):
    """Training cannot go on (a non-finite loss, say); the last good checkpoint is kept."""
