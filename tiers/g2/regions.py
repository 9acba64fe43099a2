"""G2 host regions: one per engine, held by every process that maps it, and
removed only when sessionkv registered it and no live process holds it.

vLLM maps G2 from ``/dev/shm/vllm_offload_<engine_id>.mmap`` (0.33 may add
segment files ``<that>.1``, ``.2``, ...): the first mapper creates it
(``O_EXCL``), later mappers join it, and the creator unlinks it only at a
clean shutdown (the tiering spec passes no barrier). An engine core that is
killed (vLLM's default ``--shutdown-timeout 0``, the OOM killer, SIGKILL)
leaves the whole G2 size of shared memory behind, for every restart.

Registration: before any process of a sessionkv engine maps its region (the
scheduler in ``get_manager``, every worker in ``get_worker``, on the CPU
platform and on a device alike), it calls ``register``: a shared ``flock``
on the registration file ``/dev/shm/sessionkv.<region name>.lock``, kept
open for the life of the process, so the lock ends however the process
ends. Because the lock is taken before the region is mapped, there is no
moment at which a region being built is registered but unheld.

Reclaim (``reclaim``, at scheduler start): for each registration file this
user owns that no process holds (an exclusive ``flock`` is granted), remove
its region's files and then the registration. Liveness is "a live process
holds it", never a file's age: a device engine's warm-up may take longer than
any threshold, and writes to populated tmpfs pages leave ``mtime`` unchanged.

Invariants: a region nobody registered (vLLM's own connector, another
program) is never removed; a registered region is removed only while its
registration is exclusively locked by the reclaimer, and a process
registering waits for that lock, then checks that the file it locked is still
the registration (it re-registers otherwise), so the two never overlap.
Symlinks are never followed (``O_NOFOLLOW``); files of other users are left
alone. ``expect_existing`` lets the scheduler on a device refuse to create
a region the workers should have made (it would be a private copy that no
worker writes).

Cost: ``register`` is one ``open`` and one ``flock``; ``reclaim`` one
``open``/``flock`` per registration file and a ``glob`` per reclaimed region.
Never called on the per-step path.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import re

from vllm.logger import init_logger

logger = init_logger(__name__)

SHM_DIR = "/dev/shm"
_PREFIX, _SUFFIX = "sessionkv.", ".lock"
_SEGMENT = re.compile(r"\.\d+")

# Registration descriptors this process holds: open until the process ends.
_held: dict[str, int] = {}


def region_path(engine_id: str, shm_dir: str = SHM_DIR) -> str:
    """Where vLLM maps the engine's G2 region (``SharedOffloadRegion``)."""
    return os.path.join(shm_dir, f"vllm_offload_{engine_id}.mmap")


def _registration(region: str) -> str:
    head, name = os.path.split(region)
    return os.path.join(head, f"{_PREFIX}{name}{_SUFFIX}")


def register(region: str) -> None:
    """Hold ``region`` for this process's lifetime (a shared ``flock`` on its
    registration file). Idempotent per process. Raises ``OSError`` when the
    registration cannot be made (then the engine must not start)."""
    path = _registration(region)
    if path in _held:
        return
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a reclaimer removes it
            # A reclaimer may have unlinked the file between our open and lock.
            if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
                _held[path] = fd
                return
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def release(region: str) -> None:
    """Stop holding ``region`` (its registration stays until a reclaim; a
    region a clean shutdown unlinked leaves nothing but that file behind)."""
    fd = _held.pop(_registration(region), None)
    if fd is not None:
        os.close(fd)


def _not_the_workers(region: str, why: str) -> RuntimeError:
    return RuntimeError(
        f"sessionkv: the G2 region {region} that this engine's workers map is {why}, "
        "so the scheduler would map a private copy that no worker writes (G3 would "
        "receive bytes the device never wrote). Something removed it after the "
        "workers started; restart the engine."
    )


def expect_existing(region: str) -> os.stat_result:
    """The stat of ``region``, which this process must join, not create: on
    a device, vLLM's workers map it before the scheduler. Raises
    ``RuntimeError`` naming the path when it is missing."""
    try:
        return os.stat(region, follow_symlinks=False)
    except FileNotFoundError:
        raise _not_the_workers(region, "missing") from None


def check_joined(region: str, fd: int, st: os.stat_result) -> None:
    """Raise ``RuntimeError`` unless the mapping open on ``fd`` is the file
    ``expect_existing`` saw (it was replaced in between)."""
    if not os.path.samestat(os.fstat(fd), st):
        raise _not_the_workers(region, "gone (a new file took its name)")


def reclaim(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove the regions registered in ``shm_dir`` (by this user) that no
    live process holds, each with its registration; the region paths removed.
    Never raises."""
    removed = []
    uid = os.geteuid()
    for path in glob.glob(os.path.join(glob.escape(shm_dir), f"{_PREFIX}*{_SUFFIX}")):
        if path in _held:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if st.st_uid != uid:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody holds it
            if not os.path.samestat(st, os.stat(path, follow_symlinks=False)):
                continue  # replaced meanwhile
            name = os.path.basename(path)[len(_PREFIX) : -len(_SUFFIX)]
            region = os.path.join(shm_dir, name)
            for part in [region, *glob.glob(glob.escape(region) + ".*")]:
                if part == region or _SEGMENT.fullmatch(part[len(region) :]):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(part)
            os.unlink(path)
            removed.append(region)
        except OSError:
            continue  # held (BlockingIOError), or gone meanwhile
        finally:
            os.close(fd)
    if removed:
        logger.info(
            "sessionkv: removed %d G2 regions no live engine holds: %s",
            len(removed),
            ", ".join(removed),
        )
    return removed
