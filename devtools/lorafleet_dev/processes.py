"""Local servers as child processes: free ports, death with the parent, logs, waiting for ready.

Shared by the control plane (etcd, kube-apiserver, kube-controller-manager) and the local node
agents, so every server started for the demo or a test is stopped the same way and none
outlives the process that started it.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

log = logging.getLogger(__name__)


class HarnessError(RuntimeError):
    """A local server (or the binaries it needs) could not be found, started or used."""


# Ports for servers this harness starts come from 20000-29999: below the kernel's ephemeral
# range (32768-60999 by default, where bind(0) and every outgoing connection get theirs) and
# below Kubernetes' NodePorts (30000-32767), in a block of 1000 for each pytest-xdist worker (the
# other blocks for processes outside pytest-xdist). So the port a child binds a moment after its
# choice here is not meanwhile taken by a port the kernel handed out, nor chosen by another worker.
PORT_BASE, PORT_BLOCK, PORT_BLOCKS = 20000, 1000, 10
_next_in_block = itertools.count()  # this process's walk through its block


def port_block() -> range:
    """This process's ports: its pytest-xdist worker's block (``PYTEST_XDIST_WORKER`` gwN), or
    for other processes one of the upper blocks, by process id."""
    worker, half = os.environ.get("PYTEST_XDIST_WORKER", ""), PORT_BLOCKS // 2
    if worker.startswith("gw") and worker[2:].isdigit():
        block = int(worker[2:]) % half
    else:
        block = half + os.getpid() % half
    start = PORT_BASE + block * PORT_BLOCK
    return range(start, start + PORT_BLOCK)


def free_port() -> int:
    """A TCP port of this process's block (`port_block`) free on 127.0.0.1 now; each call
    walks on, so a port handed out is not handed out again until the block comes round."""
    block = port_block()
    for _ in block:
        port = block[next(_next_in_block) % len(block)]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # in use (or lingering): the next one
                continue
            return port
    raise HarnessError(f"no free port on 127.0.0.1 in {block.start}-{block.stop - 1}")


PR_SET_PDEATHSIG = 1


def popen_dying_with_parent(
    argv: Sequence[str],
    log_path: Path,
    *,
    new_session: bool = False,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` with its output appended to ``log_path``; it gets SIGTERM when we die.

    The child starts as ``python -m lorafleet_dev.processes <our pid> argv...``, which sets
    PR_SET_PDEATHSIG and execs ``argv`` (the setting survives exec, and the pid stays the
    same). That is done in a fresh interpreter rather than in a ``preexec_fn``, which is unsafe
    while the parent runs threads (gRPC's, for one). The signal fires when the *thread* that
    started the child ends: start servers from the main thread (as pytest fixtures and the demo
    do). ``new_session`` puts the child in a process group of its own, so one signal reaches its
    children too, and the whole group is killed when we die (the child's own children, a
    server's workers, get no death signal of their own). ``env``: its whole environment (ours
    when None).
    """
    launcher = [sys.executable, "-m", __name__, str(os.getpid())]
    with log_path.open("ab") as out:
        return subprocess.Popen(
            [*launcher, *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
            env=env,
        )


def _exec_dying_with(parent_pid: int, argv: list[str]) -> NoReturn:
    """Ask for SIGTERM when ``parent_pid`` dies, then become ``argv``."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The parent may have died before prctl: then nobody would ever send the signal.
    if os.getppid() != parent_pid:
        sys.exit(f"parent {parent_pid} exited before {argv[0]} started")
    if os.getpgrp() == os.getpid():
        _kill_group_with(parent_pid)
    os.execvp(argv[0], argv)


def _kill_group_with(parent_pid: int) -> None:
    """Fork a watcher that SIGKILLs this process group (itself included) once ``parent_pid``
    exits: what the child starts in its group (vLLM's engine core, an engine's ranks) would
    otherwise outlive us. It blocks on a pidfd, so it costs nothing while it waits."""
    watched = os.pidfd_open(parent_pid)
    if os.fork() == 0:
        select.select([watched], [], [])
        os.killpg(0, signal.SIGKILL)
        os._exit(0)
    os.close(watched)


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ("" if it does not exist yet)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class ChildProcess:
    """One server process with its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    argv: list[str]
    env: Mapping[str, str] | None = None

    @classmethod
    def spawn(cls, name: str, argv: Sequence[str], log_dir: Path, env: Mapping[str, str] | None = None) -> ChildProcess:
        """Start one server, its output appended to ``<log_dir>/<name>.log`` (``env``: its
        environment, ours when None)."""
        log_path = log_dir / f"{name}.log"
        popen = popen_dying_with_parent(argv, log_path, env=env)
        log.info("started %s (pid %d), log %s", name, popen.pid, log_path)
        return cls(name, popen, log_path, list(argv), env)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of this server's log."""
        return log_tail(self.log_path, lines)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after grace_s; always reaps the child."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not exit on SIGTERM; killing it", self.name)
                self.popen.kill()
                self.popen.wait()

    def wait_until(self, what: str, probe: Callable[[], bool], timeout_s: float, interval_s: float = 0.2) -> None:
        """Poll probe() until it returns True; fail early if the process exits, with its log tail."""
        deadline = time.monotonic() + timeout_s
        last_error = ""
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise HarnessError(f"{self.name} exited with {self.popen.returncode} while waiting for {what}:\n{self.log_tail()}")
            try:
                if probe():
                    return
            except (OSError, urllib.error.URLError, ValueError) as exc:
                last_error = str(exc)
            time.sleep(interval_s)
        raise HarnessError(f"timed out after {timeout_s:.0f}s waiting for {what} ({last_error}):\n{self.log_tail()}")


if __name__ == "__main__":
    _exec_dying_with(int(sys.argv[1]), sys.argv[2:])


def built_bin_dir(script: Path, override_env: str, binaries: Sequence[str], what: str, cold: str) -> Path:
    """The cached bin dir a build script names (``--print-bin-dir --no-build``), or the directory
    in `override_env`; nothing is built here (builds take minutes): a missing build, or a
    binary missing from it, is a HarnessError naming the script to run."""
    override = os.environ.get(override_env)
    if override:
        bin_dir = Path(override)
    else:
        proc = subprocess.run(["bash", str(script), "--print-bin-dir", "--no-build"], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise HarnessError(
                f"the {what} are not built; run scripts/{script.name} first ({cold} cold, cached afterwards).\n{proc.stderr.strip()}"
            )
        bin_dir = Path(proc.stdout.strip())
    missing = [b for b in binaries if not os.access(bin_dir / b, os.X_OK)]
    if missing:
        raise HarnessError(f"{bin_dir} lacks {', '.join(missing)}; run scripts/{script.name} to build them")
    return bin_dir
