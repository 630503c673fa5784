"""Folder locks: one training run per output_dir; many runs may read a cache folder, one fills it.

Advisory ``flock(2)`` locks on small hidden files: ``<output_dir>/.simpletuner.lock`` (:func:`hold_output_dir`);
in ``<cache_dir>/<family>``, ``.cache-users.lock`` (shared by runs, exclusive for ``cache clear``:
:meth:`CacheLocks.use`, :meth:`CacheLocks.clearing`) and ``.cache-writer.lock`` (:meth:`CacheLocks.writing`);
the ``refresh_each_epoch`` folder's (:func:`hold_epoch_folder`). An exclusive holder names itself in the file;
a named lock nobody holds is taken over. Busy: :class:`FolderLocked`; a full disk:
:class:`~simpletuner.diskspace.NoSpace`. A leaf (stdlib and :mod:`simpletuner.diskspace`).
Rules and limits: documentation/RELIABILITY.md, "Locks".
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterator

from simpletuner.diskspace import NoSpace, disk_full_guard, free_bytes, inject_fault, is_disk_full, require_space

logger = logging.getLogger(__name__)

OUTPUT_LOCK_NAME = ".simpletuner.lock"
CACHE_USERS_LOCK_NAME = ".cache-users.lock"
CACHE_WRITER_LOCK_NAME = ".cache-writer.lock"
CACHE_USERS_FOLDER = ".users"

# flock on these file systems fails with one of these instead of locking.
_NO_LOCKING = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_MAX_COMMAND_CHARS = 300
_warned_unsupported: set[str] = set()


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lock: written into the lock file, or into a cache-user record."""

    pid: int
    host: str
    started: str  # ISO 8601, local time with its UTC offset
    command: str = ""

    @classmethod
    def me(cls) -> "Holder":
        command = " ".join(sys.argv) or sys.executable
        if len(command) > _MAX_COMMAND_CHARS:
            command = command[: _MAX_COMMAND_CHARS - 3] + "..."
        return cls(
            os.getpid(), socket.gethostname(), datetime.now().astimezone().isoformat(timespec="seconds"), command
        )

    @classmethod
    def parse(cls, data: bytes) -> "Holder | None":
        """The holder ``data`` names, or None (empty, half-written, or not ours)."""
        try:
            fields = json.loads(data)
            return cls(int(fields["pid"]), str(fields["host"]), str(fields["started"]), str(fields.get("command", "")))
        except (ValueError, KeyError, TypeError):
            return None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    def describe(self) -> str:
        command = f" (command: {self.command})" if self.command else ""
        return f"pid {self.pid} on host {self.host}, started {self.started}{command}"

    @property
    def is_here(self) -> bool:
        return self.host == socket.gethostname()

    def is_gone(self) -> bool:
        """True when the holder is known to have ended: a pid of this host that no longer runs.
        A holder on another host is never known to be gone."""
        if not self.is_here:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False


class FolderLocked(ValueError):
    """Another process holds the lock (exit code 2: the message names it and what to do)."""

    def __init__(self, message: str, path: Path, holders: list[Holder]):
        super().__init__(message)
        self.path, self.holders = path, holders


def _describe_all(holders: list[Holder]) -> str:
    return "; ".join(h.describe() for h in holders)


class FolderLock:
    """One lock file, held exclusively (naming its holder inside) or shared.

    ``try_acquire`` never blocks; ``acquire_waiting`` calls ``on_wait`` once, then blocks until
    the lock is free. ``release`` (also on ``__exit__`` and when the object is collected)
    empties the file of an exclusive holder, then unlocks and closes it.
    """

    def __init__(self, path: str | os.PathLike[str], shared: bool = False):
        self.path = Path(path)
        self.shared = shared
        self._fd: int | None = None
        self._times: tuple[int, int] | None = None  # (atime, mtime) before this holder wrote its name
        self.is_held = False
        self.took_over: Holder | None = None  # the dead holder whose lock this one took over

    # --- acquiring ----------------------------------------------------------------------------
    def _open(self) -> int:
        if self._fd is None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                if is_disk_full(exc):
                    folder, what = self.path.parent, f"the lock file {self.path.name}"
                    raise NoSpace(what, folder, None, free_bytes(folder), during_write=True) from None
                raise ValueError(
                    f"cannot create the lock file {self.path}: {exc.strerror or exc}. Make "
                    f"{self.path.parent} writable, or point the setting that names it elsewhere"
                ) from None
        return self._fd

    def _flock(self, blocking: bool) -> bool:
        operation = (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB)
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, operation)
            except BlockingIOError:
                return False
            except OSError as exc:
                if exc.errno not in _NO_LOCKING:
                    raise
                if str(self.path.parent) not in _warned_unsupported:
                    _warned_unsupported.add(str(self.path.parent))
                    logger.warning(
                        "the file system of %s does not support locks (%s): runs using it are not kept "
                        "apart; do not start a second run or `cache clear` on it while this one runs",
                        self.path.parent,
                        exc.strerror or exc,
                    )
            if self._is_current(fd):
                break
            # `cache clear` deleted the file while we waited: our lock is on an orphan; lock the new file
            self._fd = None
            os.close(fd)
        self._held(fd)
        return True

    def _is_current(self, fd: int) -> bool:
        """Whether ``fd`` is still the file at ``self.path`` (not deleted or replaced meanwhile)."""
        try:
            at_path = os.stat(self.path)
        except FileNotFoundError:
            return False
        locked = os.fstat(fd)
        return (at_path.st_dev, at_path.st_ino) == (locked.st_dev, locked.st_ino)

    def try_acquire(self) -> bool:
        """Take the lock if it is free; False (without waiting) if another holder has it."""
        if self.is_held:
            return True
        return self._flock(blocking=False)

    def acquire_waiting(self, on_wait: Callable[[], None] | None = None) -> bool:
        """Take the lock, waiting for it when busy (``on_wait`` is called once, before waiting).
        Returns whether it waited."""
        if self.try_acquire():
            return False
        if on_wait is not None:
            on_wait()
        self._flock(blocking=True)
        return True

    def _held(self, fd: int) -> None:
        """Just locked through ``fd``: take over a dead holder's name, and (exclusive) write our own."""
        self.is_held = True
        previous = self.holder(retries=0)  # a name left in a lock nobody held: its holder died
        if previous is not None:
            self.took_over = previous
            logger.warning(
                "took over the lock %s from %s, which ended without releasing it (killed or crashed)",
                self.path,
                previous.describe(),
            )
        if self.shared:  # no exclusive holder can exist now: drop a dead one's name
            if previous is not None:
                os.ftruncate(fd, 0)
            return
        before = os.fstat(fd)
        self._times = (before.st_atime_ns, before.st_mtime_ns)
        name = Holder.me().to_json()
        with disk_full_guard(self.path.parent, len(name), f"the lock file {self.path.name}"):
            os.ftruncate(fd, 0)
            os.pwrite(fd, name, 0)
            os.fsync(fd)

    # --- who holds it ---------------------------------------------------------------------------
    def holder(self, retries: int = 20) -> Holder | None:
        """The exclusive holder the file names. A holder writes its name just after locking, so
        an empty file is read again a few times (``retries`` x 50 ms) before giving up."""
        for attempt in range(retries + 1):
            try:
                with open(self.path, "rb") as file:
                    found = Holder.parse(file.read())
            except OSError:
                found = None
            if found is not None or attempt == retries:
                return found
            time.sleep(0.05)
        return None

    # --- releasing ------------------------------------------------------------------------------
    def release(self) -> None:
        """Empty the file (exclusive holder), unlock, close. Safe to call twice."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self.is_held and not self.shared:
                os.ftruncate(fd, 0)
                if self._times is not None:  # emptied as found: a run that changed nothing leaves no newer file
                    os.utime(fd, ns=self._times)
            if self.is_held:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as exc:  # closing below releases the lock anyway
            logger.debug("releasing %s: %s", self.path, exc)
        finally:
            self.is_held = False
            os.close(fd)

    def __enter__(self) -> "FolderLock":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the kernel releases it anyway
            pass

    def __repr__(self) -> str:
        kind = "shared" if self.shared else "exclusive"
        return f"FolderLock({str(self.path)!r}, {kind}, held={self.is_held})"


# --- folders one run writes alone ------------------------------------------------------------------
def _hold(folder: str | os.PathLike[str], refusal: Callable[[str], str]) -> FolderLock:
    """Lock ``folder`` (created if missing) exclusively, or raise :class:`FolderLocked` at once with
    ``refusal(<who holds it>)``. The caller releases the returned lock."""
    lock = FolderLock(Path(folder) / OUTPUT_LOCK_NAME)
    if lock.try_acquire():
        return lock
    holder = lock.holder()
    lock.release()
    who = holder.describe() if holder is not None else "a process that has not written its name yet"
    raise FolderLocked(
        refusal(who) + f". The lock ({lock.path}) is released when that process ends, also when it is killed",
        lock.path,
        [holder] if holder else [],
    )


def hold_output_dir(folder: str | os.PathLike[str]) -> FolderLock:
    """Lock output_dir ``folder`` for this run; :class:`FolderLocked` when another run holds it."""
    return _hold(
        folder,
        lambda who: (
            f"output_dir {folder} is in use by another training run: {who}. Two runs in one output_dir overwrite each "
            "other's checkpoints. Wait for that run to end (or stop it), or give this run another output_dir"
        ),
    )


def hold_epoch_folder(folder: str | os.PathLike[str]) -> FolderLock:
    """Lock the per-epoch latents folder of ``augmentations_cache_mode: refresh_each_epoch``: each
    epoch the run removes the other epochs' latents there, so a second run must not share it."""
    return _hold(
        folder,
        lambda who: (
            f"the per-epoch latents folder {folder} (augmentations_cache_mode refresh_each_epoch) is in use by another "
            f"run: {who}. Each run removes the latents of other epochs there, so two runs would delete each other's. "
            "Give this run another cache_config.cache_dir, or wait for that run to end"
        ),
    )


# --- cache folders ---------------------------------------------------------------------------------
class CacheLocks:
    """The locks of one cache folder (``<cache_dir>/<family>``, holding ``vae/``, ``text/``, ...)."""

    def __init__(self, base: str | os.PathLike[str]):
        self.base = Path(base)
        self.users_path = self.base / CACHE_USERS_LOCK_NAME
        self.writer_path = self.base / CACHE_WRITER_LOCK_NAME
        self.records = self.base / CACHE_USERS_FOLDER
        self._is_clearing = False  # inside clearing(): the cache is held exclusively

    # --- every run that uses the cache -----------------------------------------------------------
    @contextmanager
    def use(self, say: Callable[[str], None] = logger.warning) -> Iterator[FolderLock]:
        """Hold the cache shared for the ``with`` block, with a record naming this process; waits
        (saying so once) while a ``cache clear`` holds it."""
        lock = FolderLock(self.users_path, shared=True)

        def waiting() -> None:
            clearer = FolderLock(self.users_path).holder()
            who = clearer.describe() if clearer else "another process"
            say(f"waiting for `simpletuner cache clear` ({who}) to finish with the cache {self.base}")

        try:
            lock.acquire_waiting(waiting)
            record = self._write_record()
            try:
                yield lock
            finally:
                record.unlink(missing_ok=True)
        finally:
            lock.release()

    def _write_record(self) -> Path:
        """Write this process's record in ``.users/`` (temp file, then rename); NoSpace, with
        nothing left behind, when the disk cannot hold it."""
        me = Holder.me()
        data = me.to_json()
        what = "the record naming this run in the cache folder (.users/)"
        require_space(self.base, len(data), what)
        record = self.records / f"{me.host}-{me.pid}-{uuid.uuid4().hex[:8]}.json"
        temp = record.with_name("." + record.name + ".tmp")
        with disk_full_guard(self.base, len(data), what, cleanup=[temp]):
            self.records.mkdir(parents=True, exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                inject_fault("cache_user_record")  # tests: the disk fills as the record is written
                os.write(fd, data)
            finally:
                os.close(fd)
            os.replace(temp, record)  # whole or absent: a reader never sees half a record
        return record

    def users(self) -> list[Holder]:
        """The processes whose records say they use the cache; records of processes that ended
        (on this host) are removed."""
        found = []
        for record in sorted(self.records.glob("*.json")) if self.records.is_dir() else []:
            try:
                holder = Holder.parse(record.read_bytes())
            except OSError:
                continue  # removed meanwhile
            if holder is None:
                continue
            if holder.is_gone():
                record.unlink(missing_ok=True)
                continue
            found.append(holder)
        return found

    # --- filling ---------------------------------------------------------------------------------
    @contextmanager
    def writing(self, say: Callable[[str], None] = logger.warning) -> Iterator[bool]:
        """Hold the writer lock for the ``with`` block, waiting (saying for whom, once) while another
        process fills; yields whether it waited. Whoever holds it re-reads the stores first: other
        writers may have added entries since they were opened."""
        lock = FolderLock(self.writer_path)

        def waiting() -> None:
            holder = lock.holder()
            who = holder.describe() if holder else "another process"
            say(
                f"waiting for {who} to finish filling the cache {self.base}; then only the entries still missing "
                "are encoded"
            )

        try:
            yield lock.acquire_waiting(waiting)
        finally:
            lock.release()

    # --- cache clear -----------------------------------------------------------------------------
    @contextmanager
    def clearing(self, wait: bool = False, say: Callable[[str], None] = print) -> Iterator[None]:
        """Hold the cache exclusively for the ``with`` block (no run uses or fills it meanwhile).

        Raises :class:`FolderLocked` naming the runs that use it, unless ``wait``: then ``say`` is
        called once with whom it waits for, and it waits until they end.
        """
        users = FolderLock(self.users_path)
        writer = FolderLock(self.writer_path)
        try:
            self._take(users, wait, say, lambda: self.users(), "used by")
            self._take(writer, wait, say, lambda: [h for h in [writer.holder()] if h], "being filled by")
            self._is_clearing = True
            yield
        finally:
            self._is_clearing = False
            writer.release()
            users.release()

    def remove_if_empty(self) -> bool:
        """Inside :meth:`clearing`: when the cache folder holds nothing but these locks (the caches
        are gone), delete the lock files, the records of ended runs and the folder; returns whether
        it did. Processes waiting on the deleted files notice and lock new ones (:meth:`FolderLock._flock`)."""
        assert self._is_clearing, "remove_if_empty needs the exclusive hold of clearing()"
        ours = {CACHE_USERS_LOCK_NAME, CACHE_WRITER_LOCK_NAME, CACHE_USERS_FOLDER}
        try:
            if any(entry.name not in ours for entry in self.base.iterdir()):
                return False
            shutil.rmtree(self.records, ignore_errors=True)  # held exclusively: only ended runs' records are left
            self.writer_path.unlink(missing_ok=True)
            self.users_path.unlink(missing_ok=True)
            self.base.rmdir()
        except OSError as exc:  # something appeared meanwhile, or no permission: the folder stays
            logger.debug("keeping %s: %s", self.base, exc)
            return False
        return True

    def _take(
        self, lock: FolderLock, wait: bool, say: Callable[[str], None], holders: Callable[[], list[Holder]], doing: str
    ) -> None:
        if lock.try_acquire():
            return
        found = holders()
        who = _describe_all(found) if found else "a process that left no record"
        if not wait:
            lock.release()
            raise FolderLocked(
                f"the cache {self.base} is {doing} a run: {who}. Removing it now would break that run. Run this "
                "again when the run has ended, or add --wait to wait for it",
                lock.path,
                found,
            )
        say(f"waiting for the run(s) that use the cache {self.base} to end: {who}")
        lock.acquire_waiting()
