from .patch import Fault

FAULT = Fault(
    name="spec_conv_window_not_rolled_back",
    description="after a speculative verification rejects drafts, the KDA short-conv window keeps the inputs of "
                "every verified position (the rejected tail included) instead of rolling back to the accepted ones",
    file="ouro/engine/speculative.py", function="commit_many",
    replace=[("full = torch.cat([window, pre_conv[:m].T.to(window.dtype)], dim=-1)",
              "full = torch.cat([window, pre_conv.T.to(window.dtype)], dim=-1)  # FAULT: the rejected tail stays")],
    localised=[{"module": r"layers\.0\.self_attn"}, {"layer": 0}],
    probes=[["numerics", "--model", "tiny-py", "--a", "mode=decode,decode=12",
             "--b", "mode=decode,decode=12,spec=nextn:3"]],
    symptom="with --speculative-algorithm NEXTN greedy output drifts from the same request without speculation",
)
