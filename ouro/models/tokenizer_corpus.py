"""Small built-in training corpus for the test/toy BPE tokenizer.

Original text written for this repo. It only has to give BPE a realistic
mix of English prose, Python code, numbers and punctuation so that merges
look like a real tokenizer's; it is NOT meant to produce a good tokenizer.
Changing this text changes every token id, so treat it as frozen.
"""

CORPUS = r'''
Serving a large language model is mostly a problem of moving bytes around.
The weights have to live somewhere close to the compute units, the key/value
cache grows with every generated token, and the scheduler must decide, many
times per second, which requests run next. A good serving stack keeps the
accelerator busy while keeping the time to first token low for every user.

When a request arrives, the server first turns the text into token ids. The
tokenizer splits the input into pieces, maps each piece to an integer, and
hands the list of integers to the engine. The engine runs a prefill pass over
the whole prompt, writes the keys and values of every layer into the cache,
and then starts the decode loop: one new token per step, per sequence.

Prefill is compute bound. A prompt of 4096 tokens turns into large matrix
multiplications that saturate the tensor cores. Decode is memory bound: each
step reads all of the active weights and the cache, but produces only a single
token for each sequence in the batch. Batching many sequences together is how
a server turns a memory-bound loop into useful throughput.

Continuous batching means that the batch is not fixed. New requests join as
soon as there is room in the cache, and finished requests leave right away.
The scheduler tracks, for each sequence, how many tokens are already cached,
how many are still waiting to be prefilled, and whether the sequence has hit a
stop condition. Stop conditions include the end-of-text token, a maximum
number of new tokens, and user supplied stop strings.

Paged attention stores the cache in fixed-size blocks, for example 16 or 64
tokens per block. A block table maps the logical positions of a sequence to
physical blocks in memory. Because blocks are small, memory is not wasted on
padding, and two sequences that share the same prefix can share the same
blocks. Prefix caching hashes each full block of tokens; when a new prompt
starts with the same tokens, the server reuses the cached blocks and skips
that part of the prefill.

A mixture-of-experts layer replaces one large feed-forward network with many
smaller experts. A router scores every token against every expert and keeps
the top k, often k = 8 out of 256 experts. Only the selected experts run for
that token, so the number of active parameters per token is much smaller than
the total. The cost moves from arithmetic to communication: tokens have to be
sent to the devices that own their experts, and the results have to be sent
back and combined with the router weights.

Sparse attention goes one step further. Instead of attending to every earlier
token, a light-weight indexer picks the most relevant positions, and the main
attention only reads those. With a context of 128k tokens and a budget of
2048 selected positions, the attention cost per step drops by a factor of
about 64, while quality stays close to dense attention on most tasks.

Quantization shrinks the weights: 16-bit floats become 8-bit floats or 4-bit
integers with a scale per group of 32, 64 or 128 values. Smaller weights mean
fewer bytes to read per decode step, which directly raises the number of
tokens per second. The trade-off is a small loss in accuracy, which has to be
measured on real tasks rather than guessed.

Speculative decoding uses a cheap draft to propose several tokens at once;
the large model then verifies all of them in a single forward pass. If the
draft was right about the first three tokens, the server emits three tokens
for the price of one step. If it was wrong, the server keeps the verified
prefix and throws away the rest. With multi-token prediction heads, the draft
comes from the model itself.

Sampling turns logits into the next token. Greedy decoding takes the argmax.
Temperature divides the logits before the softmax: values below 1.0 sharpen
the distribution and values above 1.0 flatten it. Top-k keeps the k most
likely tokens, top-p keeps the smallest set whose probability mass is at least
p, and min-p drops tokens whose probability is below a fraction of the best
one. A repetition penalty lowers the score of tokens that were already used.

The chat format wraps each message in role markers. A system message sets the
rules, a user message asks something, and the assistant answers. Tool results
come back as observations. The model learns to stop after its answer by
emitting the end-of-text token or the marker of the next user turn.

Metrics matter: time to first token (TTFT), inter-token latency (ITL), tokens
per second per user, and total tokens per second per GPU. A benchmark should
report the median and the 99th percentile, the prompt and output lengths, the
request rate, and the exact versions of the model, the driver and the server.
For example: p50 TTFT = 182 ms, p99 TTFT = 1.47 s, ITL = 21.3 ms, and
throughput = 12,480 tok/s at 64 concurrent requests.

Questions to ask before tuning anything: Is the GPU actually busy? Are the
kernels the ones you expected? Does the batch size match the memory budget?
Is the CPU side (tokenization, scheduling, detokenization) keeping up? Often
the slowest part is not where you think it is!

# --- Python examples -------------------------------------------------------

import math
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SamplingParams:
    """Per-request sampling settings."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    seed: Optional[int] = None

    def validate(self) -> None:
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens <= 0:
            raise ValueError("max_new_tokens must be positive")


class BlockAllocator:
    """Hands out fixed-size cache blocks and takes them back."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, -1, -1))
        self.ref_count = [0] * num_blocks

    def allocate(self) -> int:
        if not self.free:
            raise RuntimeError("out of cache blocks")
        block = self.free.pop()
        self.ref_count[block] = 1
        return block

    def release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free.append(block)

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)


def softmax(values: list[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def top_p_filter(probs: list[float], p: float) -> list[int]:
    order = sorted(range(len(probs)), key=lambda i: probs[i], reverse=True)
    kept, mass = [], 0.0
    for index in order:
        kept.append(index)
        mass += probs[index]
        if mass >= p:
            break
    return kept


def rope_frequencies(dim: int, base: float = 10000.0) -> list[float]:
    return [1.0 / (base ** (2 * i / dim)) for i in range(dim // 2)]


for step, (name, value) in enumerate(sorted({"a": 3, "b": 1, "c": 2}.items())):
    print(f"{step:>3d} {name!r}: {value * 2 + 1}")

try:
    result = {"id": "req-0001", "tokens": [151331, 151333, 1019, 42], "ok": True}
    assert result["ok"] is True and len(result["tokens"]) == 4
except (KeyError, AssertionError) as exc:
    print("bad result:", exc)
finally:
    print("done")

async def stream(engine, prompt: str):
    async for chunk in engine.generate(prompt):
        if chunk.finished:
            return
        yield chunk.text

while queue and budget > 0:
    seq = queue.pop(0)
    budget -= seq.num_prompt_tokens
    running.append(seq)

x = [i * i for i in range(10) if i % 2 == 0]  # [0, 4, 16, 36, 64]
y = {k: v for k, v in zip("abc", (1, 2, 3))}
z = lambda a, b=2, *args, **kwargs: (a + b) // 3 - len(args) ** 2
mask = (ids != pad_id) & (positions < max_len) | is_prefix

# --- More prose ------------------------------------------------------------------

Tensor parallelism splits each weight matrix across several devices. The
column-parallel half of a layer needs no communication, but the row-parallel
half ends with an all-reduce, so every layer pays for two collective calls
on the critical path. Pipeline parallelism cuts the model into stages
instead; it needs less bandwidth but adds bubbles unless many micro-batches
are in flight. Expert parallelism places whole experts on different devices
and exchanges tokens with all-to-all calls before and after each MoE block.

Detokenization is easy to get wrong. A single token may hold only part of a
multi-byte character, so the server must wait for the next token before it
can print anything. Stop strings can also span token boundaries: the text
"</answer>" might arrive as "</", "ans" and "wer>". The safe approach keeps a
small buffer of unreleased text and only flushes what can no longer be the
start of a stop string.

Graph capture records the exact sequence of kernel launches for one decode
step and replays it later with almost no CPU overhead. The catch is that the
shapes must be fixed, so servers capture one graph per batch size bucket
(1, 2, 4, 8, 16, 32, 64, 128, 256) and pad the live batch up to the nearest
bucket. Padding wastes a little compute but saves far more launch time.

Testing a serving stack takes several layers. Unit tests check single
functions such as the sampler or the block allocator. Kernel tests compare a
fast implementation against a slow, obviously correct reference on random
inputs, with tolerances that depend on the data type. End-to-end tests start
a tiny model with random weights, send real HTTP requests, and check that the
answers are well formed, that streaming and non-streaming agree, and that
greedy decoding is reproducible from run to run.

Long contexts change the balance again. At 32k tokens the cache of a single
sequence can be larger than the active weights, so the attention kernel, not
the matrix multiplications, dominates each decode step. Compressing the cache
(fewer heads, lower precision, latent projections) or reading only part of
it (sparse or sliding-window attention) is what keeps long chats affordable.

Fairness is a scheduling problem too. If one user sends a prompt of 100,000
tokens, its prefill can stall everybody else for seconds. Chunked prefill
splits that prompt into pieces of, say, 2048 tokens and interleaves them with
decode steps of the other sequences, so nobody waits too long. Priorities,
per-tenant quotas and admission control build on the same idea.

# --- More code ---------------------------------------------------------------------

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    variance = x.float().pow(2).mean(dim=-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def route(hidden: torch.Tensor, gate: torch.Tensor, top_k: int = 8):
    scores = torch.sigmoid(hidden @ gate.t())
    weights, experts = torch.topk(scores, k=top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def causal_attention(q, k, v, scale=None):
    # q, k, v: [batch, heads, seq, dim]
    scale = scale or q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    seq = q.shape[-2]
    mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.matmul(F.softmax(scores, dim=-1), v)


class StopChecker:
    def __init__(self, stop_ids: set[int], stop_strings: tuple[str, ...] = ()):
        self.stop_ids = stop_ids
        self.stop_strings = stop_strings
        self.longest = max((len(s) for s in stop_strings), default=0)

    def check(self, token_id: int, text: str) -> Optional[str]:
        if token_id in self.stop_ids:
            return "stop"
        tail = text[-(self.longest + 8):]
        for s in self.stop_strings:
            if s in tail:
                return "stop"
        return None


def test_allocator_roundtrip():
    alloc = BlockAllocator(num_blocks=4)
    blocks = [alloc.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3]
    for b in blocks:
        alloc.release(b)
    assert len(alloc.free) == 4


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="toy server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=64)
    args = parser.parse_args()
    print(f"listening on http://{args.host}:{args.port} (batch <= {args.max_batch})")

| batch | prompt | output | TTFT (ms) | ITL (ms) | tok/s   |
|------:|-------:|-------:|----------:|---------:|--------:|
|     1 |    512 |    128 |        38 |      9.8 |   102.0 |
|     8 |   2048 |    256 |       141 |     12.4 |   645.2 |
|    64 |   4096 |    512 |       903 |     23.7 |  2700.5 |

# --- Config and logs ----------------------------------------------------------

{
  "model_type": "glm5_next",
  "hidden_size": 4096,
  "num_hidden_layers": 46,
  "num_attention_heads": 32,
  "num_key_value_heads": 8,
  "vocab_size": 151552,
  "rope_theta": 1000000.0,
  "max_position_embeddings": 131072,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16"
}

2025-03-14 09:26:53,589 INFO  scheduler: running=48 waiting=3 swapped=0
2025-03-14 09:26:53,612 INFO  engine: prefill 3 seqs, 7,204 tokens in 0.211s
2025-03-14 09:26:54,001 WARN  cache: usage 93.7% (1,871 / 2,000 blocks)
2025-03-14 09:26:54,120 ERROR api: request req-7f3a timed out after 30.0s
GET /v1/models HTTP/1.1 200 OK
POST /v1/chat/completions HTTP/1.1 200 OK

$ python -m ouro.serve --model ./checkpoints/glm5 --port 8000 --tp 8
$ curl -s localhost:8000/v1/completions -d '{"prompt": "Hello", "max_tokens": 16}'
$ pip install -e ".[dev]" && pytest -q tests/

# --- Notes, numbers and odd punctuation ------------------------------------------

Version 2.1.0 fixed 17 bugs; version 2.1.1 fixed 3 more. Pi is about
3.14159 and e is about 2.71828. 1 KiB = 1024 bytes, 1 MiB = 1,048,576 bytes,
and 1 GiB = 1,073,741,824 bytes. A 7B model in bf16 needs roughly 14 GB;
in int4 it needs about 3.5 GB, plus the cache. 0x1F = 31, 0b1010 = 10,
1e-5 is small, and -0.0 == 0.0 is True.

Lists: (a) prefill; (b) decode; (c) detokenize. Ranges: 0-9, A-Z, a-z.
Quotes: "double", 'single', `backtick`. Brackets: () [] {} <>. Symbols:
~ ! @ # $ % ^ & * _ + = | \ / ? ; : , . -- ... ->  =>  <=  >=  !=  ==  ::
Email: team@example.com; URL: https://example.com/docs?page=2&lang=en#top

A few words from elsewhere: naïve café, façade, résumé, Zürich, São Paulo,
jalapeño, smörgåsbord; arrows → ← ↑ ↓; dashes – and —; math ≤ ≥ ≠ ± × ÷ ∞.

## Frequently asked questions

**Why does the first request take longer?** Kernels are compiled and the
cache is warmed up on the first call. Later calls reuse both.

**Why do two runs give different text?** Sampling is random unless a seed is
set, and even with a seed, changing the batch can change the order of
floating-point additions. Use greedy decoding for exact comparisons.

**How long can the prompt be?** Up to the model's context length minus the
number of tokens you want to generate. Longer prompts are rejected with an
error instead of being silently truncated.

**What happens when the cache is full?** The scheduler stops admitting new
requests and, if needed, preempts the newest running sequence; its blocks are
freed and it is prefilled again later. This keeps older requests moving.

**Can I stream the output?** Yes. Set "stream": true and read server-sent
events; each event carries the new text since the previous one. The final
event says why generation stopped: "stop", "length" or "abort".

The quick brown fox jumps over the lazy dog. Pack my box with five dozen
liquor jugs. How vexingly quick daft zebras jump! Sphinx of black quartz,
judge my vow. These lines use every letter, which keeps rare letters in the
training data without bending the statistics of the rest.

In short: measure first, change one thing at a time, write down the numbers,
and keep the tests green. A server that is fast but wrong is not fast; it is
just wrong sooner.
'''
