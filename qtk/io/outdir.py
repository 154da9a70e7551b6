"""Where qtk writes: inside the output directory OUT, at the names it owns there, never through a link.

The rule every command that writes follows (convert, tune, convert --gate): qtk creates, truncates, renames and
deletes only inside OUT, only at names it owns (its targets, the files a command documents, its lock, its resume
state, its temporary names), never through a link, and it never removes what it did not write. OUT itself is the
user's to name and may be a link; below it, a link at a name qtk owns is refused (one line, exit 2), never followed,
replaced or removed. A folder qtk made itself in this run holds only what qtk put there, so a writer writes inside
its own with plain opens; everything else goes through the helpers here: each walks from OUT one component at a time
with O_NOFOLLOW, and a file is written under a temporary name and renamed over the old one (a rename replaces a
name: it never writes into the file, hard link or link that was there).

`check_output` is the one check of OUT that every command that writes runs before any work; `OutDir` creates OUT
and holds its exclusive lock for the run.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Iterable

from qtk.errors import UsageError
from qtk.io.lock import DirLock, LockHeld, NotALockFile

LOCK = ".qtk-lock"
# what a killed run leaves in OUT: .<name>.qtk-tmp-PID (being written), .<target>.qtk-old-PID (an old output moved
# aside while committing), .qtk-resume.tmp-PID (resume state being created)
LEFTOVER = re.compile(r"^\.(?:.+\.qtk-(?:tmp|old)|qtk-resume\.tmp)-(\d+)$")
PID_MAX = 4194304  # Linux's PID_MAX_LIMIT: no process ID is larger
# the most bytes qtk adds below OUT (rounds/round-N/.<target>.qtk-tmp-<pid>/<shard>.safetensors and the like):
# an OUT that leaves less room under PATH_MAX would fail half-way through a run
PATH_ROOM = 256
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def is_pid(text: str) -> bool:
    """Whether `text` is how qtk writes a process ID into a name (no leading zeros, within PID_MAX)."""
    return text.isdigit() and text == str(int(text)) and 0 < int(text) <= PID_MAX


def refusal(p: Path) -> UsageError:
    """The one line for something at a name qtk owns that it must not write through or remove."""
    try:
        st = os.lstat(p)
    except OSError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        return UsageError(f"output {p} is a link to {os.readlink(p)}; qtk never writes through a link in its output",
                          "remove the link, or choose another -o")
    if st is not None and stat.S_ISDIR(st.st_mode):
        return UsageError(f"output {p} is a folder where qtk writes a file", "remove it, or choose another -o")
    return UsageError(f"output {p} is not a folder qtk made", "remove it, or choose another -o")


def _short(text: str, keep: int = 24) -> str:
    return text if len(text) <= keep else text[:keep] + "…"


def check_utf8(path, what: str, fix: str) -> None:
    """Refuse a path that qtk will write into an output's README.md and qtk.json but cannot: a name that is not
    UTF-8 (Python keeps its bytes as lone surrogates) or holds a NUL."""
    text = os.fspath(path)
    if "\x00" in text:
        raise UsageError(f"{what} {text} holds a NUL byte", fix)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"{what} {text} is not valid UTF-8 (qtk writes this path into README.md and qtk.json)", fix) from None


def _limits(path: str) -> tuple[int, int]:
    """(PATH_MAX, NAME_MAX) of the file system the nearest existing folder above `path` lies on."""
    p = path
    while not os.path.isdir(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    try:
        return os.pathconf(p, "PC_PATH_MAX"), os.pathconf(p, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 4096, 255


def check_output_path(out) -> None:
    """Refuse an OUT qtk could not create or fill: not UTF-8, longer than PATH_MAX allows with the names qtk writes
    below it, or a component longer than NAME_MAX (which used to fail at mkdir, after the folders above it were
    made)."""
    check_utf8(out, "output", "rename it, or choose another -o")
    absolute = os.path.abspath(os.fspath(out))
    path_max, name_max = _limits(absolute)
    n = len(os.fsencode(absolute))
    if n + PATH_ROOM > path_max:
        raise UsageError(f"output path is {n} bytes long; with the up to {PATH_ROOM} bytes of the names qtk writes below "
                         f"it, paths would pass this system's limit of {path_max} bytes (PATH_MAX)", "choose a shorter -o")
    for part in absolute.split(os.sep):
        if len(os.fsencode(part)) > name_max:
            raise UsageError(f"output path component '{_short(part)}' is {len(os.fsencode(part))} bytes long, over this "
                             f"file system's limit of {name_max} (NAME_MAX)", "choose a shorter -o")


def check_output(source, out, names: Iterable[str], folders: Iterable[str] = ()) -> None:
    """The check every command that writes runs on OUT before any work. `names`: what the command writes in OUT
    (relative paths: its targets, its files, its lock and state); `folders`: those of them it owns whole (nothing
    in them may be a link). Refuses (UsageError, exit 2):

    - a model or OUT name qtk cannot write (not UTF-8, past PATH_MAX or NAME_MAX);
    - an OUT inside the model, or a name that is, contains or lies inside the model (links resolved): replacing it
      (--overwrite), or removing it as stale state, would delete the model;
    - a link at any of those names, at a folder above one below OUT, or directly in one of `folders`;
    - a name like a killed run's leftover whose number is no process ID: qtk did not write it, so it neither
      removes it nor works around it."""
    check_utf8(source, "model", "rename the model directory")
    check_output_path(out)
    out = Path(out)
    src, out_abs = Path(source).resolve(), out.resolve()
    fix = "write the output somewhere else; qtk never modifies its input"
    if out_abs == src or src in out_abs.parents:
        raise UsageError(f"output {out} is inside the model directory", fix)
    names = list(names)
    for name in names:
        p = out / name
        real = p.resolve()
        if real == src:
            raise UsageError(f"output {p} is the model directory itself", fix)
        if real in src.parents:
            raise UsageError(f"output {p} contains the model directory {source}", fix)
        if src in real.parents:
            raise UsageError(f"output {p} is inside the model directory", fix)
    for name in names:
        p = out
        for part in Path(name).parts:
            p = p / part
            if os.path.islink(p):
                raise refusal(p)
    for name in folders:
        if (out / name).is_dir():
            for p in (out / name).iterdir():
                if p.is_symlink():
                    raise refusal(p)
    if out.is_dir():
        for p in sorted(out.iterdir()):
            m = LEFTOVER.match(p.name)
            if m and not is_pid(m.group(1)):
                raise UsageError(f"output {p} is named like a leftover of a killed qtk run, but no process has ID "
                                 f"{m.group(1)}: qtk did not write it and does not remove it",
                                 f"move it out of {out}, or choose another -o")


class OutDir:
    """OUT for one run of a command that writes: open() creates it (remembering the folders it made) and takes its
    exclusive lock, so a second run on the same OUT stops at once, naming the first; close() lets go; rollback()
    also removes the folders open() made, when they are empty (a folder that was there before stays). As a context
    manager: open, then close, or roll back on an exception."""

    def __init__(self, out):
        self.out = Path(out)
        self.created: list[Path] = []  # deepest first
        self.lock = DirLock(self.out, LOCK)

    def open(self) -> None:
        try:
            p = self.out
            while not os.path.lexists(p):
                self.created.append(p)
                p = p.parent
            self.out.mkdir(parents=True, exist_ok=True)
            self.lock.acquire()
        except LockHeld as e:
            self.rollback()
            who = f"qtk (PID {e.holder})" if e.holder.isdigit() else "another qtk run"
            raise UsageError(f"{who} is writing to {self.out}", "wait for it to finish, or choose another -o") from None
        except NotALockFile as e:
            self.rollback()
            raise UsageError(f"output {self.lock.path} is not a lock file qtk made ({e.why})",
                             "remove it, or choose another -o") from None
        except OSError as e:
            self.rollback()
            if e.errno == errno.ELOOP:
                raise refusal(self.lock.path) from None
            raise UsageError(f"cannot write to {self.out} ({e.strerror})", "choose a writable output directory with -o") from None
        except BaseException:
            self.rollback()
            raise

    def close(self) -> None:
        self.lock.release()

    def __enter__(self) -> OutDir:
        self.open()
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.rollback()

    def rollback(self) -> None:
        self.lock.release()
        for d in self.created:
            try:
                d.rmdir()
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.ENAMETOOLONG):  # one it did not get to make
                    break


# ---- creating, replacing and removing below OUT without following a link


def _parts(rel) -> tuple[str, ...]:
    parts = Path(rel).parts
    if not parts or Path(rel).is_absolute() or any(p in (".", "..") for p in parts):
        raise ValueError(f"not a name below OUT: {rel!r}")
    return parts


def _open_dir(root: Path, parts: tuple[str, ...], create: bool) -> int:
    """A descriptor of root/parts, walked one component at a time without following a link (made where absent when
    `create`)."""
    fd = os.open(root, _DIR)  # OUT itself is the user's to name: it may be a link
    try:
        for i, name in enumerate(parts):
            if create:
                try:
                    os.mkdir(name, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                nfd = os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise refusal(root.joinpath(*parts[: i + 1])) from None
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lstat(name: str, fd: int):
    try:
        return os.lstat(name, dir_fd=fd)
    except FileNotFoundError:
        return None


def make_dir(root, rel) -> Path:
    """root/rel as a folder, each missing component made; a link or a file on the way is refused."""
    os.close(_open_dir(Path(root), _parts(rel), create=True))
    return Path(root, rel)


def fresh_dir(root, rel) -> Path:
    """root/rel as a new, empty folder: what an earlier run left there (a folder) is removed first; a link there is
    refused."""
    root, parts = Path(root), _parts(rel)
    fd = _open_dir(root, parts[:-1], create=True)
    try:
        st = _lstat(parts[-1], fd)
        if st is not None:
            if not stat.S_ISDIR(st.st_mode):
                raise refusal(root.joinpath(*parts))
            shutil.rmtree(parts[-1], dir_fd=fd)
        os.mkdir(parts[-1], dir_fd=fd)
    finally:
        os.close(fd)
    return root.joinpath(*parts)


def write_file(root, rel, data: bytes) -> Path:
    """Write root/rel whole: into a new temporary file beside it (O_EXCL, O_NOFOLLOW), flushed, then renamed over
    the old name. Missing folders on the way are made; a link anywhere below root, or a folder at rel, is refused."""
    root, parts = Path(root), _parts(rel)
    path = root.joinpath(*parts)
    fd = _open_dir(root, parts[:-1], create=True)
    tmp = f".{parts[-1]}.qtk-tmp-{os.getpid()}"
    try:
        st = _lstat(parts[-1], fd)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise refusal(path)
        try:
            os.unlink(tmp, dir_fd=fd)  # this process's own name: a leftover of a dead run that had our PID
        except FileNotFoundError:
            pass
        w = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(w, view):]
            os.fsync(w)
        finally:
            os.close(w)
        os.replace(tmp, parts[-1], src_dir_fd=fd, dst_dir_fd=fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=fd)
        except OSError:
            pass
        raise
    finally:
        os.close(fd)
    return path


def remove_tree(root, rel) -> None:
    """Remove root/rel (a folder and what it holds, or a file) if it is there; a link there is refused, never
    removed or followed."""
    root, parts = Path(root), _parts(rel)
    try:
        fd = _open_dir(root, parts[:-1], create=False)
    except FileNotFoundError:
        return
    try:
        st = _lstat(parts[-1], fd)
        if st is None:
            return
        if stat.S_ISLNK(st.st_mode):
            raise refusal(root.joinpath(*parts))
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(parts[-1], dir_fd=fd)  # removes what is inside without following a link there
        else:
            os.unlink(parts[-1], dir_fd=fd)
    finally:
        os.close(fd)


def replace_dir(root, src, dst) -> Path:
    """Rename the folder root/src to root/dst, replacing a folder there (moved aside first, removed after); a link
    at either is refused."""
    root, sp, dp = Path(root), _parts(src), _parts(dst)
    sfd = _open_dir(root, sp[:-1], create=False)
    try:
        dfd = _open_dir(root, dp[:-1], create=True)
        try:
            st = _lstat(sp[-1], sfd)
            if st is None or not stat.S_ISDIR(st.st_mode):
                raise refusal(root.joinpath(*sp))
            old = _lstat(dp[-1], dfd)
            if old is not None and not stat.S_ISDIR(old.st_mode):
                raise refusal(root.joinpath(*dp))
            if old is None:
                os.rename(sp[-1], dp[-1], src_dir_fd=sfd, dst_dir_fd=dfd)
            else:
                aside = f".{dp[-1]}.qtk-old-{os.getpid()}"
                if _lstat(aside, dfd) is not None:
                    remove_tree(root, Path(*dp[:-1], aside) if len(dp) > 1 else aside)
                os.rename(dp[-1], aside, src_dir_fd=dfd, dst_dir_fd=dfd)
                os.rename(sp[-1], dp[-1], src_dir_fd=sfd, dst_dir_fd=dfd)
                shutil.rmtree(aside, dir_fd=dfd)
            os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
    return root.joinpath(*dp)
