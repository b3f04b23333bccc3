"""Proof that a file was never opened: Linux inotify, through libc (no dependency)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_IN_ACCESS = 0x00000001
_IN_OPEN = 0x00000020
_IN_NONBLOCK = 0o4000
_EVENT_HEADER = struct.Struct("iIII")


class FileOpenWatcher:
    """Records every open() of the watched files, by any process on this machine.

    with FileOpenWatcher([p1, p2]) as w:
        ...
    assert not w.opened   # set of watched paths that were opened or read
    """

    def __init__(self, paths: Iterable[Path | str]) -> None:
        self.paths = [Path(p) for p in paths]
        self.opened: set[Path] = set()
        self._fd = -1
        self._wd: dict[int, Path] = {}
        name = ctypes.util.find_library("c")
        self._libc = ctypes.CDLL(name or "libc.so.6", use_errno=True)

    @staticmethod
    def available() -> bool:
        """Whether this libc has inotify (Linux)."""
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            return hasattr(libc, "inotify_init1")
        except OSError:
            return False

    def __enter__(self) -> FileOpenWatcher:
        fd = self._libc.inotify_init1(_IN_NONBLOCK)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self._fd = fd
        for p in self.paths:
            wd = self._libc.inotify_add_watch(fd, str(p).encode(), _IN_OPEN | _IN_ACCESS)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch({p}) failed")
            self._wd[wd] = p
        return self

    def poll(self) -> set[Path]:
        """Read the events so far; returns the watched paths opened or read until now."""
        while True:
            try:
                buf = os.read(self._fd, 65536)
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    break
                raise
            if not buf:
                break
            offset = 0
            while offset + _EVENT_HEADER.size <= len(buf):
                wd, mask, _cookie, length = _EVENT_HEADER.unpack_from(buf, offset)
                offset += _EVENT_HEADER.size + length
                if mask & (_IN_OPEN | _IN_ACCESS) and wd in self._wd:
                    self.opened.add(self._wd[wd])
        return self.opened

    def __exit__(self, *exc: Any) -> None:
        try:
            self.poll()
        finally:
            os.close(self._fd)
            self._fd = -1
