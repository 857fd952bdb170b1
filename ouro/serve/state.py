"""What the HTTP frontend shares between its routes and middleware: the engine client, the
tokenizer and chat format, the limits, the metrics, and the counters of requests in flight."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .metrics import Metrics

if TYPE_CHECKING:     # the state's collaborators, named for readers and checkers (no import at run time)
    from tokenizers import Tokenizer

    from ..engine.multimodal import ImagePrompt
    from .chat import ChatFormat
    from .engine_client import EngineClient
    from .media import MediaLimits

GENERATE_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: Tokenizer
    chat: ChatFormat | None          # None without a chat template
    model_name: str
    max_model_len: int
    capacity_tokens: int
    vocab_size: int
    api_key: str | None = None
    max_queued_requests: int = 256
    max_num_seqs: int = 64
    max_body_bytes: int = 4 << 20
    draining: bool = False
    in_flight: int = 0
    tracing: dict | None = None      # an on-demand trace being recorded (trace_routes.py)
    images: ImagePrompt | None = None    # None: the model takes text only
    media: MediaLimits | None = None
    eos_token_ids: tuple = ()
    tokenizer_info: dict = field(default_factory=dict)   # GET /tokenizer_info (tokenize_routes.tokenizer_info)
    metrics: Metrics = field(default=None)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def sequence_limit(self) -> int:
        """Sequences (prompts x n) in flight at most: the running batch and the waiting queue."""
        return self.max_num_seqs + self.max_queued_requests
