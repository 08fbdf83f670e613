"""Files only their owner may read: what rlix writes that holds an address or a token.

A run's process table (shard URLs), its logs (the addresses servers listen on), a cluster's
state file (Ray's address): another user of the machine who reads one learns where to send
requests. Each is created mode 0600 (os.open's mode, so no moment of a wider one), and a file
that existed before is narrowed to 0600 before anything is written to it. Ordinary results
(metrics, summaries, checkpoints) are not written through here.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import IO, Any

#: owner read and write, nobody else anything
PRIVATE_MODE = 0o600


def open_private(path: str | Path, mode: str = "a", **kwargs: Any) -> IO[Any]:
    """`open(path, mode)` for writing ("a", "ab", "w", "wb"), the file mode 0600."""
    if mode.rstrip("bt") not in ("a", "w"):
        raise ValueError(f"open_private: mode {mode!r}: give a, ab, w or wb")
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode.startswith("a") else os.O_TRUNC)
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), PRIVATE_MODE)
    try:
        os.fchmod(fd, PRIVATE_MODE)  # one that existed keeps its old mode otherwise
    except PermissionError:  # someone else's file we may write to: not ours to narrow
        pass
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, mode, **kwargs)


def write_private(path: str | Path, text: str) -> None:
    """Replace `path`'s content with `text` at once (a temp file beside it, then a rename), mode 0600."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open_private(tmp, "w") as fh:
            fh.write(text)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def narrow_to_owner(path: str | Path) -> int | None:
    """An existing file of this user's that another program wrote readable by others (Ray's
    cluster token, which it writes mode 0644) made 0600. Returns the mode it had when it was
    narrowed; None where there was nothing to do (no such file, not ours, private already)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if st.st_uid != os.getuid() or not st.st_mode & 0o077:
        return None
    os.chmod(path, PRIVATE_MODE)
    return st.st_mode & 0o777
