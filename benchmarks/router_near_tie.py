"""Where ouro and transformers part on one long prompt, and which near-tie makes them part.

    python benchmarks/router_near_tie.py --model small --input-len 1024 --seed 0
    python benchmarks/router_near_tie.py --model small --offline-json /tmp/off.json

Runs one sequence through both on the same fp32 checkpoint with logits at every position and
hooks on every MoE router and every indexer. The sequence is the prompt `ouro bench prefill`
uses for the same seed, or, with --offline-json, the first output of an `ouro bench offline
--compare transformers` run that parted from transformers: its prompt plus transformers' tokens
up to the parting one. Prints, in order of evidence:
  - positions where the greedy token differs, with the top-2 logit margin there;
  - logits' relative RMS error per position (median, worst);
  - (layer, position) pairs where the two indexers kept different tokens, with ouro's pool-score
    margin there (the last kept pool's score minus the first dropped one's);
  - router decisions (layer, position): how many picked different experts; the smallest margins
    (k-th minus (k+1)-th selection score, or the group-selection margin if smaller); and which
    margins lie within rounding, i.e. below twice the two routers' largest score difference on
    that token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ouro.engine.simple_runner import SimpleRunner  # noqa: E402
from ouro.models.loader import load_model  # noqa: E402
from ouro.models.resolve import resolve_model  # noqa: E402


def rel_rms(a, b):
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def decision_margin(logits, bias, c):
    """Per token: how far the router's top-k choice is from flipping, in selection-score units."""
    choice = logits.float().sigmoid() + bias.float()
    T, E = choice.shape
    margin = torch.full((T,), float("inf"))
    if c.n_group > 1:
        group = choice.view(T, c.n_group, E // c.n_group).topk(2, dim=-1).values.sum(-1)
        g = group.sort(dim=-1, descending=True).values
        margin = g[:, c.topk_group - 1] - g[:, c.topk_group]
        keep = torch.zeros_like(group, dtype=torch.bool)
        keep.scatter_(1, group.topk(c.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // c.n_group, dim=1), float("-inf"))
    s = choice.sort(dim=-1, descending=True).values
    k = c.num_experts_per_tok
    within = s[:, k - 1] - s[:, k]
    return torch.minimum(margin, torch.where(torch.isinf(within), margin, within))


def pool_margin(indexer, x, q_resid, pooled, pos):
    """ouro's indexer at the query in position `pos`: last kept pool's score - first dropped one's."""
    n_vis = (pos + 1) // indexer.kpool
    if n_vis <= indexer.select_k:
        return float("inf")
    q = indexer.wq_b(q_resid[pos]).float().view(indexer.Hi, indexer.d)
    w = indexer.weights_proj(x[pos]).float() * indexer.Hi ** -0.5
    s = w @ torch.relu(q @ pooled[:n_vis].float().T * indexer.d ** -0.5)
    top = s.sort(descending=True).values
    return float(top[indexer.select_k - 1] - top[indexer.select_k])


def kept(sel):
    return sorted(t for t in sel.tolist() if t >= 0)


def sequence(a, c):
    """(token ids, the position whose logits chose the parting token or None)."""
    if not a.offline_json:
        return torch.randint(0, c.vocab_size, (a.input_len,), generator=torch.Generator().manual_seed(a.seed)), None
    from ouro.bench.offline import make_prompts
    r = json.loads(open(a.offline_json).read())
    if not r.get("differing"):
        print(f"{a.offline_json}: every output equals transformers' (same_tokens {r.get('same_tokens')}); "
              "nothing to look at")
        sys.exit(0)
    d = r["differing"][0]
    prompt = make_prompts(r["num_prompts"], r["input_len"], c.vocab_size, r["seed"])[d["prompt"]]
    print(f"offline output {d['prompt']} parts at output token {d['position']}: ouro {d['ouro'][d['position']]}, "
          f"transformers {d['transformers'][d['position']]}; teacher-forcing prompt + transformers' tokens")
    return torch.tensor(prompt + d["transformers"][:d["position"] + 1]), len(prompt) + d["position"] - 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offline-json", default=None, help="an `ouro bench offline --output-json` file")
    a = ap.parse_args()
    from transformers import Glm5NextForConditionalGeneration
    from transformers.utils import logging
    logging.set_verbosity_error()
    directory = resolve_model(a.model, progress=False)
    model = load_model(directory)
    c = model.config
    hf = Glm5NextForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    hf_layers = hf.model.language_model.layers
    ids, decisive = sequence(a, c)
    L = len(ids)

    moe = [i for i, t in enumerate(c.mlp_layer_types) if t == "sparse"]
    ours, theirs, ix_ours, ix_theirs = {}, {}, {}, {}
    for i in moe:
        model.layers[i].mlp.gate.register_forward_hook(
            lambda m, args, out, i=i: ours.__setitem__(i, (args[0].float() @ m.weight.float().T, out[1])))
        hf_layers[i].mlp.gate.register_forward_hook(lambda m, args, out, i=i: theirs.__setitem__(i, (out[0], out[2])))
    for i in c.indexer_layers:
        model.layers[i].self_attn.indexer.register_forward_hook(
            lambda m, args, out, i=i: ix_ours.__setitem__(i, (args[0], args[1], out)))
        hf_layers[i].self_attn.indexer.register_forward_hook(lambda m, args, out, i=i: ix_theirs.__setitem__(i, out[0]))
    runner = SimpleRunner(model, 1, L)
    with torch.no_grad():
        got = runner.step([ids.tolist()], logits="all")
        ref = hf(ids.view(1, -1)).logits[0]

        differ = (got.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist()
        print(f"{a.model}, {L} tokens: greedy token differs at {len(differ)} of {L} positions {differ[:10]}")
        for p in differ[:10]:
            top = ref[p].topk(2).values
            print(f"  position {p}: transformers' top-2 logit margin {float(top[0] - top[1]):.2e}")
        if decisive is not None:
            for name, x in (("ouro", got), ("transformers", ref)):
                top = x[decisive].topk(2)
                print(f"  position {decisive} (the parting token): {name} ranks {top.indices.tolist()}, "
                      f"margin {float(top.values[0] - top.values[1]):.2e}")
        err = rel_rms(got, ref)
        print(f"logits rel. RMS per position: median {float(err.median()):.1e}, worst {float(err.max()):.1e} "
              f"at position {int(err.argmax())}")

        for i in c.indexer_layers:
            x, q_resid, sel = ix_ours[i]
            mine = model.layers[i].self_attn.indexer
            pooled = runner.cache.index_pooled[c.indexer_layers.index(i)].view(-1, c.index_head_dim)
            diff = [t for t in range(L) if kept(sel[t]) != kept(ix_theirs[i][t])]
            print(f"indexer of layer {i}: kept tokens differ at {len(diff)} of {L} positions" +
                  "".join(f"; position {t}: pool-score margin {pool_margin(mine, x, q_resid, pooled, t):.1e}"
                          for t in diff[:5]))

        flips, margins, close = [], [], []
        for i in moe:
            (lo, eo), (lt, et) = ours[i], theirs[i]
            m = decision_margin(lo, model.layers[i].mlp.gate.e_score_correction_bias, c)
            noise = (lo.sigmoid() - lt.sigmoid()).abs().max(-1).values
            margins += [(float(m[t]), i, t) for t in range(L)]
            close += [(float(m[t]), float(noise[t]), i, t) for t in range(L) if m[t] <= 2 * noise[t]]
            changed = (eo.sort(-1).values != et.sort(-1).values).any(-1).nonzero().flatten().tolist()
            flips += [(t, i, float(m[t])) for t in changed]
    flips.sort()
    print(f"router: expert choice differs at {len(flips)} of {len(moe) * L} (layer, position) decisions" +
          "".join(f"; layer {i} position {t} (margin {m:.1e})" for t, i, m in flips[:5]))
    margins.sort()
    print("router: smallest decision margins:", ", ".join(f"{m:.1e} (layer {i}, position {t})"
                                                         for m, i, t in margins[:5]))
    close.sort(key=lambda e: e[0] / max(e[1], 1e-30))
    print(f"router: {len(close)} decisions with a margin within rounding (<= 2x the two routers' score difference)" +
          "".join(f"; margin {m:.1e} vs difference {n:.1e} (layer {i}, position {t})" for m, n, i, t in close[:5]))


if __name__ == "__main__":
    main()
