"""Draft work that speculative decoding throws away, as a redundancy finding.

Runs held-out code prompts through the engine with `--speculative-algorithm NEXTN` and K drafts,
spans on, and counts: the draft layer's time, the verified positions the target computed and then
rejected, and the acceptance of each draft position. The waste is the draft time spent on drafts
that were rejected plus the verify rows that were rolled back (their share of the forward time).
A draft position whose acceptance is below what its cost pays for is named, with the K to try."""

from __future__ import annotations

from .findings import Finding

FILE, FUNCTION = "ouro/engine/speculative.py", "Speculator.draft"


def spec_waste_finding(model: str = "tiny-py", k: int = 3, n_prompts: int = 4, prompt_len: int = 64,
                       output_len: int = 32) -> Finding:
    from ..engine.llm import LLM
    from ..engine.sampling import SamplingParams
    from ..eval.corpus import held_out_prefixes
    from ..measure import spans
    llm = LLM(model, max_memory=128 << 20, page_size=16, speculative_config={"num_speculative_tokens": k})
    prompts = [{"prompt_token_ids": ids} for ids in held_out_prefixes(llm.engine.tokenizer, n_prompts, prompt_len)]
    spans.clear()
    spans.enable()
    try:
        llm.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    finally:
        spans.disable()
    seconds = {}
    for ev in spans.events():
        seconds[ev["name"]] = seconds.get(ev["name"], 0.0) + ev["dur_ms"] / 1e3
    st = llm.engine.speculator.stats
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
    severity = "warning" if share > 0.2 else "info"
    best = weak[0] - 1 if weak else k
    summary = (f"speculation (NEXTN, K={k}) threw away {100 * reject_share:.0f}% of its drafts: about "
               f"{1e3 * wasted:.0f} ms of {1e3 * step_s:.0f} ms of engine steps ({100 * share:.0f}%) went to drafts "
               f"and verify rows that were rejected; accept length {s['spec_accept_length']:.2f}")
    return Finding(
        probe="redundancy", severity=severity, summary=summary,
        where={"file": FILE, "function": FUNCTION, "module": "mtp"},
        measured={"wasted_us": round(1e6 * wasted, 1), "reject_share": round(reject_share, 4),
                  "accept_length": round(s["spec_accept_length"], 4)},
        expected={"wasted_share_below": 0.2},
        evidence={"accept_rate_per_position": [round(a, 4) for a in rates], "draft_s": seconds.get("draft", 0.0),
                  "forward_s": seconds.get("forward", 0.0), "replay_s": seconds.get("replay", 0.0),
                  "verifications": st.steps, "drafts_verified": st.proposed, "drafts_rejected": rejected},
        next=(f"draft positions {weak} accept under half their drafts: try --speculative-num-steps {max(1, best)}"
              if weak else f"every draft position accepts at least half: K={k} pays; try K={k + 1}"))
