"""Speculative decoding with the checkpoint's MTP layer (`--speculative-algorithm NEXTN`).

A step of a request in decode carries its pending token and K drafts; the trunk verifies all K+1
in one forward (a chunk of K+1 tokens among the batch's other rows). Then:
- acceptance: greedy rows keep drafts while they equal the target's argmax; sampled rows keep a
  draft d with probability min(1, p(d) / q(d)) and, at the first rejection, draw from
  max(p - q, 0) renormalised (the output distribution is the target's); the target gives one
  more token after the last accepted draft (the bonus).
- KDA state: during verification the speculative rows' states are left as they were and each
  KDA layer records what a commit needs (`KDARecord`): `replay` keeps the per-position k, v,
  gate, beta and conv inputs and replays the accepted prefix with the decode step's own
  recurrence; `per_step` (the measured baseline) materialises the state and conv window after
  every position and copies the accepted one. The rejected tail is never committed.
- DSA rows of rejected positions stay in the pages but are never read: the next step writes its
  first token at the first rejected position, and every later position is written before it is
  read. Prefix-cache checkpoints are taken during the prompt only, so they are committed states.
- drafting: the MTP layer runs over the positions the trunk just committed (state at p and token
  p+1 give its cache row at p), and the last one's output is draft 1; K-1 more single steps feed
  the draft layer its own output. A row in prefill fills its draft-layer rows the same way.
A request inside its forced prefix drafts the forced ids themselves (each accepted exactly when
it is the forced one: the verification of a forced token is one-hot); an engine with logits
processors does not speculate (their next-token distribution is not the model's alone).
`probe_reject_last` (the lab's `spec=nextn:K`) replaces the last forced draft of every step with
a wrong token, so every verification rejects one position and the rollback is exercised."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..layers.context import ForwardContext
from ..measure.spans import span
from ..ops.kda import kda_recurrent_step

log = logging.getLogger("ouro.speculative")


class KDARecord:
    """What one speculative row's KDA layers keep during its verification forward."""

    def __init__(self, mode: str):
        self.mode = mode
        self.layers: dict[int, tuple] = {}

    def record(self, si, conv0, rec0, pre_conv, k, v, g, beta):
        """Called by each KDA layer (`si`) with the row's start window and state and its inputs."""
        if self.mode == "replay":
            self.layers[si] = (pre_conv.detach().float(), k.float(), v.float(), g.float(), beta.float())
            return
        n, K1 = k.shape[0], conv0.shape[-1]
        state = rec0.clone().unsqueeze(0)
        states = []
        for t in range(n):
            kda_recurrent_step(k[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
            states.append(state[0].clone())
        full = torch.cat([conv0.float(), pre_conv.detach().float().T], dim=-1)
        windows = [full[:, t + 1: t + 1 + K1].clone() for t in range(n)]
        self.layers[si] = (torch.stack(states), torch.stack(windows))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for parts in self.layers.values() for t in parts)

    def commit(self, cache, slot: int, m: int) -> None:
        """Write the state after the first `m` verified positions into `slot`."""
        commit_many(cache, [(self, slot, m)])


def commit_many(cache, commits) -> None:
    """commits: (KDARecord, slot, m) of several requests. Replay records step their recurrences
    together, one batched step per position: a row whose accepted prefix has ended steps with gate
    0 and beta 0, which leaves its state exactly as it is."""
    replay = [(rec, slot, m) for rec, slot, m in commits if rec.mode == "replay"]
    for rec, slot, m in commits:
        if rec.mode == "per_step":
            for si, (states, windows) in rec.layers.items():
                cache.recurrent[si][slot] = states[m - 1]
                cache.conv[si][slot] = windows[m - 1]
    if not replay:
        return
    slots = torch.tensor([slot for _, slot, _ in replay], device=cache.recurrent.device)
    for si in replay[0][0].layers:
        parts = [rec.layers[si] for rec, _, _ in replay]
        steps = max(p[1].shape[0] for p in parts)                # the verified positions
        state = cache.recurrent[si][slots]                        # [R, H, dk, dv], a gathered copy
        k, v, g, beta = (torch.zeros(len(replay), steps, *parts[0][i].shape[1:]) for i in range(1, 5))
        for j, ((pre_conv, kj, vj, gj, bj), (_, slot, m)) in enumerate(zip(parts, replay)):
            n = m                                                  # positions whose update commits
            k[j, :n], v[j, :n], g[j, :n], beta[j, :n] = kj[:n], vj[:n], gj[:n], bj[:n]
            window = cache.conv[si][slot]
            full = torch.cat([window, pre_conv[:m].T.to(window.dtype)], dim=-1)
            cache.conv[si][slot] = full[:, full.shape[-1] - window.shape[-1]:]
        for t in range(steps):   # the decode step's own recurrence, one position at a time
            kda_recurrent_step(k[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        cache.recurrent[si][slots] = state


def accept(drafts: list[int], q: torch.Tensor | None, p: torch.Tensor, greedy: bool,
           generator: torch.Generator | None) -> list[int]:
    """The tokens a verification emits: the accepted drafts, then the target's next token.
    p [len(drafts) + 1, V]: the target's distributions; q [len(drafts), V]: the drafts'."""
    out = []
    for i, d in enumerate(drafts):
        if greedy:
            if int(p[i].argmax()) != d:
                break
        else:
            u = float(torch.rand(1, generator=generator))
            if not u * float(q[i, d]) <= float(p[i, d]):        # reject with probability 1 - p/q
                residual = (p[i] - q[i]).clamp_min(0)
                total = float(residual.sum())
                row = residual / total if total > 0 else p[i]
                out.append(int(torch.multinomial(row, 1, generator=generator)))
                return out
        out.append(d)
    i = len(out)
    out.append(int(p[i].argmax()) if greedy else int(torch.multinomial(p[i], 1, generator=generator)))
    return out


@dataclass
class SpecStats:
    steps: int = 0                   # verifications
    emitted: int = 0                 # tokens they emitted (accepted drafts + bonus)
    proposed: int = 0                # drafts verified
    accepted_at: list = field(default_factory=list)   # per draft position: accepted count
    proposed_at: list = field(default_factory=list)
    replay_bytes: int = 0            # the largest KDA record one request held during a verification
    canary_trips: int = 0            # requests the online canary took off speculation

    def add(self, n_drafts: int, n_emitted: int) -> None:
        self.steps += 1
        self.emitted += n_emitted
        self.proposed += n_drafts
        while len(self.proposed_at) < n_drafts:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i in range(n_drafts):
            self.proposed_at[i] += 1
            self.accepted_at[i] += int(i < n_emitted - 1)

    def summary(self) -> dict:
        return {"spec_verify_steps": self.steps,
                "spec_accept_length": self.emitted / self.steps if self.steps else 0.0,
                "spec_accept_rate": (self.emitted - self.steps) / self.proposed if self.proposed else 0.0,
                "spec_accept_rate_per_position": [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)],
                "spec_replay_bytes_per_request": self.replay_bytes, "spec_canary_trips": self.canary_trips}


class Speculator:
    """The engine's speculative part: which rows carry drafts, acceptance, commits and drafting."""

    def __init__(self, engine, mtp_layer, num_steps: int, kda_state: str):
        self.engine, self.layer, self.k, self.kda_state = engine, mtp_layer, num_steps, kda_state
        self.model = engine.model
        self.stats = SpecStats()
        self.probe_reject_last = False

    # ---- before the forward ----
    def records_for(self, reqs, counts) -> dict:
        """{batch row: KDARecord} for the rows that carry drafts this step."""
        out = {}
        for b, (r, n) in enumerate(zip(reqs, counts)):
            if n > r.num_tokens - r.num_computed:
                r.spec_record = out[b] = KDARecord(self.kda_state)
        return out

    def eligible(self, r) -> bool:
        """A grammar that waits for its opening token (reasoning first) is checked token by token."""
        return not self.engine.logits_processors and not r.spec_off and (r.constraint is None or r.constraint.active)

    @staticmethod
    def forced_left(r) -> list[int]:
        forced = r.params.forced_prefix_ids or []
        return forced[len(r.output_ids):]

    # ---- after the forward ----
    def finish_step(self, batch, starts) -> list:
        """Verify the draft-carrying rows (accept, emit, commit their KDA states), then draft for
        every request still running from the hidden states this step computed."""
        e = self.engine
        spec_logits, hidden, cu = e.runner.step_extra
        e.runner.step_extra = None
        outputs, commits = [], []
        for b, (r, start) in enumerate(zip(batch.requests, starts)):
            if b in spec_logits:
                emitted = self.verify(r, spec_logits[b])
                sampled = e.sampler.with_logprobs(spec_logits[b][:len(emitted)], [r.params] * len(emitted), emitted)
                new_ids, new_text = [], ""
                for k, tok in enumerate(emitted):
                    new_ids.append(tok)
                    new_text += e.emit(r, tok, sampled.logprobs[k], sampled.top_logprobs[k],
                                       spec_logits[b][k] if e.record_logits else None)
                    if r.is_finished:
                        break
                outputs.append(e.outputs.output(r, new_ids, new_text))
                if r.is_finished:
                    r.spec_record = None
                else:
                    commits.append((r, start, len(emitted)))
        self.commit(commits)
        rows = []
        for b, (r, start) in enumerate(zip(batch.requests, starts)):
            # a finished request's draft-layer rows are still wanted when its state is being sent on
            if not r.hold_on_finish and (r.is_finished or r.request_id not in e.requests):
                continue
            rows.append((r, start, hidden[int(cu[b]): int(cu[b]) + r.num_computed - start]))
        self.draft(rows)
        return outputs

    def verify(self, r, logits: torch.Tensor) -> list[int]:
        """Accept the row's drafts against the target's logits [n, V]; returns the emitted tokens
        (the KDA commit waits until the engine knows the request goes on)."""
        drafts = r.draft_ids[: logits.shape[0] - 1]
        if r.constraint is not None and r.constraint.active:    # structured output: the grammar checks the drafts
            with span("grammar mask", cat="mask"):
                drafts = self.engine.grammars.book.mask_drafts(r.constraint, drafts, logits)
        p = self.engine.sampler.probabilities(logits[: len(drafts) + 1], [r.params] * (len(drafts) + 1))
        for i, tok in enumerate(self.forced_left(r)[: p.shape[0]]):      # forced positions emit their id
            p[i] = 0.0
            p[i, tok] = 1.0
        emitted = accept(drafts, r.draft_probs, p, r.params.greedy, r.generator)
        self.stats.add(len(drafts), len(emitted))
        self.stats.replay_bytes = max(self.stats.replay_bytes, r.spec_record.nbytes())
        c = r.spec_counts
        c[0], c[1], c[2] = c[0] + 1, c[1] + len(emitted), c[2] + len(drafts)
        self._canary(r)
        return emitted

    def _canary(self, r) -> None:
        """Stop speculating for a request whose acceptance is too low to pay (or too high to be
        true) once it has produced `after` tokens. Its tokens so far were all verified by the
        target, so it goes on from where it is rather than being retried."""
        cfg = self.engine.config
        steps, emitted, proposed = r.spec_counts
        if r.spec_off or emitted < cfg.speculative_canary_after or not proposed:
            return
        length, rate = emitted / steps, (emitted - steps) / proposed
        why = ("accept length" if length < cfg.speculative_canary_min_accept_length else
               "accept rate" if rate > cfg.speculative_canary_max_accept_rate else None)
        if why:
            r.spec_off = True
            self.stats.canary_trips += 1
            log.warning("speculation off for %s: %s out of bounds after %d tokens (length %.2f, rate %.3f)",
                        r.request_id, why, emitted, length, rate)

    def commit(self, rows) -> None:
        """rows: (request, first verified position, tokens emitted) of the verifications that go
        on: the pending token and the accepted drafts were inputs, so that many positions commit."""
        with span("replay", cat="compute"):
            commit_many(self.engine.runner.cache, [(r.spec_record, r.slot, n) for r, _, n in rows])
        for r, start, n in rows:
            r.spec_record = None
            r.num_computed = start + n

    @span("draft", cat="compute")
    @torch.inference_mode()
    def draft(self, rows) -> None:
        """rows: (request, first position the trunk computed this step, its final hidden states
        [n, D]) for requests still running. Fills the draft layer's rows at those positions and
        proposes up to K drafts for the requests now waiting on one token."""
        cache = self.engine.runner.cache
        rows = [(r, s, h) for r, s, h in rows if h.shape[0] > 0 and s + h.shape[0] < r.num_tokens]
        for r, _, _ in rows:
            r.draft_ids, r.draft_probs = [], None
        if not rows:
            return
        reqs = [r for r, _, _ in rows]
        lens = [h.shape[0] for _, _, h in rows]
        ids = [t for r, s, h in rows for t in r.all_ids[s + 1: s + 1 + h.shape[0]]]
        ctx = self._ctx(cache, reqs, lens, [s for _, s, _ in rows])
        hidden = self.layer.draft_hidden(self._embed(torch.tensor(ids, device=cache.device)),
                                         torch.cat([h for _, _, h in rows]), ctx)
        last = ctx.cu_seqlens[1:] - 1
        live = [i for i, r in enumerate(reqs) if r.num_computed == r.num_tokens - 1 and self.eligible(r)]
        budget = {i: self._budget(reqs[i]) for i in live}
        live = [i for i in live if budget[i] > 0]
        forced = [i for i in live if self.forced_left(reqs[i])]
        for i in forced:
            self._forced_drafts(reqs[i], budget[i])
        live = [i for i in live if i not in forced]
        h = hidden[last[live]] if live else None
        pos = [reqs[i].num_computed for i in live]        # the draft row of the pending token
        for step in range(self.k):
            if not live:
                break
            logits = self.model.lm_head.forward(h).float().cpu()     # .forward: the trunk's hooks see trunk calls only
            q = self.engine.sampler.probabilities(logits, [reqs[i].params for i in live])
            for j, i in enumerate(live):
                r = reqs[i]
                tok = int(q[j].argmax()) if r.params.greedy else int(torch.multinomial(q[j], 1, generator=r.generator))
                r.draft_ids.append(tok)
                r.draft_probs = q[j:j + 1] if r.draft_probs is None else torch.cat([r.draft_probs, q[j:j + 1]])
            keep = [j for j, i in enumerate(live) if len(reqs[i].draft_ids) < budget[i]]
            if step == self.k - 1 or not keep:
                break
            live, pos, h = [live[j] for j in keep], [pos[j] for j in keep], h[keep]
            ctx = self._ctx(cache, [reqs[i] for i in live], [1] * len(live), pos)
            toks = torch.tensor([reqs[i].draft_ids[-1] for i in live], device=cache.device)
            h = self.layer.draft_hidden(self._embed(toks), h, ctx)
            pos = [p + 1 for p in pos]

    def _forced_drafts(self, r, budget: int) -> None:
        """Drafts of a request inside its forced prefix: the forced ids (one-hot draft distributions)."""
        vocab = self.model.config.vocab_size
        drafts = self.forced_left(r)[:budget]             # the outputs after the pending token
        if drafts and self.probe_reject_last:
            drafts[-1] = (drafts[-1] + 1) % vocab
        r.draft_ids = drafts
        r.draft_probs = torch.zeros(len(drafts), vocab)
        if drafts:
            r.draft_probs[torch.arange(len(drafts)), torch.tensor(drafts)] = 1.0

    def _embed(self, ids):
        return self.model.embed_tokens.forward(ids)      # not through the trunk module's hooks (taps, transfers)

    def _budget(self, r) -> int:
        """Drafts this request may carry: K, fewer near max_tokens or the context, or where its
        pages cannot grow to hold them."""
        e = self.engine
        room = min(self.k, r.params.max_tokens - len(r.output_ids) - 1, e.max_model_len - r.num_tokens)
        if room <= 0 or not e.scheduler.grow(r, r.num_tokens + room):
            return 0
        return room

    @staticmethod
    def _ctx(cache, reqs, lens, starts) -> ForwardContext:
        width = max(len(r.pages) for r in reqs)
        table = [r.pages + [0] * (width - len(r.pages)) for r in reqs]
        return ForwardContext.build(cache, lens, starts, [r.slot for r in reqs], table, logits="all")


def start(engine, mtp_layer=None):
    """The engine's drafter (also the runner's), or None without --speculative-algorithm; the MTP
    layer is loaded from the engine's checkpoint where not given."""
    c = engine.config
    if not c.speculative_algorithm:
        return None
    if mtp_layer is None:
        if engine.model_dir is None:
            raise ValueError("speculative decoding needs the checkpoint's MTP layer: pass model_dir or mtp_layer")
        from ..models.mtp import load_mtp
        mtp_layer = load_mtp(engine.model_dir, engine.model.config, dtype=engine.model.embed_tokens.weight.dtype,
                             device=c.device)
    engine.runner.speculator = drafter = Speculator(engine, mtp_layer, c.speculative_num_steps, c.speculative_kda_state)
    return drafter
