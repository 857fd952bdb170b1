"""The sampler as the numerics taps see it. It runs after the model, on the engine's logits: each
probed sequence's pick and that pick's log-probability are recorded under `sampler.logprob` at the
position whose logits were sampled, so `numerics --a fused=off --b fused=on` holds the native pick
(`native/sample.cpp`) to torch's form (`Sampler.picks_reference`), and a row the native op computed
is noted as its (`Recording.fused_at`): a divergence there names `pick_logprobs`, not the model.

The key is recorded after every forward's, so it is compared last: a fault in the model shows at
its module first. Rows with a forced token (the probe's decode prefix) carry that token's logprob
under the constraint (0 both ways); the free pick at each request's end carries the real one.
"""

from __future__ import annotations

import sys

import torch

KEY = "sampler.logprob"
OP = "pick_logprobs"


def wrap_sampler(rec, slots, source_of) -> list[tuple]:
    """Install the wrappers; returns (module or class, name, original) for the caller to restore.
    `slots()`: the probed requests' KDA state slots; `source_of(fn)`: (file, function, line)."""
    from ...engine import sampling
    from ...native import sample as native_sample
    ran_native = []
    pick = native_sample.pick_logprobs
    sample = sampling.Sampler.sample

    def native_pick(*args, **kwargs):
        ran_native.append(True)
        return pick(*args, **kwargs)

    def tapped_sample(self, *args, **kwargs):
        ran_native.clear()
        out = sample(self, *args, **kwargs)
        reqs = sys._getframe(1).f_locals.get("reqs")        # `LLMEngine._sample`: the rows' requests
        if not isinstance(reqs, list) or len(reqs) != len(out.logprobs):
            return out
        probed = set(slots())
        rows = [k for k, r in enumerate(reqs) if getattr(r, "slot", None) in probed]
        if rows:
            positions = torch.tensor([reqs[k].num_tokens - 1 for k in rows])
            rec.kinds[KEY] = "sampler"
            rec.ops.add(KEY)
            rec.sources.setdefault(KEY, source_of(sampling.Sampler.with_logprobs))
            rec.add(KEY, torch.tensor([[out.logprobs[k]] for k in rows], dtype=torch.float64), positions)
            if ran_native:
                rec.op_sources[OP] = source_of(pick)
                rec.fused_at.setdefault(KEY, {}).update(dict.fromkeys(positions.tolist(), OP))
        return out

    patched = [(native_sample, "pick_logprobs", pick), (sampling.Sampler, "sample", sample)]
    native_sample.pick_logprobs = native_pick
    sampling.Sampler.sample = tapped_sample
    return patched
