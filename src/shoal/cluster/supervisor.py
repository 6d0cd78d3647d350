"""dev-cluster's parts (nats-server, gateway, workers) as child processes: each started again with
back-off when it exits, all stopped in order on SIGINT or SIGTERM, and (on Linux) all killed by the
kernel when dev-cluster itself dies, SIGKILL included.

A part that exits is started again after 0.5 s, then 1, 2, 4... up to 10 s while it keeps exiting;
a part that stayed up `STABLE_S` starts over at 0.5 s. A part that exits with code 2 (shoal refused
its settings) stops the cluster instead, for starting it again cannot help.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FIRST_DELAY_S = 0.5
MAX_DELAY_S = 10.0
STABLE_S = 30.0
REFUSED_SETTINGS = 2  # shoal.cli's exit code for a ShoalError (and argparse's for bad flags)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(signum: int) -> Callable[[], None] | None:
    """A `preexec_fn` that has Linux send `signum` to the child when this process dies (None
    elsewhere). The kernel sends it when the *thread* that forked the child exits, so fork from a
    thread that lives as long as the process: its main thread."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child between fork and exec only calls it
    parent = os.getpid()

    def preexec() -> None:
        if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != parent:  # the parent died before prctl: no signal will come
            os.kill(os.getpid(), signum)

    return preexec


def describe_exit(returncode: int) -> str:
    """A Popen returncode as people read it: "code 1", "signal SIGKILL"."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"code {returncode}"


@dataclass
class Part:
    """One child: how to start it, its process, and how many times in a row it exited early."""

    name: str
    launch: Callable[[], subprocess.Popen]
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    quick_exits: int = 0
    restart_at: float | None = None  # set while it waits out its back-off

    def start(self) -> None:
        self.process, self.started_at, self.restart_at = self.launch(), time.monotonic(), None


@dataclass
class Supervisor:
    """The parts, in start order; `run` tends them until a signal, `stop` stops them in reverse."""

    stop_timeout_s: float
    parts: list[Part] = field(default_factory=list)
    stopping: bool = False
    reason: str | None = None  # why the cluster stops, when not a signal
    _handlers: dict[int, Any] = field(default_factory=dict)  # the handlers `run` replaced

    def start(self, name: str, launch: Callable[[], subprocess.Popen]) -> subprocess.Popen:
        part = Part(name, launch)
        part.start()
        self.parts.append(part)
        assert part.process is not None
        return part.process

    def run(self) -> None:
        """Until SIGINT or SIGTERM (or a part refuses its settings), start each part that exits
        again once its back-off has passed. Waits on a socket the signals wake (SIGCHLD included:
        a part exited), not on a timer. The handlers stay until `stop` is done, so a second Ctrl-C
        cannot cut the orderly stop short."""
        wake_read, wake_write = socket.socketpair()  # a socket: what Windows' wakeup fd takes too
        wake_write.setblocking(False)
        previous_fd = signal.set_wakeup_fd(wake_write.fileno())
        signals = [signal.SIGINT, signal.SIGTERM]
        child_signal = getattr(signal, "SIGCHLD", None)  # absent on Windows: look every second instead
        if child_signal is not None:
            signals.append(child_signal)
        self._handlers = {signum: signal.signal(signum, self._on_signal) for signum in signals}
        try:
            while not self.stopping:
                for part in self.parts:
                    self._tend(part)
                due = [part.restart_at for part in self.parts if part.restart_at is not None]
                timeout_s = max(0.0, min(due) - time.monotonic()) if due else None
                if child_signal is None:
                    timeout_s = min(timeout_s if timeout_s is not None else 1.0, 1.0)
                if not self.stopping and select.select([wake_read], [], [], timeout_s)[0]:
                    wake_read.recv(4096)  # the signal numbers; the handler has run
        finally:
            signal.set_wakeup_fd(previous_fd)
            wake_read.close()
            wake_write.close()

    def stop(self) -> None:
        """SIGTERM each part in reverse start order and wait for it (`stop_timeout_s`, then SIGKILL)."""
        for part in reversed(self.parts):
            process = part.process
            if process is None or process.poll() is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for signum, handler in self._handlers.items():
            if handler is not None:  # None: not set from Python, nothing to put back
                signal.signal(signum, handler)
        self._handlers = {}

    def _on_signal(self, signum: int, frame: object) -> None:
        if signum in (signal.SIGINT, signal.SIGTERM):
            self.stopping = True

    def _tend(self, part: Part) -> None:
        now = time.monotonic()
        if part.restart_at is not None:
            if now >= part.restart_at:
                self._restart(part)
            return
        assert part.process is not None
        returncode = part.process.poll()
        if returncode is None:
            return
        up_s = now - part.started_at
        if returncode == REFUSED_SETTINGS:
            self.reason = f"{part.name} exited with {describe_exit(returncode)} (its settings)"
            self.stopping = True
            return
        part.quick_exits = 1 if up_s >= STABLE_S else part.quick_exits + 1
        delay_s = min(FIRST_DELAY_S * 2 ** (part.quick_exits - 1), MAX_DELAY_S)
        part.restart_at = now + delay_s
        _say(f"{part.name} exited with {describe_exit(returncode)} after {up_s:.1f} s; starting it in {delay_s:.1f} s")

    def _restart(self, part: Part) -> None:
        try:
            part.start()
        except (OSError, subprocess.SubprocessError, RuntimeError, TimeoutError) as exc:
            # It failed to start (a port still taken, a binary gone): the next back-off step.
            part.quick_exits += 1
            delay_s = min(FIRST_DELAY_S * 2 ** (part.quick_exits - 1), MAX_DELAY_S)
            part.restart_at = time.monotonic() + delay_s
            _say(f"{part.name} did not start ({exc}); trying again in {delay_s:.1f} s")
            return
        assert part.process is not None
        _say(f"{part.name} started again (pid {part.process.pid})")


def _say(message: str) -> None:
    print(f"shoal dev-cluster: {message}", file=sys.stderr, flush=True)
