"""A worker launched by `ouro serve --disagg` (or the lab) binds a free pair of ports itself
(`--port 0`) and tells its launcher which (`--port-file`): no other process can take a port
between the launcher's choice and the worker's bind, which once failed a suite run ("Address
already in use" for the encode worker's second port)."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest
import zmq

from ouro.disagg.command import spawn_workers
from ouro.disagg.worker import bind_sockets


def _taken(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def test_port_zero_binds_a_pair_and_writes_it(tmp_path):
    path = str(tmp_path / "port")
    inbox, outbox, port = bind_sockets("127.0.0.1", 0, path)
    try:
        assert port > 0 and _taken(port) and _taken(port + 1)
        assert open(path).read() == str(port) and not os.path.exists(path + ".part")
    finally:
        inbox.close(0), outbox.close(0)


def test_a_pair_whose_second_port_is_taken_is_given_up_for_another(monkeypatch):
    """The first port drawn has its neighbour held by another process: the worker lets it go and
    draws again, holding what it binds."""
    holder = socket.socket()
    while True:           # a port q with q free and q + 1 held here
        holder.bind(("127.0.0.1", 0))
        q = holder.getsockname()[1] - 1
        if q > 1024 and not _taken(q):
            break
        holder.close()
        holder = socket.socket()
    holder.listen()
    real, drawn = zmq.Socket.bind_to_random_port, []

    def first_q(self, addr, *a, **k):
        if not drawn:
            self.bind(f"{addr}:{q}")
            drawn.append(q)
            return q
        drawn.append(real(self, addr, *a, **k))
        return drawn[-1]
    monkeypatch.setattr(zmq.Socket, "bind_to_random_port", first_q)
    inbox, outbox, port = bind_sockets("127.0.0.1", 0)
    try:
        assert drawn[0] == q and port == drawn[-1] != q and len(drawn) >= 2
        assert _taken(port) and _taken(port + 1)
        deadline = time.monotonic() + 5      # zmq lets a port go on its I/O thread
        while _taken(q) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _taken(q)                 # the given-up port was let go
    finally:
        inbox.close(0), outbox.close(0), holder.close()


@pytest.mark.processes
def test_a_worker_that_dies_before_binding_is_named(tmp_path):
    argv = [sys.executable, "-m", "ouro.cli", "serve", "--role", "decode", "--model", str(tmp_path / "nothing-here")]
    started = []
    with pytest.raises(RuntimeError, match=r"the worker \(--role decode\) exited during start-up"):
        spawn_workers([argv], started, quiet=True)
    assert len(started) == 1 and started[0].poll() is not None
