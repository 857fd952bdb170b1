"""Draft work that speculative decoding throws away, as a redundancy finding, held to what the
checkpoint's own draft layer gives.

Runs held-out code prompts through the engine with `--speculative-algorithm NEXTN` and K drafts,
spans on, and records every verification (the tokens known, the drafts verified, how many were
accepted). The waste is the draft time spent on drafts that were rejected plus the verify rows
that were rolled back (their share of the forward time).

What clean speculation costs is not a fault: a draft layer trained with one head is wrong often.
So the same verifications are replayed against a reference: the draft layer driven from scratch
on each request's final greedy tokens (`reference_drafts`: the trunk over the whole sequence, the
draft layer's rows filled from the trunk's states in order, then its chain of single steps at
the pending token, each fed its own output), which is the draft layer the trainer's MTP head
defines (`tests/models/test_mtp_layer.py`) without the engine's bookkeeping (which rows, positions,
tokens and hidden states `Speculator.draft` hands it, batched across requests). The finding is
info while the engine accepts what the reference accepts on the same verifications, and a
warning, at `Speculator.draft` with the first departing verifications' positions, when it
departs from it (fewer accepted: drafts worse than the checkpoint's; more: drafts accepted that
the draft layer does not make). A draft position whose acceptance is below half is named, with
the K to try."""

from __future__ import annotations

import torch

from ..findings import Finding

FILE, FUNCTION = "ouro/engine/speculative.py", "Speculator.draft"
# the engine's drafts run batched and the reference's alone: an argmax between two near-equal
# logits may flip and change a verification's accepted count. A departure is a change in the
# accepted total past this share of the reference's (and past DEPART_MIN drafts)
DEPART_SHARE, DEPART_MIN = 0.1, 2


@torch.inference_mode()
def reference_drafts(model, layer, ids: list[int], checks: list[tuple[int, int]], page_size: int = 16) -> dict:
    """{n: the reference drafts} for each verification (n, d) of one request: with the first n
    of `ids` known (the pending token is ids[n - 1]) the draft layer's chain of up to d drafts,
    stopped after the first that misses ids (the drafts after it cannot be accepted)."""
    from ...layers.context import ForwardContext, ModelCache
    pages = -(-(len(ids) + max((d for _, d in checks), default=0) + 1) // page_size)
    cache = ModelCache(model.config.with_mtp_layer(), 1, pages, page_size)
    table = [list(range(pages))]
    ctx = ForwardContext.build(cache, [len(ids)], [0], [0], table, logits="last")
    ctx.keep_hidden = True
    model(torch.tensor(ids), ctx)
    hidden = ctx.hidden                                    # the trunk's final state at every position
    embed = lambda toks: model.embed_tokens.forward(torch.tensor(toks))   # noqa: E731
    head = lambda h: int(model.lm_head.forward(h).float().argmax(-1)[-1])  # noqa: E731
    out, filled = {}, 0
    for n, d in sorted(checks):
        # the draft layer's rows filled-1 .. n-2 from the trunk's states: row p is (state p, token p+1);
        # this also rewrites the rows the previous chain left past its pending token
        mctx = ForwardContext.build(cache, [n - 1 - filled], [filled], [0], table, logits="all")
        h = layer.draft_hidden(embed(ids[filled + 1: n]), hidden[filled: n - 1], mctx)[-1:]
        filled = n - 1
        drafts = []
        for j in range(d):
            drafts.append(head(h))
            if n + j >= len(ids) or drafts[-1] != ids[n + j] or j == d - 1:
                break
            cctx = ForwardContext.build(cache, [1], [n - 1 + j], [0], table, logits="all")
            h = layer.draft_hidden(embed(drafts[-1:]), h, cctx)
        out[n] = drafts
    return out


def _accepted(drafts: list[int], ids: list[int], n: int) -> int:
    a = 0
    while a < len(drafts) and n + a < len(ids) and drafts[a] == ids[n + a]:
        a += 1
    return a


def spec_waste_finding(model: str = "tiny-py", k: int = 3, n_prompts: int = 3, prompt_len: int = 48,
                       output_len: int = 24, dtype: str = "float32") -> Finding:
    """dtype: the engine's, the probe's `--dtype` (float32 by default). Not the engine's `auto`: that is
    bfloat16 on a CPU with fast bf16 GEMMs (Zen 4), and what the probe compares is acceptance, not
    speed (the previous workload, 4 prompts of 64 tokens and 32 out, took 24.8 s in bfloat16 on an
    AVX2 machine against 2-4 s in float32)."""
    from ...engine.llm import LLM
    from ...eval.corpus import held_out_prefixes
    llm = LLM(model, dtype=dtype, max_memory=128 << 20, page_size=16, speculative_config={"num_speculative_tokens": k})
    spec = llm.engine.speculator
    prompts = held_out_prefixes(llm.engine.tokenizer, n_prompts, prompt_len)
    outs, checks, seconds = _run_recorded(llm, prompts, output_len)
    st = spec.stats
    s = st.summary()
    rejected = st.proposed - (st.emitted - st.steps)            # verified drafts rolled back
    rows = st.steps + st.proposed + len(prompts) * prompt_len   # every row the trunk computed, about
    reject_share = rejected / st.proposed if st.proposed else 0.0
    # rejected drafts' share of the draft time, and rolled-back rows' share of the forward time
    wasted = seconds.get("draft", 0.0) * reject_share + seconds.get("forward", 0.0) * rejected / rows
    step_s = seconds.get("step", 0.0)
    rates = s["spec_accept_rate_per_position"]
    weak = [i + 1 for i, a in enumerate(rates) if a < 0.5]
    share = wasted / step_s if step_s else 0.0
    best = weak[0] - 1 if weak else k

    eng_acc, ref_acc, departures = _against_reference(llm, outs, checks)
    departed = abs(eng_acc - ref_acc) > max(DEPART_MIN, DEPART_SHARE * ref_acc)
    evidence = {"accept_rate_per_position": [round(a, 4) for a in rates], "draft_s": seconds.get("draft", 0.0),
                "forward_s": seconds.get("forward", 0.0), "replay_s": seconds.get("replay", 0.0),
                "verifications": st.steps, "drafts_verified": st.proposed, "drafts_rejected": rejected,
                "drafts_accepted": eng_acc, "reference_accepted": ref_acc,
                "departing_verifications (first draft's position, engine drafts, reference drafts, accepted "
                "engine/reference)": [[n, d, r, f"{a}/{b}"] for n, d, r, a, b in departures[:6]]}
    measured = {"wasted_us": round(1e6 * wasted, 1), "reject_share": round(reject_share, 4),
                "accept_length": round(s["spec_accept_length"], 4), "drafts_accepted": eng_acc}
    where = {"file": FILE, "function": FUNCTION, "module": "mtp"}
    if departed:
        where["positions"] = sorted({n for n, *_ in departures})[:8]
        summary = (f"speculation (NEXTN, K={k}) accepted {eng_acc} drafts where the checkpoint's draft layer, driven "
                   f"from scratch on the same tokens, gets {ref_acc} accepted on the same {st.steps} verifications: "
                   f"the drafts the engine makes depart from the draft layer's ({len(departures)} verifications differ, "
                   f"the first at position {where['positions'][0]})")
        nxt = (f"read {FILE} {FUNCTION}(): which rows, positions, tokens and hidden states it hands the draft layer; "
               f"ouro probe numerics --model {model} --a mode=decode --b mode=decode,spec=nextn:{k}")
    else:
        summary = (f"speculation (NEXTN, K={k}) threw away {100 * reject_share:.0f}% of its drafts, as the checkpoint's "
                   f"draft layer does ({eng_acc} accepted, {ref_acc} from scratch on the same verifications): about "
                   f"{1e3 * wasted:.0f} ms of {1e3 * step_s:.0f} ms of engine steps ({100 * share:.0f}%) went to drafts "
                   f"and verify rows that were rejected; accept length {s['spec_accept_length']:.2f}")
        nxt = (f"draft positions {weak} accept under half their drafts: try --speculative-num-steps {max(1, best)}"
               if weak else f"every draft position accepts at least half: K={k} pays; try K={k + 1}")
    return Finding(
        probe="redundancy", severity="warning" if departed else "info", summary=summary, where=where,
        measured=measured,
        expected={"drafts_accepted": ref_acc, "departure_below": max(DEPART_MIN, DEPART_SHARE * ref_acc)},
        evidence=evidence, next=nxt)


def _run_recorded(llm, prompts, output_len: int) -> tuple[list, dict, dict]:
    """The prompts generated greedily with each verification recorded: (outputs, request id ->
    [(tokens known, drafts verified, drafts accepted)], span name -> seconds)."""
    from ...engine.sampling import SamplingParams
    from ...measure import spans
    spec = llm.engine.speculator
    checks: dict[str, list] = {}
    verify = spec.verify

    def recorded(r, logits):
        n, drafts = r.num_tokens, list(r.draft_ids[: logits.shape[0] - 1])
        emitted = verify(r, logits)
        checks.setdefault(r.request_id, []).append((n, drafts, len(emitted) - 1))
        return emitted
    spec.verify = recorded
    spans.clear()
    spans.enable()
    try:
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                            SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    finally:
        spans.disable()
        spec.verify = verify
    seconds: dict[str, float] = {}
    for ev in spans.events():
        seconds[ev["name"]] = seconds.get(ev["name"], 0.0) + ev["dur_ms"] / 1e3
    return outs, checks, seconds


def _against_reference(llm, outs, checks) -> tuple[int, int, list]:
    """The same verifications against the draft layer driven from scratch: (drafts the engine got
    accepted, drafts the reference gets accepted, the verifications where they differ as (position
    of the first draft, engine drafts, reference drafts, accepted engine, accepted reference))."""
    eng_acc = ref_acc = 0
    departures = []
    for o in outs:
        ids = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        mine = checks.get(o.request_id, [])
        if not any(d for _, d, _ in mine):
            continue
        ref = reference_drafts(llm.engine.model, llm.engine.speculator.layer, ids, [(n, len(d)) for n, d, _ in mine if d])
        for n, drafts, acc in mine:
            if not drafts:
                continue
            r_acc = _accepted(ref[n], ids, n)
            eng_acc, ref_acc = eng_acc + acc, ref_acc + r_acc
            if acc != r_acc:
                departures.append((n, drafts, ref[n], acc, r_acc))
    return eng_acc, ref_acc, departures
