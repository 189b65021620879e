"""Host file operations beneath a root directory that never follow a symlink, and checks of the dirs proctor
keeps its state in.

Owns two small things, both plain OS calls (no repo, no job):

    open_beneath(root_fd, rel, flags)   openat2(RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|RESOLVE_NO_MAGICLINKS),
                                        or, where the kernel lacks it (ENOSYS, or a seccomp filter's EPERM),
                                        a walk opening each component with O_NOFOLLOW (walk_open)
    read_regular / create_excl / makedirs / symlink / unlink / rmtree   the operations the host does on
                                        a path an agent or a repo controls, each through open_beneath
    unsafe_dir(path) / unsafe_parent(path) / private_dir(path)   a dir proctor holds state in is the
                                        user's and writable by nobody else; the dirs above it cannot be
                                        swapped by another user

Why (issue 21, measured): `copy = ["conf/.env"]` wrote a secret through a directory an agent had turned into
a symlink, and a committed symlink `ph -> $PROCTOR_HOME` made `copy = ["ph/keys/host.key"]` read the listener's
private key. O_NOFOLLOW guards only the last component; the kernel's resolver with RESOLVE_NO_SYMLINKS guards
every one, `..` and absolute links included. And a `{repo}-agents/` another user pre-created in a shared
sticky dir was used as found: she swapped the validation checkout mid-job.

Errors are OSError (ELOOP: a symlink on the way; EXDEV: it would leave the root); callers turn them into
their own results with `why()`. Paths given as `rel` are relative, never `..`.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import stat
import struct

SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "arm64": 437}  # the same number on both (include/uapi asm-generic)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
MAX_DEPTH = 4096  # deeper than PATH_MAX allows anyway: a tree this deep is refused, not recursed


def _parts(rel: str | os.PathLike) -> list[str]:
    parts = [p for p in os.fspath(rel).split("/") if p not in ("", ".")]
    if os.fspath(rel).startswith("/") or ".." in parts:
        raise OSError(errno.EXDEV, "not a relative path beneath the root", os.fspath(rel))
    return parts


@functools.cache
def _openat2():
    """The raw syscall, or None on an architecture whose number is not known here."""
    number = SYS_OPENAT2.get(platform.machine())
    if number is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.syscall
    fn.restype = ctypes.c_long
    return functools.partial(fn, ctypes.c_long(number))


def _try_openat2(root_fd: int, rel: str, flags: int, mode: int) -> int | None:
    """An fd, None where openat2 is missing; raises OSError for every other refusal."""
    call = _openat2()
    if call is None:
        return None
    how = ctypes.create_string_buffer(struct.pack("=QQQ", flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0,
                                                  RESOLVE))
    fd = call(ctypes.c_int(root_fd), ctypes.c_char_p(os.fsencode(rel)), how, ctypes.c_size_t(len(how.raw)))
    if fd >= 0:
        return int(fd)
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM) and not _has_openat2():
        return None  # an old kernel, or a seccomp filter that refuses syscalls it does not know
    raise OSError(err, os.strerror(err), rel)


@functools.cache
def _has_openat2() -> bool:
    """Asked once: does openat2 itself work here (a harmless open of `/`)?"""
    call = _openat2()
    if call is None:
        return False
    how = ctypes.create_string_buffer(struct.pack("=QQQ", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0, 0))
    fd = call(ctypes.c_int(-100), ctypes.c_char_p(b"/"), how, ctypes.c_size_t(len(how.raw)))  # AT_FDCWD
    if fd >= 0:
        os.close(fd)
        return True
    return False


def walk_open(root_fd: int, rel: str | os.PathLike, flags: int, mode: int = 0o600) -> int:
    """The fallback: each directory on the way opened with O_NOFOLLOW|O_DIRECTORY from the previous one's fd,
    the last with O_NOFOLLOW. No `..` (refused by _parts), so nothing can climb out of the root."""
    parts = _parts(rel)
    if not parts:
        return os.open(".", flags | os.O_CLOEXEC, dir_fd=root_fd)
    cur = root_fd
    try:
        for name in parts[:-1]:
            try:
                nxt = os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=cur)
            except NotADirectoryError:
                # O_DIRECTORY wins over O_NOFOLLOW on a symlink: say ELOOP, as openat2 does.
                if stat.S_ISLNK(os.stat(name, dir_fd=cur, follow_symlinks=False).st_mode):
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), name) from None
                raise
            if cur != root_fd:
                os.close(cur)
            cur = nxt
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=cur)
    finally:
        if cur != root_fd:
            os.close(cur)


def open_beneath(root_fd: int, rel: str | os.PathLike, flags: int, mode: int = 0o600) -> int:
    """`rel` opened beneath `root_fd`, no symlink followed at any component (ELOOP), never outside (EXDEV)."""
    parts = _parts(rel)
    if not parts:
        return walk_open(root_fd, "", flags, mode)
    fd = _try_openat2(root_fd, "/".join(parts), flags, mode)
    return fd if fd is not None else walk_open(root_fd, rel, flags, mode)


def open_root(path: str | os.PathLike) -> int:
    """The root every operation is beneath: a directory, and not a symlink itself."""
    return os.open(path, DIR_FLAGS | os.O_NOFOLLOW)


def why(exc: OSError) -> str:
    """An OSError of this module in a reader's words."""
    if exc.errno == errno.ELOOP:
        return "a symlink is on the way (symlinks are never followed there)"
    if exc.errno == errno.EXDEV:
        return "it leads outside its root"
    if exc.errno == errno.ENOTDIR:
        return "a component on the way is not a directory"
    return exc.strerror or str(exc)


# -- the operations --------------------------------------------------------------------------------------

def read_regular(root_fd: int, rel: str, cap: int) -> bytes:
    """A regular file of at most `cap` bytes, opened non-blocking (a FIFO never hangs the host)."""
    fd = open_beneath(root_fd, rel, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", rel)
        data = fh.read(cap + 1)
    if len(data) > cap:
        raise OSError(errno.EFBIG, f"larger than {cap} bytes", rel)
    return data


def makedirs(root_fd: int, rel: str, mode: int = 0o700) -> int:
    """Every missing directory of `rel` made beneath the root (none of them through a symlink); the last
    one's fd (the caller closes it)."""
    cur = os.dup(root_fd)
    try:
        for name in _parts(rel):
            try:
                os.mkdir(name, mode, dir_fd=cur)
            except FileExistsError:
                pass
            nxt = open_beneath(cur, name, DIR_FLAGS)
            os.close(cur)
            cur = nxt
        out, cur = cur, -1
        return out
    finally:
        if cur >= 0:
            os.close(cur)


def _parent(root_fd: int, rel: str, make: bool) -> tuple[int, str]:
    parts = _parts(rel)
    if not parts:
        raise OSError(errno.EINVAL, "the root itself", rel)
    head = "/".join(parts[:-1])
    fd = makedirs(root_fd, head) if make else open_beneath(root_fd, head, DIR_FLAGS)
    return fd, parts[-1]


def create_excl(root_fd: int, rel: str, data: bytes, mode: int = 0o600) -> None:
    """A new file (O_EXCL: never one that is there, nor a link's target), its parents made as needed."""
    parent, name = _parent(root_fd, rel, make=True)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent)
    finally:
        os.close(parent)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def symlink(root_fd: int, rel: str, target: str | os.PathLike) -> None:
    parent, name = _parent(root_fd, rel, make=True)
    try:
        os.symlink(target, name, dir_fd=parent)
    finally:
        os.close(parent)


def lstat(root_fd: int, rel: str) -> os.stat_result:
    """The entry itself (a symlink is stat'ed, not followed), reached with no symlink on the way."""
    parent, name = _parent(root_fd, rel, make=False)
    try:
        return os.stat(name, dir_fd=parent, follow_symlinks=False)
    finally:
        os.close(parent)


def unlink(root_fd: int, rel: str) -> None:
    parent, name = _parent(root_fd, rel, make=False)
    try:
        os.unlink(name, dir_fd=parent)
    finally:
        os.close(parent)


def rmtree(root_fd: int, rel: str) -> None:
    """Remove `rel` (a file, a link, or a whole directory) without following any link; a directory whose
    mode keeps its owner out is opened up first (an agent's `chmod 000`)."""
    parent, name = _parent(root_fd, rel, make=False)
    try:
        _remove_at(parent, name, 0)
    finally:
        os.close(parent)


def _remove_at(dir_fd: int, name: str, depth: int) -> None:
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    if depth > MAX_DEPTH:
        raise OSError(errno.ELOOP, "directory tree too deep", name)
    if stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
        # No-follow chmod (glibc refuses it on a symlink: one swapped in meanwhile is not followed).
        os.chmod(name, 0o700, dir_fd=dir_fd, follow_symlinks=False)
    fd = os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        if os.fstat(fd).st_ino != st.st_ino:
            raise OSError(errno.EAGAIN, "replaced while it was being removed", name)
        for child in os.listdir(fd):
            _remove_at(fd, child, depth + 1)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


# -- the dirs proctor keeps state in -----------------------------------------------------------------------

def unsafe_dir(path: str | os.PathLike, uid: int | None = None) -> str | None:
    """Why `path` may not hold proctor's state (None: it may): it must be a real directory (not a symlink)
    owned by this user and writable by nobody else."""
    uid = os.geteuid() if uid is None else uid
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path} cannot be checked: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory (a symlink or a file is there)"
    if st.st_uid != uid:
        return f"{path} belongs to uid {st.st_uid}, not to this user (uid {uid}): another user can change it"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def unsafe_parent(path: str | os.PathLike, uid: int | None = None) -> str | None:
    """Why a directory proctor makes things in (and each above it) lets another user swap what it made:
    owned by someone other than this user or root, or world-writable without the sticky bit (then anyone
    renames our entries away). A shared sticky dir (/tmp) is fine: only its entries' owners move them."""
    uid = os.geteuid() if uid is None else uid
    lexical = os.path.abspath(os.fspath(path))
    for p in _ancestors(lexical):
        try:
            st = os.lstat(p)
        except OSError as exc:
            return f"{p} cannot be checked: {exc.strerror}"
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, uid):
            return f"{p} is a symlink of uid {st.st_uid}: that user can point it elsewhere"
    # A symlink on the way (/var/run -> /run) is fine when it is ours or root's: what it names counts.
    for p in _ancestors(os.path.realpath(lexical)):
        try:
            st = os.stat(p)
        except OSError as exc:
            return f"{p} cannot be checked: {exc.strerror}"
        if st.st_uid not in (0, uid):
            return f"{p} belongs to uid {st.st_uid}: that user can replace what proctor makes in it"
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            return f"{p} is world-writable without the sticky bit (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _ancestors(p: str) -> list[str]:
    out = [p]
    while os.path.dirname(out[-1]) != out[-1]:
        out.append(os.path.dirname(out[-1]))
    return out


def private_dir(path: str | os.PathLike, mode: int = 0o700) -> str | None:
    """`path` made (mkdir, `mode`) when missing, then checked: this user's, writable by nobody else, under
    parents nobody else can swap it in. A str names the dir and why it is refused."""
    why_not = unsafe_parent(os.path.dirname(os.path.abspath(os.fspath(path))))
    if why_not:
        return why_not
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot make {path}: {exc.strerror}"
    return unsafe_dir(path)
