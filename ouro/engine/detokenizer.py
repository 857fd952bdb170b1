"""Incremental detokenisation with stop strings.

Each step re-decodes every generated id and diffs against the text already
released. That is O(n) per token but trivially correct for any decoder
(byte-level merges, multi-token characters), which beats offset bookkeeping.
"""

from __future__ import annotations

from tokenizers import Tokenizer

_REPLACEMENT = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence
# A few prompt tokens decoded in front of the output: decoders that strip the
# first token's leading space (SentencePiece-style) then treat output as a continuation.
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str] | None = None,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # released so far; never contains (the start of) a matched stop
        self.stopped = False
        self.stop_reason: str | None = None
        self._context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._context_text = self._decode_raw(self._context)
        if self._context_text.endswith(_REPLACEMENT):
            # Prompt ends mid-character: the prefix diff would break, so go without.
            self._context, self._context_text = [], ""

    def _decode_raw(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _decode_output(self) -> str:
        full = self._decode_raw(self._context + self.token_ids)
        if full.startswith(self._context_text):
            return full[len(self._context_text):]
        return self._decode_raw(self.token_ids)  # context merged oddly: decode alone

    def _pending(self, decoded: str) -> str:
        """Decoded text beyond what was released (empty if the decoder rewrote history)."""
        if decoded.startswith(self.text):
            return decoded[len(self.text):]
        # Should not happen for byte-level BPE; released text cannot be taken back.
        return ""

    def add(self, token_id: int) -> str:
        """Append one generated id; return text that is now safe to show."""
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        decoded = self._decode_output()
        # Trailing U+FFFD means the last character is still missing bytes.
        stable = decoded.rstrip(_REPLACEMENT)
        pending = self._pending(stable)
        if not pending:
            return ""
        # Released text holds no stop and no stop prefix at its end, so any match
        # starts inside `pending`; but it may span several tokens, hence the search
        # over the whole pending text rather than the newest token's piece.
        hit = self._first_stop(pending)
        if hit is not None:
            pos, stop = hit
            new = pending[:pos]
            self.text += new
            self.stopped, self.stop_reason = True, stop
            return new
        new = pending[:len(pending) - self._stop_prefix_len(pending)]
        self.text += new
        return new

    def _first_stop(self, pending: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            pos = pending.find(stop)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def _stop_prefix_len(self, pending: str) -> int:
        """Longest suffix of `pending` that a later token could complete into a stop."""
        hold = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(pending)), hold, -1):
                if pending.endswith(stop[:n]):
                    hold = n
                    break
        return hold

    def update(self, new_ids: list[int], stop_token: bool = False, finished: bool = False) -> tuple[str, int]:
        """A choice's new ids -> (the text they release, how many of them belong to the choice).
        The one place a choice's text is made, offline (`OutputProcessor`) and served
        (`serve/generation.py`): `stop_token` (the last id ended the choice: EOS or a stop token
        id) keeps that id out of the text, as vLLM does; a stop string ends the choice at the id
        that completed it (the ids after it are dropped); a choice that `finished` otherwise
        releases the text held back as a possible stop-string start."""
        text, used = "", 0
        for k, tok in enumerate(new_ids):
            used += 1
            if not (stop_token and k == len(new_ids) - 1):
                text += self.add(tok)
            if self.stopped:
                return text, used
        if finished or stop_token:
            text += self.flush()
        return text, used

    def flush(self) -> str:
        """Release everything held back (call once generation ends without a stop string)."""
        if self.stopped:
            return ""
        new = self._pending(self._decode_output())
        self.text += new
        return new
