"""Byte-level data: the built-in corpus, the interpreter's, crops, splits, fingerprints, bad paths."""

import gzip
import hashlib
import sys
from importlib.resources import files

import numpy as np
import pytest
import torch

from experiments.data import corpus as corpus_module
from experiments.data.text import ByteText, Enwik8, InterpreterStdlib
from experiments.runtime.errors import UserError


@pytest.fixture(scope="module")
def corpus():
    return ByteText(seq_len=64)


def test_builtin_corpus_is_the_same_bytes_on_every_install(corpus):
    """The snapshot of Python 3.11.7's standard library, whatever Python runs this: pinned by size and
    hash, split 90/10 from the end."""
    whole = np.concatenate((corpus.train.numpy(), corpus.val.numpy())).tobytes()
    assert len(whole) == 11_354_835 and len(corpus.val) == 1_135_483
    assert hashlib.sha256(whole).hexdigest() == "cb6bd443e0617389a0d7b511f3e202f2c8f0c01168c178e3b1d295ce212172b2"
    assert corpus.fingerprint == "stdlib-py3.11.7:10219352+1135483:cb6bd443e0617389"
    assert whole.startswith(b'"""Record of phased-in incompatible language changes.')  # __future__.py, first by path


def test_a_damaged_builtin_corpus_is_one_clear_error(tmp_path, monkeypatch):
    whole = (files("experiments.data") / "builtin" / f"{corpus_module.SNAPSHOT}.txt.gz").read_bytes()
    (tmp_path / "builtin").mkdir()
    (tmp_path / "builtin" / f"{corpus_module.SNAPSHOT}.txt.gz").write_bytes(whole[: len(whole) // 2])
    monkeypatch.setattr(corpus_module, "files", lambda package: tmp_path)
    with pytest.raises(UserError, match=r"built-in corpus .* cannot be read .*reinstall the project"):
        ByteText(seq_len=64)


def test_the_interpreters_standard_library_is_an_option_named_by_its_version(tmp_path):
    data = InterpreterStdlib(seq_len=64, cache_dir=str(tmp_path))
    assert data.name == "stdlib-py" + ".".join(map(str, sys.version_info[:3]))
    assert len(data.train) > 1_000_000 and b"def " in bytes(data.train[:20000].numpy())
    assert len(data.val) == pytest.approx(0.1 * (len(data.train) + len(data.val)), rel=1e-3)
    assert [p.name.startswith("stdlib-corpus-") for p in tmp_path.iterdir()] == [True]  # cached
    assert InterpreterStdlib(seq_len=64, cache_dir=str(tmp_path)).fingerprint == data.fingerprint


def test_training_crops_are_reproducible_and_differ_by_coordinates(corpus):
    a = corpus.train_batch(4, seed=0, step=3, micro=1)
    assert a.shape == (4, 65)
    assert (a == corpus.train_batch(4, seed=0, step=3, micro=1)).all()
    for other in (dict(seed=1, step=3, micro=1), dict(seed=0, step=4, micro=1), dict(seed=0, step=3, micro=0),
                  dict(seed=0, step=3, micro=1, rank=1, world_size=2)):
        assert not (a == corpus.train_batch(4, **other)).all()


def test_ranks_share_out_the_global_batch(corpus):
    """Two ranks of batch 2 see exactly the rows one process of batch 4 sees, none twice."""
    whole = corpus.train_batch(4, seed=0, step=5, micro=2)
    ranks = [corpus.train_batch(2, seed=0, step=5, micro=2, rank=r, world_size=2) for r in (0, 1)]
    assert (torch.cat(ranks) == whole).all()


def test_validation_crops_are_the_same_every_time(corpus):
    first = list(corpus.val_batches(3, 2))
    second = list(corpus.val_batches(3, 2))
    assert len(first) == 3 and all((x == y).all() for x, y in zip(first, second))


def test_any_file_through_path(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"hello world " * 1000)
    data = ByteText(seq_len=16, path=str(path))
    assert data.name == "notes.txt" and data.decode(data.train[:11]) == "hello world"
    assert data.fingerprint != ByteText(seq_len=64).fingerprint
    # the same bytes split elsewhere validate on other crops: another data set
    assert data.fingerprint != ByteText(seq_len=16, path=str(path), val_fraction=0.5).fingerprint


def test_enwik8_split_as_the_seeds(tmp_path):
    path = tmp_path / "enwik8.gz"
    raw = np.random.default_rng(0).integers(0, 256, 1200, dtype=np.uint8).tobytes()
    with gzip.open(path, "wb") as f:
        f.write(raw)
    data = Enwik8(seq_len=8, path=str(path), train_bytes=900, val_bytes=100)
    assert bytes(data.train.numpy()) == raw[:900] and bytes(data.val.numpy()) == raw[900:1000]
    with pytest.raises(UserError, match="holds 1,200 bytes, fewer than data.train_bytes \\+ data.val_bytes = 1,500"):
        Enwik8(seq_len=8, path=str(path), train_bytes=1000, val_bytes=500)  # validation would be short


def _zipped(path, *members):
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members:
            archive.writestr(name, data)


@pytest.mark.parametrize("name,write", [
    ("enwik8.zip", lambda path, raw: _zipped(path, ("enwik8", raw))),  # as downloaded
    ("enwik8.GZ", lambda path, raw: path.write_bytes(gzip.compress(raw))),
    ("enwik8", lambda path, raw: path.write_bytes(gzip.compress(raw))),  # gzip by its first bytes alone
])
def test_compressed_files_are_read_decompressed_whatever_their_name(tmp_path, name, write):
    raw = np.random.default_rng(0).integers(0, 256, 1200, dtype=np.uint8).tobytes()
    write(tmp_path / name, raw)
    data = Enwik8(seq_len=8, path=str(tmp_path / name), train_bytes=900, val_bytes=100)
    assert bytes(data.train.numpy()) == raw[:900] and bytes(data.val.numpy()) == raw[900:1000]


def test_files_that_hold_no_text_to_read_are_refused_naming_data_path(tmp_path):
    _zipped(tmp_path / "two.zip", ("a.txt", b"a" * 100), ("b.txt", b"b" * 100))
    with pytest.raises(UserError, match=r"data.path=.*two.zip is a zip archive of 2 files: unzip it"):
        ByteText(seq_len=8, path=str(tmp_path / "two.zip"))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(UserError, match=r"data.path=.*empty.txt is empty"):
        ByteText(seq_len=8, path=str(tmp_path / "empty.txt"))


def test_a_file_that_only_begins_like_an_archive_is_read_as_its_bytes(tmp_path):
    for signature in (b"PK\x03\x04", b"\x1f\x8b"):
        raw = signature + b"ordinary text line\n" * 100
        (tmp_path / "corpus.txt").write_bytes(raw)
        assert bytes(ByteText(seq_len=8, path=str(tmp_path / "corpus.txt"), val_fraction=0.5).train.numpy()) == \
            raw[: len(raw) - len(raw) // 2]


def test_a_path_from_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "notes.txt").write_bytes(b"hello world " * 100)
    assert ByteText(seq_len=8, path="~/notes.txt").name == "notes.txt"


def test_missing_file_says_where_to_get_it(tmp_path):
    with pytest.raises(UserError, match=r"data.path=.*no such file.*mattmahoney"):
        Enwik8(seq_len=8, path=str(tmp_path / "enwik8.gz"))


def test_sequence_longer_than_a_split_is_refused(tmp_path):
    path = tmp_path / "short.txt"
    path.write_bytes(b"x" * 100)
    with pytest.raises(UserError, match="data.seq_len=512"):
        ByteText(seq_len=512, path=str(path))


def test_an_unwritable_cache_folder_only_costs_a_rebuild(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    data = InterpreterStdlib(seq_len=64, cache_dir=str(blocker / "cache"))  # cannot be created under a file
    assert len(data.train) > 1_000_000


def test_validation_crops_and_the_prime_come_from_the_validation_split_alone(tmp_path):
    """Training bytes lie below 128, validation bytes at or above it: no crop of one is a crop of the other."""
    path = tmp_path / "halves.txt"
    rng = np.random.default_rng(0)
    path.write_bytes(rng.integers(0, 128, 500, dtype=np.uint8).tobytes()
                     + rng.integers(128, 256, 500, dtype=np.uint8).tobytes())
    data = ByteText(seq_len=16, path=str(path), val_fraction=0.5)
    assert (data.train < 128).all() and (data.val >= 128).all()
    assert all((batch >= 128).all() for batch in data.val_batches(3, 4))
    assert all((data.prime(20, index) >= 128).all() for index in range(3))
