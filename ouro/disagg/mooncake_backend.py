"""The `mooncake` transfer backend: the prefill worker writes a request's blocks straight into the
decode worker's registered cache memory with Mooncake's TransferEngine (TCP here; RDMA where the
machines have it), then tells the decode worker over the control connection, as `shm` does.

Optional: it needs the `mooncake-transfer-engine` package (and its libibverbs); without it this
backend refuses to start with a message saying what to install. Mooncake's synchronous writes
release the GIL while they wait (measured: a Python thread kept its pace during a write).

- Decode side: `MooncakeTarget(cache)` starts an engine (peer-to-peer handshake, no metadata
  server), registers each cache tensor's memory and describes it (`spec`: the engine's address,
  each tensor's base address, shape and dtype) for the room info.
- Prefill side: `MooncakeWriter(spec)` starts its own engine with a registered staging buffer. It
  keeps a shadow of the remote cache on the `meta` device (shapes, no memory), so the same
  `state_pieces.page_segments` that names local views names the remote segments: a segment's
  remote address is its tensor's base address plus its storage offset.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

TENSORS = ("latent", "index_keys", "index_gates", "index_pooled", "conv", "recurrent")
STAGING_BYTES = 64 << 20


def _engine(host: str):
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise ValueError("the mooncake transfer backend needs `pip install mooncake-transfer-engine-non-cuda` "
                         f"(or the CUDA build) and libibverbs ({e})") from None
    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake's TransferEngine did not initialise")
    return engine


class MooncakeTarget:
    """The decode worker's cache, registered for remote writes."""

    def __init__(self, cache, host: str = "127.0.0.1"):
        self.engine = _engine(host)
        tensors = {}
        for name in TENSORS:
            t = getattr(cache, name)
            if self.engine.register_memory(t.data_ptr(), t.numel() * t.element_size()) != 0:
                raise RuntimeError(f"Mooncake could not register the cache tensor {name}")
            tensors[name] = {"base": t.data_ptr(), "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        self.spec = {"target": f"{host}:{self.engine.get_rpc_port()}", "page_size": cache.page_size, "tensors": tensors}


class MooncakeWriter:
    """The prefill side's writer into one decode worker's registered cache."""

    def __init__(self, spec: dict, host: str = "127.0.0.1"):
        self.engine, self.target = _engine(host), spec["target"]
        self.staging = torch.empty(STAGING_BYTES, dtype=torch.uint8)
        if self.engine.register_memory(self.staging.data_ptr(), STAGING_BYTES) != 0:
            raise RuntimeError("Mooncake could not register the staging buffer")
        self.shadow = SimpleNamespace(page_size=spec["page_size"])
        self.bases = {}
        for name, t in spec["tensors"].items():
            meta = torch.empty(t["shape"], dtype=getattr(torch, t["dtype"]), device="meta")
            setattr(self.shadow, name, meta)
            self.bases[id(meta)] = t["base"]

    def _address(self, view: torch.Tensor) -> int:
        base = view._base if view._base is not None else view
        return self.bases[id(base)] + view.storage_offset() * view.element_size()

    def write(self, blocks: list[torch.Tensor], views: list[list[torch.Tensor]]) -> int:
        """Copy the blocks into the staging buffer and write each remote segment; returns bytes."""
        src, dst, lengths = [], [], []
        at = 0
        for block, segs in zip(blocks, views):
            raw = block.contiguous().reshape(-1).view(torch.uint8)
            if at + raw.numel() > STAGING_BYTES:
                self._flush(src, dst, lengths)
                src, dst, lengths, at = [], [], [], 0
            if raw.numel() > STAGING_BYTES:
                raise ValueError(f"a {raw.numel()}-byte block does not fit Mooncake's {STAGING_BYTES}-byte staging buffer")
            self.staging[at:at + raw.numel()].copy_(raw)
            offset = at
            for v in segs:
                n = v.numel() * v.element_size()
                src.append(self.staging.data_ptr() + offset)
                dst.append(self._address(v))
                lengths.append(n)
                offset += n
            at += raw.numel()
        self._flush(src, dst, lengths)
        return sum(b.numel() * b.element_size() for b in blocks)

    def _flush(self, src, dst, lengths) -> None:
        if src and self.engine.batch_transfer_sync_write(self.target, src, dst, lengths) != 0:
            raise OSError(f"Mooncake could not write {len(src)} segments to {self.target}")
