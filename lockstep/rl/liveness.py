"""Heartbeats between the RL trainer (rank 0) and its generator processes: who is alive, and what each is doing.

Transfers over gloo block until the process group's timeout (30 min by default) when a peer stops
answering, and say nothing. So liveness travels on a channel of its own: trainer rank 0 listens on a TCP
socket, every generator connects to it once while the layout is built (:func:`connect_liveness`), and
each end runs a daemon thread that

- sends a heartbeat carrying its current *phase* ("generating batch 3 with weights version 2") every
  ``interval`` (``timeout_s / 5``, at most 1 s), and at once when the phase changes;
- reads the other end's: a closed connection means the process died (its kernel closed the socket: seen
  at once); silence for ``liveness.timeout_s`` means it stalled (SIGSTOP, a hang holding the GIL, a
  machine gone). A process busy generating or training for minutes keeps beating from its thread; a hang
  in C code that releases the GIL is not seen here (what the other end waits for is). The channel's
  mechanics are :mod:`lockstep.rl.heartbeat`'s; this module is what each side does with it.

The trainer (:class:`TrainerLiveness`) reports a lost generator on stderr (one line: rank, died or
stalled, its last phase, what happens next), and every wait of its main thread on a generator
(:meth:`TrainerLiveness.wait`) raises :class:`PeerLost`; the trainer then stops or drops the generator
(:mod:`lockstep.rl.fleet`). A generator (:class:`GeneratorLiveness`) that loses the trainer, or is told to
stop or that it was dropped, says so on stderr and ends its process at once (``os._exit``: it holds
nothing to save, and its main thread may be blocked in a transfer that will never finish).

The same channel carries the trainer's messages (JSON lines): the start (first and last step, or the
trainer's start-up error), a lost generator and the first step of its batches that the others take over,
stop, dropped, done (the end of a normal run: silence and a closed connection no longer mean anything).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

from lockstep.rl.heartbeat import Liveness, Loss, Peer, PeerLost, mark_lost, peer_lost, read_line, say

__all__ = ["GeneratorLiveness", "Liveness", "Loss", "PeerLost", "TrainerLiveness", "connect_liveness", "peer_lost"]


class TrainerLiveness(Liveness):
    """Trainer rank 0's end: one connection per generator rank."""

    def __init__(self, timeout_s: float, on_generator_loss: str, generator_ranks: Iterable[int],
                 listener: socket.socket) -> None:
        super().__init__(0, timeout_s)
        self.continue_on_loss = on_generator_loss == "continue"
        #: lost generators the trainer has dropped (continue mode): their loss is handled
        self.dropped: set[int] = set()
        #: the launcher asked this process to end (SIGTERM) after a generator was lost: stop, whatever the mode
        self.sigterm = False
        self.stopping = False
        self._accept(set(generator_ranks), listener)
        self._previous_sigterm = None
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._thread.start()

    def _accept(self, expected: set[int], listener: socket.socket) -> None:
        """Wait (up to timeout_s) for every generator's hello; one that never comes is lost."""
        deadline = time.monotonic() + self.timeout_s
        with listener:
            while expected - set(self.peers) and time.monotonic() < deadline:
                listener.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    conn, _ = listener.accept()
                    conn.settimeout(max(0.01, deadline - time.monotonic()))
                    hello = json.loads(read_line(conn))
                except (OSError, ValueError, KeyError):
                    continue
                self.peers[hello["hello"]] = Peer(hello["hello"], conn, time.monotonic())
        for rank in sorted(expected - set(self.peers)):
            peer = self.peers[rank] = Peer(rank, None, time.monotonic())
            peer.phase = "starting (it never connected)"
            self._lose(peer, "stalled", self.timeout_s)

    # ---------------------------------------------------------------- main thread

    def lost(self) -> list[Loss]:
        with self._lock:
            return [p.loss for p in self.peers.values() if p.loss is not None]

    def alive(self) -> list[int]:
        """Generator ranks neither lost nor dropped."""
        with self._lock:
            return sorted(r for r, p in self.peers.items() if p.loss is None and r not in self.dropped)

    def check(self, ranks: Iterable[int] | None = None) -> None:
        """Raise :class:`PeerLost` for a lost generator not dropped yet (of ``ranks``; None: any), or for
        any lost one once the launcher sent SIGTERM."""
        with self._lock:
            wanted = None if ranks is None else set(ranks)
            for rank, peer in sorted(self.peers.items()):
                if peer.loss is not None and rank not in self.dropped and (wanted is None or rank in wanted):
                    raise PeerLost(peer.loss, self._line(peer.loss))
            if self.sigterm:
                loss = next(p.loss for p in self.peers.values() if p.loss is not None)
                raise PeerLost(loss, f"lockstep rl: stopping: the launcher ended the job (SIGTERM) after "
                                     f"{loss.describe(f'generator rank {loss.rank}', self.timeout_s)}")

    def wait(self, ranks: Iterable[int], done: Callable[[], bool], poll_s: float = 0.001) -> None:
        """Call ``done`` until it is true (``poll_s`` apart), raising :class:`PeerLost` as soon as one of
        ``ranks`` is lost."""
        ranks = list(ranks)
        while True:
            self.check(ranks)
            if done():
                return
            if poll_s:
                time.sleep(poll_s)

    def blame(self, rank: int, error: BaseException) -> None:
        """A transfer with ``rank`` failed: :class:`PeerLost` when liveness sees that rank lost within a
        moment (its connection closes with it), else ``error`` itself."""
        deadline = time.monotonic() + min(2.0, self.timeout_s)
        while time.monotonic() < deadline:
            self.check([rank])
            time.sleep(0.01)
        raise error

    def send_start(self, info: dict) -> None:
        """The generators' start: ``{"start", "last"}`` steps, or ``{"error": ...}`` (the trainer failed)."""
        with self._lock:
            for peer in self._watched():
                self._send(peer, {"start": info})

    def drop(self, rank: int, from_step: int) -> None:
        """Write off lost generator ``rank`` (continue mode): it is told so (should it come back), the
        others that its batches from ``from_step`` on are theirs now."""
        with self._lock:
            self.dropped.add(rank)
            peer = self.peers[rank]
            self._send(peer, {"drop": f"it was lost and the run goes on without it from step {from_step}"})
            for other in self._watched():
                self._send(other, {"lost": rank, "from_step": from_step})

    def stop_all(self, reason: str) -> None:
        """Tell every generator still connected that the run stops (they exit)."""
        with self._lock:
            self.stopping = True
            for peer in self._watched():
                self._send(peer, {"stop": reason})
        self.close()

    def finish(self) -> None:
        """The end of a normal run: the generators stop watching the trainer."""
        with self._lock:
            for peer in self._watched():
                self._send(peer, {"done": True})
        self.close()

    def close(self) -> None:
        super().close()
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    # ---------------------------------------------------------------- the thread

    def _message(self, peer: Peer, message: dict) -> None:
        pass  # generators send beats and done only

    def _line(self, loss: Loss) -> str:
        return f"lockstep rl: {loss.describe(f'generator rank {loss.rank}', self.timeout_s)}"

    def _on_lost(self, peer: Peer) -> None:
        if self.sigterm or self.stopping:
            return  # the job is being torn down: the other workers going is its consequence, not news
        left = [r for r, p in sorted(self.peers.items()) if p.loss is None and r not in self.dropped and not p.done]
        if self.continue_on_loss and left:
            action = (f"continuing with generator rank(s) {', '.join(map(str, left))} "
                      "(liveness.on_generator_loss=continue)")
        else:
            action = "stopping the run" + (" (no generator left)" if self.continue_on_loss else "")
        say(f"{self._line(peer.loss)}; {action}")

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """torchrun ends every worker when one dies: if a generator was lost, stop cleanly (the main
        thread raises PeerLost at its next check); otherwise what SIGTERM did before."""
        if not self._lost_event.is_set():
            self._lost_event.wait(1.0)  # a kill -9'd generator's connection closed a moment ago
        if self._lost_event.is_set():
            self.sigterm = True
            return
        previous = self._previous_sigterm
        if callable(previous):
            previous(signum, frame)
            return
        if previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


class GeneratorLiveness(Liveness):
    """A generator's end: one connection, to trainer rank 0."""

    def __init__(self, rank: int, timeout_s: float, address: tuple[str, int]) -> None:
        super().__init__(rank, timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection(address, timeout=max(0.01, deadline - time.monotonic()))
                break
            except OSError as err:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"liveness: generator rank {rank} cannot reach the trainer at "
                                       f"{address[0]}:{address[1]}: {err}") from None
                time.sleep(0.05)
        sock.sendall((json.dumps({"hello": rank, "pid": os.getpid(), "host": socket.gethostname()}) + "\n").encode())
        self.peers[0] = Peer(0, sock, time.monotonic())
        self._start: dict | None = None
        self._started = threading.Event()
        #: (generator rank, first step) of every generator the trainer announced lost, in order
        self.lost_generators: list[tuple[int, int]] = []
        self._thread.start()

    @property
    def changes(self) -> int:
        """Grows with every lost generator announced (its batches may be this one's now)."""
        with self._lock:
            return len(self.lost_generators)

    def wait_start(self) -> dict:
        """The trainer's start message (blocks; the thread ends the process if the trainer is lost)."""
        self._started.wait()
        return self._start

    def wait_end(self, seen: int) -> bool:
        """Wait for the trainer's end of the run (True), or until a generator is announced lost after
        ``seen`` (False: a batch may be this one's now)."""
        while not self.peers[0].done:
            if self.changes != seen:
                return False
            time.sleep(0.02)
        return True

    def finish(self) -> None:
        """This generator's work is done: it stops watching the trainer."""
        with self._lock:
            self._send(self.peers[0], {"done": True})
        self.close()

    def _message(self, peer: Peer, message: dict) -> None:
        if "start" in message:
            self._start = message["start"]
            self._started.set()
        elif "lost" in message:
            mark_lost()
            self.lost_generators.append((message["lost"], message["from_step"]))
        elif "drop" in message:
            self._exit(0, f"dropped by the trainer ({message['drop']})")
        elif "stop" in message:
            self._exit(0, f"the trainer stopped the run ({message['stop']})")
        elif message.get("done"):
            peer.done = True

    def _on_lost(self, peer: Peer) -> None:
        self._exit(1, peer.loss.describe("the trainer (rank 0)", self.timeout_s))

    def _exit(self, code: int, why: str) -> None:
        say(f"lockstep rl: generator rank {self.rank}: {why}; exiting")
        sys.stdout.flush()
        os._exit(code)


def connect_liveness(timeout_s: float, on_generator_loss: str, rank: int, ranks: list[int],
                     group: Any) -> Liveness:
    """The liveness channel between ``ranks[0]`` (the trainer) and the other ``ranks`` (generators):
    collective over ``group`` (those ranks). The trainer listens on loopback when every rank is on its
    host, else on every interface, and gives its host name and port to the generators."""
    host = socket.gethostname()
    hosts: list = [None] * len(ranks)
    dist.all_gather_object(hosts, host, group=group)
    listener, box = None, [None]
    if rank == ranks[0]:
        local = all(h == host for h in hosts)
        listener = socket.create_server(("127.0.0.1" if local else "", 0), backlog=len(ranks))
        box = [(host, listener.getsockname()[1])]
    dist.broadcast_object_list(box, src=ranks[0], group=group)
    if listener is not None:
        return TrainerLiveness(timeout_s, on_generator_loss, ranks[1:], listener)
    trainer_host, port = box[0]
    return GeneratorLiveness(rank, timeout_s, ("127.0.0.1" if trainer_host == host else trainer_host, port))
