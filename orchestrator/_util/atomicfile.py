"""Files written whole: a temporary file beside the target, renamed over it at the end.

What a reader of the target sees stays what its owner chose. A new file gets the mode the
umask gives (as ``open`` would); a file written again keeps the mode it had, so an export
made private with ``chmod 600`` stays private; a target that is a symbolic link is written
through (the file it points at is replaced, the link stays), as ``>`` in a shell does.

A stream is written in place instead (:func:`open_stream`): a FIFO, a character device,
a socket, and a name for a descriptor this process holds (``/dev/stdout``, ``/dev/fd/N``
as ``>(cmd)`` gives, ``/proc/self/fd/N``). A rename would put a regular file where the
FIFO was, fail beside ``/dev/fd/63``, or replace the file a shell's ``>> FILE`` appends to.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from pathlib import Path

# Names of a descriptor of this process: /dev/stdout, /dev/fd/N, /proc/self/fd/N.
_DESCRIPTOR = re.compile(
    r"/dev/std(?P<std>out|err)|/dev/fd/(?P<fd>\d+)"
    r"|/proc/(?:self|thread-self|(?P<pid>\d+))/fd/(?P<pfd>\d+)"
)
_STD = {"out": 1, "err": 2}


def descriptor(target: Path) -> int | None:
    """The descriptor of this process that ``target`` names, or None."""
    match = _DESCRIPTOR.fullmatch(os.path.abspath(target))
    if match is None or (match["pid"] and int(match["pid"]) != os.getpid()):
        return None
    if match["std"]:
        return _STD[match["std"]]
    return int(match["fd"] or match["pfd"])


def is_stream(target: Path) -> bool:
    """Whether ``target`` is written in place (see the module): a descriptor's name, or an
    existing file that is neither a regular file nor a directory."""
    if descriptor(target) is not None:
        return True
    try:
        mode = os.stat(target).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def open_stream(target: Path) -> int | None:
    """A new descriptor writing to the stream ``target`` in place, or None when it is to be
    written whole (:func:`open_temp`). A named descriptor is duplicated: the shell's open
    file, with its offset and ``O_APPEND``, is what gets written."""
    fd = descriptor(target)
    if fd is not None:
        return os.dup(fd)
    if not is_stream(target):
        return None
    return os.open(target, os.O_WRONLY | os.O_CLOEXEC)


def is_stdout(target: Path) -> bool:
    """Whether writing ``target`` writes this process's standard output (``-`` included):
    a command's own messages then go to stderr."""
    if str(target) == "-":
        return True
    fd = descriptor(target)
    try:
        return fd is not None and os.path.samestat(os.fstat(fd), os.fstat(1))
    except OSError:
        return False


def real_target(target: Path) -> Path:
    """The file a write to ``target`` replaces: the end of its symlinks, if any."""
    return Path(os.path.realpath(target)) if target.is_symlink() else target


def open_temp(target: Path) -> tuple[int, Path]:
    """A new temporary file beside ``real_target(target)``, open for writing, with the
    mode the finished file should have; returns its descriptor and path."""
    final = real_target(target)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    remove_stale(final)
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a leftover of a crashed write: created anew, the umask applies
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        old = os.stat(final)
        if stat.S_ISREG(old.st_mode):
            os.fchmod(fd, stat.S_IMODE(old.st_mode))
    except FileNotFoundError:
        pass
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return fd, tmp


def remove_stale(final: Path) -> None:
    """Remove the temporary files of writes to ``final`` whose process is no longer
    running on this host: killed (SIGKILL, a crash) before it could clean up, each left a
    file as large as what it had written."""
    prefix = f".{final.name}."
    try:
        with os.scandir(final.parent) as entries:
            names = [e.name for e in entries if e.name.startswith(prefix)]
    except OSError:
        return  # the write itself will say what is wrong with the directory
    for name in names:
        pid = name[len(prefix) : -len(".tmp")] if name.endswith(".tmp") else ""
        if pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(final.parent / name)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process (EPERM): it is running
    return True


def replace(tmp: Path, target: Path) -> None:
    """Rename the finished temporary file over the target (through its symlinks)."""
    os.replace(tmp, real_target(target))
