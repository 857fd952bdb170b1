"""The router's side of image requests under `--disagg XE...`: which images a request holds, which
encode jobs are out, and which image rows each prefill worker is believed to hold.

An image request is encoded before anything is reserved for it: an encode worker sends each
image's rows to the chosen prefill worker (keyed by `bytes_hash`) and answers `encoded`; only then
does the router reserve a decode room and hand the request to the prefill worker. Images that
prefill worker was sent recently are not encoded again (its encoder cache should hold them);
when it does not, it answers `need_images` and they are encoded again from the bytes the router
still holds (until the request's first token comes back). An encode worker that dies hands its
jobs to another one; with none up, those requests fail with 503. Nothing here fails a worker.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from dataclasses import dataclass

from ..serve.messages import images_to_wire

ENCODER_CACHE_STATS = ("image_waits", "encoder_cache_hits", "encoder_cache_misses", "encoder_cache_bytes")
ENCODE_STATS = ("images_encoded", "encode_jobs", "encode_seconds", "embeds_bytes_sent")
KNOWN_PER_PREFILL = 4096       # hashes remembered as sent to one prefill worker


@dataclass
class Held:
    prefill: object            # the WorkerLink the rows go to
    raws: list[bytes]
    hashes: list[str]


@dataclass
class Job:
    rid: str
    link: object               # the encode worker's WorkerLink
    msg: dict
    future: asyncio.Future


class ImageRoutes:
    def __init__(self):
        self.held: dict[str, Held] = {}
        self.jobs: dict[int, Job] = {}
        self.sent: dict[str, OrderedDict] = {}          # prefill address -> hashes sent there
        self._ids = itertools.count()

    def hold(self, rid: str, prefill, raws: list[bytes], hashes: list[str]) -> None:
        self.held[rid] = Held(prefill, list(raws), list(hashes))

    def drop(self, rid: str) -> None:
        self.held.pop(rid, None)

    def unsent(self, prefill, hashes: list[str]) -> list[int]:
        """Indices of the distinct images not sent to `prefill` lately."""
        known = self.sent.get(prefill.address, {})
        first = {h: i for i, h in reversed(list(enumerate(hashes)))}
        return sorted(i for h, i in first.items() if h not in known)

    def indices(self, rid: str, hashes: list[str]) -> list[int] | None:
        held = self.held.get(rid)
        if held is None:
            return None
        return sorted({held.hashes.index(h) for h in hashes if h in held.hashes})

    def forget(self, prefill, hashes: list[str]) -> None:
        known = self.sent.get(prefill.address)
        for h in hashes:
            if known is not None:
                known.pop(h, None)

    async def encode(self, rid: str, todo: list[int], pick, timeout_s: float) -> dict:
        """Send images `todo` of `rid` to an encode worker (`pick()`: a living one, or None) and
        wait for its answer: {"hashes"} once the rows are out, or {"error", "status"}."""
        held, link = self.held.get(rid), pick()
        if held is None:
            return {"error": "the request was aborted", "status": 499}
        if link is None:
            return {"error": "no encode worker is up to encode this request's images", "status": 503}
        job_id = next(self._ids)
        msg = {"type": "encode", "rid": rid, "job": job_id, "images": images_to_wire([held.raws[i] for i in todo]),
               "hashes": [held.hashes[i] for i in todo], "to": held.prefill.info["embeds"]}
        job = self.jobs[job_id] = Job(rid, link, msg, asyncio.get_running_loop().create_future())
        try:
            await link.send(msg)
            answer = await asyncio.wait_for(job.future, timeout_s)
        except asyncio.TimeoutError:
            answer = {"error": f"the encode worker {job.link.address} did not answer within {timeout_s:.0f} s",
                      "status": 503}
        finally:
            self.jobs.pop(job_id, None)
        if "error" not in answer:
            known = self.sent.setdefault(held.prefill.address, OrderedDict())
            for h in answer["hashes"]:
                known[h] = None
                known.move_to_end(h)
            while len(known) > KNOWN_PER_PREFILL:
                known.popitem(last=False)
        return answer

    def _settle(self, job_id, answer: dict) -> bool:
        job = self.jobs.get(job_id)
        if job is None or job.future.done():
            return False
        job.future.set_result(answer)
        return True

    def encoded(self, link, msg: dict) -> None:
        self._settle(msg.get("job"), {"hashes": msg.get("hashes", [])})

    def encode_failed(self, link, rid: str, msg: dict) -> bool:
        """An encode worker's error for one of the jobs out: that job's answer (True)."""
        return self._settle(msg.get("job"), {"error": msg["message"], "status": msg.get("status", 500)})

    async def abort(self, rid: str) -> None:
        self.drop(rid)
        for job_id, job in list(self.jobs.items()):
            if job.rid == rid:
                if job.link.dead is None:
                    await job.link.send({"type": "abort", "rid": rid})
                self._settle(job_id, {"error": "the request was aborted", "status": 499})

    async def lost(self, link, pick) -> None:
        """`link` died: its jobs go to another living encode worker, or fail."""
        for job_id, job in list(self.jobs.items()):
            if job.link is not link:
                continue
            other = pick()
            if other is None:
                self._settle(job_id, {"error": f"{link.dead}, and no other encode worker is up", "status": 503})
            else:
                job.link = other
                await other.send(job.msg)
