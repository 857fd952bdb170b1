from .patch import Fault

FAULT = Fault(
    name="spec_state_committed_one_too_far",
    description="a speculative verification commits the KDA recurrent state one position past the accepted "
                "prefix (the first rejected draft's update is kept)",
    file="ouro/engine/speculative.py", function="commit_many",
    replace=[("n = m                                                  # positions whose update commits",
              "n = min(m + 1, kj.shape[0])  # FAULT: one position too far")],
    localised=[{"module": r"layers\.0\.self_attn"}, {"layer": 0}],
    probes=[["numerics", "--model", "tiny-py", "--a", "mode=decode,decode=12",
             "--b", "mode=decode,decode=12,spec=nextn:3"]],
    symptom="with --speculative-algorithm NEXTN greedy output drifts from the same request without speculation",
)
