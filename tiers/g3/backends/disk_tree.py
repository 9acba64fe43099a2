"""The directory a ``DiskBackend`` owns (``tiers/g3/backends/disk.py``): its
layout, the checks of its trust boundary made at start (``_open_tree``), and
the file helpers its calls share. The layout and the trust boundary are
``disk.py``'s module docstring's.

Nothing here keeps state. ``_open_tree`` is O(entries of the root + FANOUT);
the helpers are one system call or a few each, and follow no link.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

FANOUT = 256  # objects/<2 hex digits>/
MARK = "sessionkv-disk-tier"
_FILES = ("usage", "usage.lock", "evict.lock", "count.lock", MARK)
_DIRS = ("objects", "tmp")
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def _is_tmp_name(name: str) -> bool:
    """A tmp/ name this layout makes: ``uuid4().hex``."""
    return len(name) == 32 and all(c in "0123456789abcdef" for c in name)


def _open_tree(root: str) -> None:
    """Make ``root`` this layout's tree, or raise ValueError saying why not
    (see ``disk.py``'s trust boundary). Creates what is missing."""
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        st = os.stat(root)  # the operator may point path at a link: followed once
    except OSError as e:
        raise ValueError(f"DiskTier: cannot use path {root!r}: {e}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"DiskTier: path {root!r} is not a directory")
    if st.st_uid != os.geteuid():
        raise ValueError(
            f"DiskTier: path {root!r} belongs to uid {st.st_uid}, not to this "
            f"engine's ({os.geteuid()}): give a directory of the engine's user"
        )
    names = set(os.listdir(root))
    if MARK not in names and names - set(_FILES) - set(_DIRS):
        foreign = sorted(names - set(_FILES) - set(_DIRS))[:3]
        raise ValueError(
            f"DiskTier: path {root!r} holds files that are not a DiskTier's "
            f"({', '.join(foreign)}): give an empty or new directory"
        )
    for name in names & set(_FILES + _DIRS):
        _check_own(os.path.join(root, name), dir_=name in _DIRS)
    objects = os.path.join(root, "objects")
    for name in _DIRS:
        _mkdir_own(os.path.join(root, name))
    for i in range(FANOUT):
        _mkdir_own(os.path.join(objects, f"{i:02x}"))
    try:
        os.close(os.open(os.path.join(root, MARK), os.O_WRONLY | os.O_CREAT | _NOFOLLOW, 0o600))
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(root, 0o700)  # a tree made before the mark was 0755
    except OSError as e:
        raise ValueError(f"DiskTier: cannot use path {root!r}: {e}") from e


def _check_own(path: str, dir_: bool) -> None:
    """``path`` (not followed) is a directory, or a regular file, of this
    engine's user: else ValueError naming it."""
    st = os.lstat(path)
    kind = stat.S_ISDIR(st.st_mode) if dir_ else stat.S_ISREG(st.st_mode)
    if not kind or st.st_uid != os.geteuid():
        what = "directory" if dir_ else "regular file"
        raise ValueError(
            f"DiskTier: {path!r} is not a {what} of this engine's user "
            f"(a link, or another user's): remove it or give another path"
        )


def _mkdir_own(path: str) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        _check_own(path, dir_=True)
    except OSError as e:
        raise ValueError(f"DiskTier: cannot use path {path!r}: {e}") from e


def _write_all(fd: int, parts: Sequence, size: int) -> None:
    """Every byte of ``parts`` (``size`` in all), through short writes."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
    while views:
        n = os.writev(fd, views)
        if n <= 0:
            raise OSError(f"writev wrote {n} of {size} bytes")
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def _regular_size(path: str) -> int:
    """The size of the regular file at ``path`` (not followed), else -1."""
    try:
        st = os.lstat(path)
    except OSError:
        return -1
    return st.st_size if stat.S_ISREG(st.st_mode) else -1


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
