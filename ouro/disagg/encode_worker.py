"""`ouro serve --role encode`: a worker that holds the checkpoint's image processor and vision
tower, nothing of the language model, and turns images into the rows that replace their tokens.

Same sockets as the other workers (PULL on `--port`, PUSH on `--port + 1`). Messages:

router -> encode: {"type": "encode", "rid", "job", "images": [base64 of the encoded image], "hashes": [each
                   image's `bytes_hash`], "to": a prefill worker's `EmbedsReceiver` address}
encode -> router: {"type": "encoded", "rid", "job", "hashes"}   every image's rows are sent to "to"
                  {"type": "error", "rid", "job", "status", "message"}   400: an image that does not read
                   or does not match its hash; 503: the prefill worker cannot be reached
either:           hello -> ready, shutdown -> bye, abort (a queued encode is dropped), stats
                   heartbeats, start_trace / stop_trace

Each image's rows travel as one transfer frame keyed by its hash (`encoder_cache`). Jobs run one
at a time in arrival order; every image of a job goes through the tower in one call.
"""

from __future__ import annotations

import collections
import logging
import os
import time

from ..measure import spans
from ..serve.engine_process import OutputSender, on_trace_message

log = logging.getLogger("ouro.disagg.encode")
HEARTBEAT_S = 0.25


class EncodeWorker:
    def __init__(self, model_dir: str, device: str = "cpu", timeout_s: float = 30.0):
        from ..config import ModelConfig
        from ..engine.multimodal import ImageEncoder
        self.encoder = ImageEncoder(model_dir, ModelConfig.from_hf(model_dir), device=device)
        self.timeout_s = timeout_s
        self.senders: dict = {}            # prefill receiver address -> its connection
        self.stats = {"images_encoded": 0, "encode_jobs": 0, "encode_seconds": 0.0, "embeds_bytes_sent": 0}

    def encode(self, msg: dict) -> dict:
        """One job: the images' rows sent to `msg["to"]`; the answer for the router."""
        from ..engine.multimodal import as_images, bytes_hash
        from ..serve.messages import images_from_wire
        rid, hashes, job = msg["rid"], list(msg["hashes"]), msg.get("job")
        t0 = time.perf_counter()
        try:
            raws = images_from_wire(msg["images"])
            if len(raws) != len(hashes) or any(bytes_hash(r) != h for r, h in zip(raws, hashes)):
                raise ValueError("the images do not match their hashes")
            unique = dict(zip(hashes, raws))
            with spans.span("encode images", cat="step"):
                rows, _ = self.encoder.encode_images(as_images(list(unique.values())))
        except (ValueError, OSError, TypeError) as e:
            return {"type": "error", "rid": rid, "job": job, "status": 400,
                    "message": f"an image could not be encoded: {e}"}
        try:
            for h, r in zip(unique, rows):
                self._send(msg["to"], {"type": "embeds", "hash": h, "shape": list(r.shape), "dtype": "float32"},
                           r.contiguous())
        except OSError as e:
            return {"type": "error", "rid": rid, "job": job, "status": 503,
                    "message": f"the image rows could not reach the prefill worker {msg['to']}: {e}"}
        self.stats["images_encoded"] += len(unique)
        self.stats["encode_jobs"] += 1
        self.stats["encode_seconds"] += time.perf_counter() - t0
        return {"type": "encoded", "rid": rid, "job": job, "hashes": list(unique)}

    def _send(self, address: str, header: dict, rows) -> None:
        """Over the kept connection to `address`; a broken one is replaced once."""
        from .transfer import Sender, TransferError
        for attempt in (0, 1):
            s = self.senders.get(address)
            try:
                if s is None:
                    s = self.senders[address] = Sender(address, "tcp", self.timeout_s)
                self.stats["embeds_bytes_sent"] += s.send_inline(header, [rows])
                return
            except (OSError, TransferError) as e:
                self.senders.pop(address, None)
                if s is not None:
                    s.close()
                if attempt:
                    raise OSError(str(e)) from None

    def close(self) -> None:
        for s in self.senders.values():
            s.close()


def run_encoder(model_dir: str, host: str, port: int, device: str = "cpu", timeout_s: float = 30.0,
                exit_with_parent: bool = False, port_file: str | None = None) -> None:
    import torch

    from ..serve.messages import decode, encode, output_to_wire
    from .worker import bind_sockets
    trace_path = spans.start_from_env(".encode.json", process_name="ouro encode")
    torch.set_num_threads(int(os.environ.get("OURO_NUM_THREADS", torch.get_num_threads())))
    inbox, outbox, port = bind_sockets(host, port, port_file)
    worker = EncodeWorker(model_dir, device, timeout_s)
    info = {"type": "ready", "role": "encode", "pid": os.getpid(), "plan": "vision tower only",
            "max_model_len": 0, "max_tokens": 0, "max_num_seqs": 0}
    print(f"ouro: encode worker on tcp://{host}:{port} (+1 out)", flush=True)
    sender = OutputSender(outbox, encode, output_to_wire)
    sender.send(info)
    jobs: collections.deque = collections.deque()
    last_beat, parent = 0.0, os.getppid()
    try:
        while True:
            if inbox.poll(0 if jobs else 20):
                while inbox.poll(0):
                    msg = decode(inbox.recv())
                    kind = msg.get("type")
                    if kind == "hello":
                        sender.send(info)
                    elif kind == "encode":
                        jobs.append(msg)
                    elif kind == "abort":
                        jobs = collections.deque(j for j in jobs if j["rid"] != msg.get("rid"))
                    elif kind == "shutdown":
                        sender.send({"type": "bye"})
                        return
                    elif kind in ("start_trace", "stop_trace"):
                        on_trace_message(msg, sender)
                    else:
                        sender.send({"type": "error", "rid": msg.get("rid"), "status": 400,
                                     "message": f"an encode worker does not take {kind!r}"})
            if jobs:
                sender.send(worker.encode(jobs.popleft()))
            now = time.monotonic()
            if now - last_beat >= HEARTBEAT_S:
                if exit_with_parent and os.getppid() != parent:
                    return
                sender.send({"type": "stats", "role": "encode", "stats": dict(worker.stats), "time": time.time()})
                last_beat = now
    finally:
        sender.close()
        worker.close()
        if trace_path:
            spans.save_once(trace_path, "ouro encode")
