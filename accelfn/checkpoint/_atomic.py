"""Atomic checkpoint directories: a crash at any instant leaves the old or the new one.

A checkpoint ``parent/name`` is written into a hidden sibling ``parent/.name.tmp-<token>``;
its files are fsynced, ``manifest.sha256`` and then ``manifest.json`` are written last
(each write, fsync, rename: ``write_manifest``), and the directory is fsynced. Then it is
renamed to ``name``. An existing checkpoint at ``name`` is first renamed to
``.name.old-<token>`` and deleted only once the new one is in place; a crash between the
two renames leaves both complete siblings, and ``resolve`` finds them.
Leftovers (``.tmp-``, ``.old-``, ``.del-``) are ignored by readers and cleaned up by the
next writer. A directory is a complete checkpoint iff it holds ``manifest.json``.

One writer per directory: every write holds an exclusive ``flock`` on the parent directory
itself (``writing``; no lock file is created), and so does rank 0 of each ``run`` with
``Checkpoints`` for the run's whole duration. A second process that tries to write there
meanwhile gets a ``CheckpointError``, never a checkpoint written over another's: two jobs
sharing one directory would otherwise delete each other's temporary folders while cleaning
up. The kernel releases the lock when its process dies, so a leftover found under the lock
is provably a dead writer's and is cleaned up. The lock is reentrant within a process (a
``run``'s background thread writes under the run's lock). Where the file system has no
``flock`` on directories (some NFS mounts), writes go on unguarded, as before; on a shared
file system that has it, the lock holds across hosts.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import secrets
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from accelfn.errors import CheckpointError

#: a checkpoint's last file (a directory is a complete checkpoint iff it holds it), and its sha256
MANIFEST = "manifest.json"
CHECKSUM = "manifest.sha256"
_SHA256 = re.compile(r"^([0-9a-f]{64})  " + re.escape(MANIFEST) + r"\n?$")
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|del)-[0-9a-f]{16}$")


_held: dict[Path, list[int]] = {}  # directory -> [descriptor, depth] while this process holds its lock
_held_guard = threading.Lock()


def acquire(directory: Path) -> Path:
    """Takes this process's exclusive write lock on ``directory`` (reentrant; give it back
    with ``release``), creating the directory when needed.

    Raises:
        CheckpointError: another process holds the lock (the message says how to fix it).
    """
    directory.mkdir(parents=True, exist_ok=True)
    key = directory.resolve()
    with _held_guard:
        if key in _held:
            _held[key][1] += 1
            return key
        fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointError(
                f"{directory} is being written by another process (it holds the directory's write lock, a "
                "flock): two jobs must not write one checkpoint directory at once, they would replace each "
                "other's checkpoints. Give each job its own directory, or start the processes of one job so "
                "that they form one world (`accelfn launch`, `srun`, `mpirun`: rank 0 writes for all)"
            ) from None
        except OSError:  # a file system without flock on directories: unguarded, as before
            os.close(fd)
            fd = -1
        _held[key] = [fd, 1]
        return key


def release(lock: Path) -> None:
    """Gives back one ``acquire`` (``lock`` is what it returned); the last one unlocks."""
    with _held_guard:
        entry = _held[lock]
        entry[1] -= 1
        if entry[1] == 0:
            del _held[lock]
            if entry[0] >= 0:
                os.close(entry[0])  # closing the only descriptor releases the flock


@contextlib.contextmanager
def writing(directory: Path) -> Iterator[None]:
    """Holds the write lock of ``directory`` (see ``acquire``) for the ``with`` block."""
    lock = acquire(directory)
    try:
        yield
    finally:
        release(lock)


def is_complete(path: Path) -> bool:
    """True if ``path`` is a finished checkpoint directory."""
    return (path / MANIFEST).is_file()


def _sibling(target: Path, kind: str) -> Path:
    return target.parent / f".{target.name}.{kind}-{secrets.token_hex(8)}"


def leftovers(parent: Path) -> Iterator[tuple[str, str, Path]]:
    """``(name, kind, path)`` of every leftover of an interrupted write or delete in ``parent``."""
    try:
        entries = list(os.scandir(parent))
    except (FileNotFoundError, NotADirectoryError):  # nothing was ever written there
        return
    for entry in entries:
        match = _LEFTOVER.match(entry.name)
        if match:
            yield match["name"], match["kind"], Path(entry.path)


def resolve(target: Path) -> Path | None:
    """The complete checkpoint that ``target`` stands for, or None (reads, never changes).

    That is ``target`` itself, or else, after a crash in the middle of a replace, the new
    checkpoint's finished temporary directory, or else the old one set aside.
    """
    if is_complete(target):
        return target
    found = {kind: path for name, kind, path in sorted(leftovers(target.parent), key=lambda x: _mtime(x[2]))
             if name == target.name and kind in ("tmp", "old") and is_complete(path)}
    return found.get("tmp") or found.get("old")


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def recover(target: Path) -> None:
    """Finishes an interrupted replace of ``target`` and deletes its other leftovers (a
    writer holding the directory's lock: any leftover is then a dead writer's)."""
    found = resolve(target)
    if found is not None and found != target and not target.exists():
        os.rename(found, target)
        fsync_dir(target.parent)
    for name, _, path in list(leftovers(target.parent)):
        if name == target.name:
            shutil.rmtree(path, ignore_errors=True)


def fsync_dir(path: Path) -> None:
    """Makes the entries of directory ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def _check_replaceable(target: Path) -> None:
    if not target.exists() and not target.is_symlink():
        return
    if target.is_dir() and not target.is_symlink() and (is_complete(target) or not any(target.iterdir())):
        return
    raise CheckpointError(
        f"{target} exists and is not an accelfn checkpoint; refusing to replace it. Save to "
        "another path, or move it away first"
    )


def write_directory(target: Path, fill: Callable[[Path], None]) -> None:
    """Writes a checkpoint at ``target`` atomically; ``fill(directory)`` writes its files
    (fsynced) and, last, ``manifest.json``.

    Raises:
        CheckpointError: ``target`` exists and is neither a checkpoint nor an empty
            directory, or another process is writing in its parent directory.
        Whatever ``fill`` raises; the temporary directory is then removed, ``target`` untouched.
    """
    with writing(target.parent):
        _write_directory(target, fill)


def _write_directory(target: Path, fill: Callable[[Path], None]) -> None:
    _check_replaceable(target)
    recover(target)
    tmp = _sibling(target, "tmp")
    tmp.mkdir()
    try:
        fill(tmp)
        fsync_dir(tmp)
        if not is_complete(tmp):
            raise AssertionError(f"{tmp} has no {MANIFEST} after writing")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        old = _sibling(target, "old")
        os.rename(target, old)
        os.rename(tmp, target)
        fsync_dir(target.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)
    fsync_dir(target.parent)


def remove(path: Path) -> None:
    """Deletes checkpoint ``path`` so that no crash leaves a partial one under its name."""
    doomed = _sibling(path, "del")
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        return
    fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def _write_durably(path: Path, data: bytes) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def write_manifest(directory: Path, data: bytes) -> None:
    """Writes ``manifest.sha256``, then ``manifest.json`` (``data``), into ``directory``, each
    durably and atomically (write, fsync, rename): the manifest is a checkpoint's last file."""
    _write_durably(directory / CHECKSUM, f"{hashlib.sha256(data).hexdigest()}  {MANIFEST}\n".encode())
    _write_durably(directory / MANIFEST, data)


def expected_sha256(directory: Path) -> str | None:
    """The manifest's sha256 as ``manifest.sha256`` gives it, or None without that file.

    Raises:
        CheckpointError: the file cannot be read, or is not a sha256 line for the manifest.
    """
    path = directory / CHECKSUM
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read the manifest's checksum ({e})") from None
    match = _SHA256.match(text)
    if match is None:
        raise CheckpointError(f"{path}: not a sha256 line for {MANIFEST} (\"<64 hex digits>  {MANIFEST}\"); "
                              "the file is corrupted")
    return match[1]
