"""Online load for `ouro bench serve`: random token-id prompts, Poisson arrivals, at most C
requests in flight, each streamed from an OpenAI `/v1/completions` endpoint with a timestamp on
every chunk (the vLLM / SGLang `bench_serving` client, over httpx)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np

# Without a model to read the vocabulary from, prompt ids come from here: past the special
# tokens and inside every ouro preset's vocabulary (tiny has 512 ids).
FALLBACK_VOCAB_RANGE = (300, 500)


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds."""
    index: int
    prompt_len: int              # tokens sent
    max_tokens: int              # tokens asked for
    start: float = 0.0           # when it was sent, from the start of the timed run
    success: bool = False
    prompt_tokens: int = 0       # from the usage chunk
    output_tokens: int = 0       # from the usage chunk (chunk count only when the server sent none)
    usage_reported: bool = False
    ttft: float = 0.0            # send -> first chunk carrying tokens
    e2e: float = 0.0             # send -> end of the stream
    itl: list[float] = field(default_factory=list)   # gaps between chunks carrying tokens
    chunks: int = 0              # chunks carrying tokens
    error: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def make_prompts(n: int, length: int, vocab_range: tuple[int, int], seed: int) -> list[list[int]]:
    lo, hi = vocab_range
    if not 0 <= lo < hi:
        raise ValueError(f"--vocab-range must be 0 <= LO < HI, got {lo},{hi}")
    if n < 1 or length < 1:
        raise ValueError(f"--num-prompts and --random-input-len must be >= 1, got {n} and {length}")
    return np.random.default_rng(seed).integers(lo, hi, size=(n, length)).tolist()


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times from the start of the run: a Poisson process at `rate` requests/s (the first
    request at 0, exponential gaps after it), or all at 0 when the rate is infinite."""
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng([seed, 1]).exponential(1.0 / rate, size=n)
    return [0.0] + np.cumsum(gaps[:-1]).tolist()


def carries_tokens(choice: dict) -> bool:
    """A completion chunk carries tokens when it has text, or is not the closing chunk: ouro
    (like vLLM) sends a chunk per engine output even when the detokenizer holds the text back,
    and closes with an empty chunk that only names the finish reason. A chat chunk that only
    names the role carries none."""
    if "delta" in choice:
        delta = choice["delta"] or {}
        return bool(delta.get("content")) or (choice.get("finish_reason") is None and "role" not in delta)
    return bool(choice.get("text")) or choice.get("finish_reason") is None


def make_image_prompts(n: int, input_len: int, vocab_range: tuple[int, int], seed: int, size: tuple[int, int],
                       per_request: int = 1) -> list[dict]:
    """Chat prompts for `/v1/chat/completions`: about `input_len` words of text and `per_request`
    random PNG images of `size` (height, width), every image new (no encoder cache holds it)."""
    import base64
    import io

    from PIL import Image
    rng = np.random.default_rng([seed, 2])
    out = []
    for ids in make_prompts(n, input_len, vocab_range, seed):
        parts = [{"type": "text", "text": " ".join(f"w{t}" for t in ids)}]
        for _ in range(per_request):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(buf, format="PNG")
            parts.append({"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                             + base64.b64encode(buf.getvalue()).decode()}})
        out.append({"messages": [{"role": "user", "content": parts}], "prompt_len": len(ids)})
    return out


def workload_prompts(args, vocab_range: tuple[int, int]) -> tuple[list, str]:
    """(`ouro bench serve`'s prompts, the endpoint they go to): token ids, or chat with images
    when --image-size is set."""
    if not getattr(args, "image_size", None):
        return make_prompts(args.num_prompts, args.input_len, vocab_range, args.seed), args.endpoint
    try:
        h, w = (int(x) for x in args.image_size.lower().split("x"))
    except ValueError:
        raise ValueError(f"--image-size takes HxW, e.g. 224x224, got {args.image_size!r}") from None
    prompts = make_image_prompts(args.num_prompts, args.input_len, vocab_range, args.seed, (h, w),
                                 args.images_per_request)
    endpoint = args.endpoint if args.endpoint != "/v1/completions" else "/v1/chat/completions"
    return prompts, endpoint


def prompt_len(prompt) -> int:
    return prompt["prompt_len"] if isinstance(prompt, dict) else len(prompt)


def payload(model: str | None, prompt, max_tokens: int) -> dict:
    """A streamed request: completions for token ids, chat for a `make_image_prompts` prompt."""
    body = {"messages": prompt["messages"]} if isinstance(prompt, dict) else {"prompt": prompt}
    body.update({"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
                 "stream_options": {"include_usage": True}})
    if model:
        body["model"] = model
    return body


async def send(client, url: str, headers: dict, body: dict, rec: RequestRecord, t0: float) -> RequestRecord:
    st = time.perf_counter()
    rec.start = st - t0
    last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if obj.get("object") == "error":
                    rec.error = f"stream error: {obj.get('message')}"
                    return rec
                choices = obj.get("choices") or []
                if choices and carries_tokens(choices[0]):
                    if last is None:
                        rec.ttft = now - st
                    else:
                        rec.itl.append(now - last)
                    last = now
                    rec.chunks += 1
                if obj.get("usage"):
                    rec.usage_reported = True
                    rec.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                    rec.output_tokens = obj["usage"].get("completion_tokens", 0)
        rec.e2e = time.perf_counter() - st
    except Exception as e:   # a failed request is counted and reported, never fatal to the run
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    if last is None:
        rec.error = "the stream carried no tokens"
        return rec
    if not rec.usage_reported:
        rec.prompt_tokens, rec.output_tokens = rec.prompt_len, rec.chunks
    rec.success = True
    return rec


async def run_load(base_url: str, endpoint: str, model: str | None, prompts: list, max_tokens: int,
                   rate: float, max_concurrency: int | None, seed: int, api_key: str | None = None,
                   progress: bool = True) -> tuple[list[RequestRecord], float]:
    """(records in prompt order, duration of the timed run in seconds). One untimed request
    first checks the endpoint (and warms the server), as vLLM's benchmark does."""
    import httpx
    from tqdm import tqdm
    url = base_url.rstrip("/") + endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    width = min(len(prompts), max_concurrency or len(prompts))
    limits = httpx.Limits(max_connections=width + 1, max_keepalive_connections=width + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        test = await send(client, url, headers, payload(model, prompts[0], max_tokens),
                          RequestRecord(-1, prompt_len(prompts[0]), max_tokens), time.perf_counter())
        if not test.success:
            raise ValueError(f"the test request to {url} failed: {test.error}")
        offsets = arrival_offsets(len(prompts), rate, seed)
        limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(prompts), desc="requests", disable=not progress)
        t0 = time.perf_counter()

        async def one(i: int) -> RequestRecord:
            delay = t0 + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = RequestRecord(i, prompt_len(prompts[i]), max_tokens)
            body = payload(model, prompts[i], max_tokens)
            if limit is None:
                await send(client, url, headers, body, rec, t0)
            else:
                async with limit:
                    await send(client, url, headers, body, rec, t0)
            bar.update(1)
            return rec
        records = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        duration = time.perf_counter() - t0
        bar.close()
    return list(records), duration


def served_model(base_url: str, api_key: str | None = None) -> dict:
    """The first entry of GET /v1/models (id, max_model_len)."""
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {base_url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise ValueError(f"GET {base_url}/v1/models: HTTP {r.status_code}: {r.text[:300]}")
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model")
    return data[0]
