"""Transfer engines: how a prefill worker's blocks reach a decode worker's pages.

One interface, `connect(backend, address, ...) -> Sender` on the prefill side and a `Receiver` on
the decode side. Every message is a frame: a JSON header (what it is: which request, which layer,
which tokens, the byte size of each block) followed by the blocks' raw bytes.

- `tcp`: the blocks travel over a TCP socket; the receiver reads them straight into the views
  its `resolve` callback names (its own pages and slot), never into a staging buffer.
- `shm`: same host. The decode worker's cache tensors live in files under /dev/shm
  (`shared_cache.share`); the sender maps them and copies the blocks into the reserved pages
  itself, then sends the header alone over TCP, so the receiver learns the rows are there.
- `mooncake`: as `shm`, but the sender writes into the decode worker's registered memory with
  Mooncake's TransferEngine (`mooncake_backend.py`, optional package), across hosts.

Every blocking wait (connect, send, receive, accept) is a socket call, which releases the GIL.
"""

from __future__ import annotations

import json
import socket
import struct
import threading

import torch

from ..measure.spans import span

MAGIC = b"OURO"
_HEAD = struct.Struct("!4sI")
BACKENDS = ("tcp", "shm", "mooncake")


class TransferError(RuntimeError):
    """A frame that breaks the protocol, or a peer that went away mid-frame."""


def as_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's memory as a writable byte view (any dtype, bf16 included)."""
    if not t.is_contiguous():
        raise TransferError("transfer views must be contiguous")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def recv_exact(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            raise TransferError("the peer closed the connection mid-frame")
        got += n


def read_header(sock: socket.socket) -> dict | None:
    """The next frame's header, or None when the peer closed the connection between frames."""
    head = bytearray(_HEAD.size)
    first = sock.recv_into(head)
    if first == 0:
        return None
    if first < len(head):
        recv_exact(sock, memoryview(head)[first:])
    magic, n = _HEAD.unpack(head)
    if magic != MAGIC:
        raise TransferError(f"not an ouro transfer frame (magic {bytes(magic)!r})")
    body = bytearray(n)
    recv_exact(sock, memoryview(body))
    return json.loads(body)


def write_frame(sock: socket.socket, header: dict, blocks=()) -> int:
    """Send one frame; returns the payload bytes sent."""
    header = dict(header, sizes=[b.numel() * b.element_size() for b in blocks])
    body = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_HEAD.pack(MAGIC, len(body)) + body)
    for b in blocks:
        sock.sendall(as_bytes(b.contiguous()))
    return sum(header["sizes"])


class Sender:
    """The prefill side's connection to one decode worker. `put` delivers one layer's blocks into
    the room's reserved pages (see `state_pieces`); `notify` sends a header-only frame. One thread
    sends (the transfer thread); `listen(callback)` reads the decode side's control frames (`go`,
    `no`, `abort`) on a thread of its own, and calls back with {"type": "closed"} when the
    connection ends."""

    def __init__(self, address: str, backend: str = "tcp", timeout_s: float = 30.0, writer=None):
        """writer: for `mooncake`, the `MooncakeWriter` into the decode worker's memory."""
        if backend not in BACKENDS:
            raise ValueError(f"transfer backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.backend, self.writer = backend, writer
        self.bytes_sent = 0

    def put(self, header: dict, blocks: list[torch.Tensor], views: list[list[torch.Tensor]] | None = None) -> None:
        """header names the room, layer and tokens; `views` (shm, mooncake) are the destination
        views in the decode worker's cache (mapped, or its shadow), block by block."""
        with span("kv send", cat="transfer"):
            if self.backend != "tcp" and (views is None or len(views) != len(blocks)):
                raise ValueError(f"the {self.backend} backend writes into the decode worker's pages: pass their views")
            if self.backend == "mooncake":
                self.writer.write(blocks, views)
                self.bytes_sent += write_frame(self.sock, dict(header, written=True))
            elif self.backend == "shm":
                for block, dest in zip(blocks, views):
                    i = 0
                    for v in dest:           # page segments front to back (a state: one view, whole)
                        v.copy_(block[i:i + v.shape[0]])
                        i += v.shape[0]
                self.bytes_sent += write_frame(self.sock, dict(header, written=True))
            else:
                self.bytes_sent += write_frame(self.sock, header, blocks)

    def notify(self, header: dict) -> None:
        write_frame(self.sock, header)

    def send_inline(self, header: dict, blocks: list[torch.Tensor]) -> int:
        """A frame whose blocks travel over the connection whatever the backend (image rows, which
        live outside the shared cache); returns the bytes sent."""
        n = write_frame(self.sock, header, blocks)
        self.bytes_sent += n
        return n

    def listen(self, callback) -> None:
        def loop():
            try:
                while (header := read_header(self.sock)) is not None:
                    callback(header)
            except (OSError, TransferError, ValueError):
                pass
            callback({"type": "closed"})
        threading.Thread(target=loop, name="ouro-kv-control", daemon=True).start()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class Peer:
    """The decode side's end of one prefill connection: its identity for the room table, and the
    way back (`send_control`), safe to call from any thread."""

    def __init__(self, conn: socket.socket, name: str):
        self.conn, self.name = conn, name
        self._lock = threading.Lock()

    def send_control(self, header: dict) -> None:
        with self._lock:
            write_frame(self.conn, header)

    def __repr__(self):
        return f"Peer({self.name})"


class Receiver:
    """The decode side: accepts prefill workers' connections on `address` (port 0: any free one)
    and handles each frame on that connection's thread:
    `resolve(header, peer) -> [[view, ...] per block] | None` names where the blocks go (None: read
    and drop them, e.g. a room already closed); then `on_frame(header, peer)`. A frame that does not
    fit its views, or a connection that breaks, is reported to `on_error(peer, message)`; every
    connection's end, to `on_closed(peer)` (after it, nothing more arrives from that peer)."""

    def __init__(self, resolve, on_frame, on_error=None, on_closed=None, address: str = "127.0.0.1:0"):
        self.resolve, self.on_frame = resolve, on_frame
        self.on_error = on_error or (lambda peer, msg: None)
        self.on_closed = on_closed or (lambda peer: None)
        host, port = address.rsplit(":", 1)
        self.server = socket.create_server((host, int(port)))
        self.address = "{}:{}".format(*self.server.getsockname()[:2])
        self.bytes_received = 0
        self._closed = False
        self._conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, name="ouro-kv-receiver", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self.server.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(Peer(conn, f"{peer[0]}:{peer[1]}"),), name="ouro-kv-recv-conn",
                             daemon=True).start()

    def _serve(self, peer: Peer) -> None:
        try:
            while (header := read_header(peer.conn)) is not None:
                with span("kv recv", cat="transfer"):
                    self._read_blocks(peer, header)
                self.on_frame(header, peer)
        except (OSError, TransferError, ValueError) as e:
            if not self._closed:
                self.on_error(peer, f"{type(e).__name__}: {e}")
        finally:
            peer.conn.close()
            self.on_closed(peer)

    def _read_blocks(self, peer: Peer, header) -> None:
        conn = peer.conn
        sizes = header.get("sizes", [])
        dest = self.resolve(header, peer) if sizes else None
        if dest is not None and len(dest) != len(sizes):
            raise TransferError(f"frame has {len(sizes)} blocks, the room expects {len(dest)}")
        for k, size in enumerate(sizes):
            if dest is None:
                recv_exact(conn, memoryview(bytearray(size)))
                continue
            want = sum(v.numel() * v.element_size() for v in dest[k])
            if want != size:
                raise TransferError(f"block {k} is {size} bytes, its destination {want}")
            for v in dest[k]:
                recv_exact(conn, as_bytes(v))
        self.bytes_received += sum(sizes)

    def close(self) -> None:
        self._closed = True
        for s in [self.server, *self._conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
