"""The heartbeat channel under :mod:`lockstep.rl.liveness`: one TCP connection per peer, a daemon thread
that sends this process's phase every ``interval`` and reads the peers', and loss detection.

:class:`Liveness` is one end. Its thread wakes on incoming data or every ``interval / 2``; it reads the
peers' messages (JSON lines: ``{"beat": phase}``, ``{"done": true}``, or what a subclass handles in
``_message``), sends a beat when one is due, and declares a peer lost -- ``died`` when its connection
closes, ``stalled`` when nothing came from it for ``timeout_s`` -- calling ``_on_lost`` once. A process
that was itself paused (its thread late by more than ``timeout_s / 2``) restarts the peers' clocks
rather than blame them. Peers that said ``done`` are no longer watched.
"""

from __future__ import annotations

import json
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass

_any_lost = False


def peer_lost() -> bool:
    """Whether a peer of this process was lost (or announced lost): leaving must not wait on it (no
    ``destroy_process_group``, which may wait for transfers that will never finish)."""
    return _any_lost


def mark_lost() -> None:
    global _any_lost
    _any_lost = True


def reset_lost() -> None:
    """Forget losses of an earlier run in this process (``lockstep rl`` called in-process twice, e.g. by
    tests): a stale flag would make the next run leave through ``os._exit``."""
    global _any_lost
    _any_lost = False


@dataclass
class Loss:
    rank: int
    #: "died" (connection closed) or "stalled" (silent for timeout_s)
    kind: str
    #: what the process last said it was doing
    phase: str
    silent_s: float = 0.0

    def describe(self, who: str, timeout_s: float) -> str:
        how = ("died (its connection closed)" if self.kind == "died" else
               f"stalled (no heartbeat for {self.silent_s:.1f} s, liveness.timeout_s={timeout_s:g})")
        return f"{who} {how} while {self.phase}"


class PeerLost(RuntimeError):
    """A process this one depends on died or stalled (the message is one line)."""

    def __init__(self, loss: Loss, message: str) -> None:
        super().__init__(message)
        self.loss = loss
        #: set by whoever stops the run: the line the command prints last (where to resume)
        self.outcome = ""

    @property
    def rank(self) -> int:
        return self.loss.rank


class Peer:
    def __init__(self, rank: int, sock: socket.socket | None, now: float) -> None:
        self.rank, self.sock = rank, sock
        self.inbuf, self.outbuf = bytearray(), bytearray()
        self.heard = now
        self.phase = "starting"
        self.loss: Loss | None = None
        self.done = False  # said goodbye: silence and EOF are expected
        if sock is not None:
            sock.setblocking(False)


class Liveness:
    """One end of the channel: the thread, this process's phase, heartbeats and loss detection."""

    def __init__(self, rank: int, timeout_s: float) -> None:
        self.rank, self.timeout_s = rank, timeout_s
        self.interval = min(1.0, timeout_s / 5)
        self.peers: dict[int, Peer] = {}
        self._phase = "starting"
        self._lock = threading.RLock()
        self._lost_event = threading.Event()
        self._closed = False
        self._last_beat = self._last_loop = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="lockstep-liveness", daemon=True)

    # ---------------------------------------------------------------- main thread

    def phase(self, text: str) -> None:
        """Say what this process is doing now (sent to the peers at once)."""
        with self._lock:
            self._phase = text
            for peer in self._watched():
                self._send(peer, {"beat": text})

    def close(self) -> None:
        """Stop the thread and close the connections."""
        with self._lock:
            self._closed = True
            for peer in self.peers.values():
                if peer.sock is not None:
                    self._flush(peer)
                    peer.sock.close()
                    peer.sock = None

    # ---------------------------------------------------------------- the thread

    def _watched(self) -> list[Peer]:
        return [p for p in self.peers.values() if p.sock is not None and p.loss is None and not p.done]

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                socks = [p.sock for p in self._watched()]
            try:
                ready = select.select(socks, [], [], self.interval / 2)[0] if socks else []
            except (OSError, ValueError):  # a socket closed meanwhile
                ready = []
            if not socks:
                time.sleep(self.interval / 2)
            with self._lock:
                if self._closed:
                    return
                try:
                    self._tick(set(ready))
                except Exception as err:  # noqa: BLE001 -- the watcher must not die silently
                    say(f"lockstep rl: liveness (rank {self.rank}): {type(err).__name__}: {err}")

    def _tick(self, ready: set) -> None:
        now = time.monotonic()
        for peer in self._watched():
            if peer.sock in ready:
                self._read(peer, now)
        if now - self._last_loop > self.timeout_s / 2:
            # this process itself was paused (stopped, starved): it cannot tell whether the peers were
            for peer in self._watched():
                peer.heard = now
        self._last_loop = now
        if now - self._last_beat >= self.interval:
            self._last_beat = now
            for peer in self._watched():
                self._send(peer, {"beat": self._phase})
        for peer in self._watched():
            self._flush(peer)
            if now - peer.heard > self.timeout_s:
                self._lose(peer, "stalled", now - peer.heard)

    def _read(self, peer: Peer, now: float) -> None:
        try:
            data = peer.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            if not peer.done:
                self._lose(peer, "died")
            return
        peer.heard = now
        peer.inbuf += data
        while b"\n" in peer.inbuf:
            line, _, rest = bytes(peer.inbuf).partition(b"\n")
            peer.inbuf = bytearray(rest)
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if "beat" in message:
                peer.phase = message["beat"]
            elif message.get("done"):
                peer.done = True
            else:
                self._message(peer, message)

    def _send(self, peer: Peer, message: dict) -> None:
        if peer.sock is None:
            return
        peer.outbuf += (json.dumps(message) + "\n").encode()
        self._flush(peer)

    def _flush(self, peer: Peer) -> None:
        if not peer.outbuf or peer.sock is None:
            return
        try:
            sent = peer.sock.send(peer.outbuf)
            del peer.outbuf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            if peer.loss is None and not peer.done:
                self._lose(peer, "died")

    def _lose(self, peer: Peer, kind: str, silent_s: float = 0.0) -> None:
        if peer.loss is not None:
            return
        mark_lost()
        peer.loss = Loss(peer.rank, kind, peer.phase, silent_s)
        self._lost_event.set()
        self._on_lost(peer)

    def _message(self, peer: Peer, message: dict) -> None:
        raise NotImplementedError

    def _on_lost(self, peer: Peer) -> None:
        raise NotImplementedError


def read_line(conn: socket.socket) -> bytes:
    """One line, byte by byte: what follows it stays in the socket for the thread."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = conn.recv(1)
        if not byte:
            raise OSError("connection closed before the hello")
        line += byte
    return bytes(line)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


