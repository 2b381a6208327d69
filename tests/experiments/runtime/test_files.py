"""Atomic writes: all or nothing, and files as readable as any other new file."""

import errno
import os
from pathlib import Path

import pytest

from experiments.runtime.files import atomic_write, atomic_write_json


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_written_files_get_the_umask_permissions(tmp_path: Path, umask: int):
    old = os.umask(umask)
    try:
        atomic_write_json(tmp_path / "summary.json", {"status": "completed"})
    finally:
        os.umask(old)
    assert (tmp_path / "summary.json").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path):
    path = tmp_path / "summary.json"
    path.write_text("old")

    def write(f):
        f.write(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, write)
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_a_refused_write_is_an_os_error_naming_the_file_even_when_the_writer_masks_it(tmp_path: Path):
    def write(f):  # as torch.save's zip writer: a RuntimeError on closing, after the disk's refusal
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        finally:
            raise RuntimeError("unexpected pos")

    with pytest.raises(OSError) as refused:
        atomic_write(tmp_path / "step_0000002.pt", write)
    assert (refused.value.errno, refused.value.filename) == (errno.ENOSPC, str(tmp_path / "step_0000002.pt"))
    assert list(tmp_path.iterdir()) == []


def test_the_data_reaches_the_disk_before_the_file_replaces_the_old_one(tmp_path: Path, monkeypatch):
    """A crash just after the rename must not leave an empty file where the old one was."""
    calls = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append("fsync") or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda *a: calls.append("replace") or replace(*a))
    atomic_write_json(tmp_path / "summary.json", {"status": "completed"})
    assert calls == ["fsync", "replace"]
