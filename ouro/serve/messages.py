"""The wire protocol between a frontend and an engine process: JSON objects over ZeroMQ.

JSON (not pickle) so the same messages can later travel over TCP to remote prefill/decode
workers written in anything, and so a peer can never make the other execute code.

frontend -> engine (PUSH/PULL):
  {"type": "add", "rid", "prompt_token_ids": [int], "params": {SamplingParams fields},
   "images": [base64 of encoded image bytes] (optional: the prompt's images, in order)}
  {"type": "abort", "rid"}
  {"type": "shutdown"}
  {"type": "start_trace", "heartbeat": bool}   (clear and record spans; heartbeat thread optional)
  {"type": "stop_trace"}                       (stop recording; the engine answers with "trace")
engine -> frontend (PUSH/PULL):
  {"type": "ready", "pid", "plan": str, "max_model_len", "max_tokens", "max_num_seqs"}
  {"type": "outputs", "items": [{"rid", "new_token_ids", "finished", "finish_reason",
                                 "stop_reason", "cached_tokens", "queue_time",
                                 "logprobs": [float], "top_logprobs": [[[id, lp], ...] | null],
                                 "prompt_logprobs": [null, [[id, lp], ...], ...], "prompt_ranks": [null, int, ...]
                                 (the last two with params.prompt_logprobs, in a request's first output only)}]}
  {"type": "error", "rid", "message", "status"}   (a request the engine refused or dropped)
  {"type": "stats", "stats": {...LLMEngine.stats()}, "time"}   (heartbeat, a few per second)
  {"type": "trace", "events": [Chrome trace events]}          (the answer to stop_trace)
"""

from __future__ import annotations

import base64
import dataclasses
import json

from ..engine.sampling import SamplingParams

# what the engine needs of a request's sampling parameters; stop strings stay in the frontend,
# which detokenises and aborts the request when one matches
ENGINE_PARAM_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop_token_ids",
                       "ignore_eos", "logprobs", "prompt_logprobs", "forced_prefix_ids", "structured")


def encode(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def decode(raw: bytes) -> dict:
    return json.loads(raw)


def images_to_wire(images: list[bytes]) -> list[str]:
    return [base64.b64encode(raw).decode() for raw in images]


def images_from_wire(items: list[str]) -> list[bytes]:
    return [base64.b64decode(s) for s in items]


def prompt_from_wire(msg: dict) -> dict:
    """The engine's prompt of an "add" message: token ids, and the images when there are any."""
    prompt = {"prompt_token_ids": msg["prompt_token_ids"]}
    if msg.get("images"):
        prompt["multi_modal_data"] = {"image": images_from_wire(msg["images"])}
    return prompt


def params_to_wire(p: SamplingParams) -> dict:
    return {k: getattr(p, k) for k in ENGINE_PARAM_FIELDS}


def params_from_wire(d: dict) -> SamplingParams:
    return SamplingParams(**{k: d[k] for k in ENGINE_PARAM_FIELDS if k in d})


def output_to_wire(out) -> dict:
    msg = {"rid": out.request_id, "new_token_ids": list(out.new_token_ids), "finished": out.finished,
           "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
           "cached_tokens": out.cached_tokens, "queue_time": out.queue_time,
           "logprobs": out.logprobs[-len(out.new_token_ids):] if out.new_token_ids else [],
           "top_logprobs": out.top_logprobs[-len(out.new_token_ids):] if out.new_token_ids else []}
    # the prompt's logprobs are complete at the first output (prefill done), and sent only then
    if out.prompt_logprobs is not None and len(out.token_ids) == len(out.new_token_ids):
        msg["prompt_logprobs"] = [None if e is None else [[t, lp] for t, lp in e.items()] for e in out.prompt_logprobs]
        msg["prompt_ranks"] = list(out.prompt_ranks or [None] * len(out.prompt_logprobs))
    return msg


assert set(ENGINE_PARAM_FIELDS) <= {f.name for f in dataclasses.fields(SamplingParams)}
