"""The built-in byte corpora: the fixed snapshot `data=text` trains on by default, and the running
interpreter's standard library (`data=stdlib`), which it was taken from.

The snapshot is package data (builtin/, with the Python license its sources come under), so every
install on every OS and Python version reads the same bytes and nothing is downloaded. The
interpreter's corpus differs between Python versions (3.12.3's is 10,212,230 bytes, 3.12.1's
10,810,706): a run on it compares with runs on the same interpreter only.
"""

import gzip
import hashlib
import logging
import sys
import sysconfig
import zlib
from importlib.resources import files
from pathlib import Path

import numpy as np

from experiments.runtime.errors import UserError
from experiments.runtime.files import atomic_write

log = logging.getLogger(__name__)

# data=stdlib's rule applied once to CPython 3.11.7 (builtin/LICENSE-Python.txt says what it holds)
SNAPSHOT = "stdlib-py3.11.7"


def snapshot() -> np.ndarray:
    """The built-in corpus's bytes [11,354,835] as uint8 (gzip checks them against its CRC)."""
    resource = files("experiments.data").joinpath("builtin", f"{SNAPSHOT}.txt.gz")
    try:
        raw = gzip.decompress(resource.read_bytes())
    except (OSError, EOFError, zlib.error) as e:  # missing from the install, or damaged
        raise UserError(f"the built-in corpus {resource} cannot be read ({e}): reinstall the project "
                        "(pip install -e .), or set data.path=<a text file>") from None
    return np.frombuffer(raw, dtype=np.uint8).copy()


def interpreter_name() -> str:
    """The name of the running interpreter's corpus: stdlib-py<major.minor.micro>."""
    return "stdlib-py" + ".".join(map(str, sys.version_info[:3]))


def interpreter_stdlib(cache_dir: Path) -> np.ndarray:
    """This interpreter's standard-library .py sources (tests excluded), sorted, joined by newlines;
    cached in cache_dir under a key of the file listing."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib"}
    paths = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    if not paths:
        raise UserError(f"no Python sources under {root} for data=stdlib: use data=text (the built-in corpus)")
    listing = "\n".join(f"{p.relative_to(root)}:{p.stat().st_size}" for p in paths)
    key = hashlib.sha256(listing.encode()).hexdigest()[:16]
    cache = cache_dir / f"stdlib-corpus-{key}.u8"
    if cache.is_file():
        return np.fromfile(cache, dtype=np.uint8)
    data = b"\n".join(p.read_bytes() for p in paths)
    try:
        atomic_write(cache, lambda f: f.write(data))
    except OSError as e:  # a read-only home, say: build it again next time, but run now
        log.warning("could not cache the standard-library corpus in %s (%s); set data.cache_dir to a writable "
                    "folder", cache_dir, e)
    return np.frombuffer(data, dtype=np.uint8).copy()
