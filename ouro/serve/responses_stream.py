"""`/v1/responses` streamed: the chat path's SSE chunks become the Responses API's events
(`response.created`, `...output_item.added`, `...output_text.delta`, `...reasoning_text.delta`,
`...function_call_arguments.delta`, `...done`, `response.completed`), each with its sequence number;
the items are `responses._item`'s shapes, numbered as they open."""

from __future__ import annotations

import json
import time
import uuid

from .responses import _PREFIX, ResponsesRequest, _envelope, _finish, _item, _part, _usage

_DELTA = {"reasoning": "response.reasoning_text.delta", "message": "response.output_text.delta"}
_DONE = {"reasoning": "response.reasoning_text.done", "message": "response.output_text.done"}


class EventStream:
    """Chat chunks in, Responses events out (`feed` per chunk, `close` at the end). Items are numbered
    in the order they open (reasoning, then the message, then each call, as the model writes them),
    and the final response's `output` is the same items at the same indices: an item the stream
    never opened (the empty message of a reply with nothing else) opens and closes at the end."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.body, self.seq = body, 0
        self.rid = "resp_" + uuid.uuid4().hex
        self.resp = _envelope(body, self.rid, int(time.time()), model)
        self.items: list[dict] = []     # opened items in output order: {"kind", "id", "text" / call fields}
        self.open: dict = {}            # "reasoning" / "message" / ("call", k) -> its entry in items
        self.finish, self.usage = None, None

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _opened(self, key, entry: dict, out: list) -> dict:
        """The item under `key`, opened now (its output index the next one) when it is new."""
        if key not in self.open:
            entry["index"] = len(self.items)
            self.items.append(entry)
            self.open[key] = entry
            out.append(self._event("response.output_item.added", output_index=entry["index"],
                                   item=_item(entry, "in_progress")))
            if entry["kind"] != "function_call":
                out.append(self._event("response.content_part.added", item_id=entry["id"],
                                       output_index=entry["index"], content_index=0, part=_part(entry, "")))
        return self.open[key]

    def start(self) -> list[dict]:
        return [self._event("response.created", response=dict(self.resp)),
                self._event("response.in_progress", response=dict(self.resp))]

    def feed(self, chunk: dict) -> list[dict]:
        out, rid = [], self.rid[5:]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for ch in chunk.get("choices") or []:
            d = ch.get("delta") or {}
            for kind, field in (("reasoning", "reasoning_content"), ("message", "content")):
                if d.get(field):
                    e = self._opened(kind, {"kind": kind, "id": f"{_PREFIX[kind]}{rid}", "text": ""}, out)
                    e["text"] += d[field]
                    out.append(self._event(_DELTA[kind], item_id=e["id"], output_index=e["index"], content_index=0,
                                           delta=d[field]))
            for tc in d.get("tool_calls") or []:
                k, fn = tc.get("index", 0), tc.get("function") or {}
                call = self.open.get(("call", k)) or {"kind": "function_call", "id": None, "name": None,
                                                      "arguments": ""}
                if tc.get("id"):
                    call["id"] = tc["id"]
                if fn.get("name"):
                    call["name"] = fn["name"]
                    call = self._opened(("call", k), call, out)
                if fn.get("arguments"):
                    call["arguments"] += fn["arguments"]
                    if ("call", k) in self.open:
                        out.append(self._event("response.function_call_arguments.delta", item_id=f"fc_{call['id']}",
                                               output_index=call["index"], delta=fn["arguments"]))
            if ch.get("finish_reason"):
                self.finish = ch["finish_reason"]
        return out

    def close(self) -> list[dict]:
        out = []
        if not any(e["kind"] in ("message", "function_call") for e in self.items):    # as `_items` answers it
            self._opened("message", {"kind": "message", "id": f"msg_{self.rid[5:]}", "text": ""}, out)
        for e in self.items:
            if e["kind"] == "function_call":
                out.append(self._event("response.function_call_arguments.done", item_id=f"fc_{e['id']}",
                                       output_index=e["index"], arguments=e["arguments"]))
            else:
                out.append(self._event(_DONE[e["kind"]], item_id=e["id"], output_index=e["index"], content_index=0,
                                       text=e["text"]))
                out.append(self._event("response.content_part.done", item_id=e["id"], output_index=e["index"],
                                       content_index=0, part=_part(e, e["text"])))
            out.append(self._event("response.output_item.done", output_index=e["index"], item=_item(e, "completed")))
        resp = dict(self.resp, output=[_item(e, "completed") for e in self.items], usage=_usage(self.usage))
        _finish(resp, self.finish)
        kind = "response.completed" if resp["status"] == "completed" else "response.incomplete"
        out.append(self._event(kind, response=resp))
        return out


async def sse_events(body: ResponsesRequest, chat_stream, model: str):
    """The chat path's SSE stream (`chat_stream`, an async iterator of `data: ...` strings) as
    Responses events; closing this closes it (the request's engine work is aborted there)."""
    events = EventStream(body, model)
    try:
        for e in events.start():
            yield _sse(e)
        async for raw in chat_stream:
            for line in raw.splitlines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("object") == "error":
                    yield _sse(events._event("error", code=str(chunk.get("code")), message=chunk.get("message"),
                                             param=None))
                    return
                for e in events.feed(chunk):
                    yield _sse(e)
        for e in events.close():
            yield _sse(e)
    finally:
        await chat_stream.aclose()


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
