from .patch import Fault

FAULT = Fault(
    name="prefix_ckpt_one_page_late",
    description="a prefix-cache KDA checkpoint is filed one page early, so a hit restores a state one page late",
    file="ouro/engine/prefix_cache.py", function="PrefixCache.insert",
    replace=[("n = path[d - 1]", "n = path[max(d - 2, 0)]  # FAULT: the state of the next page boundary")],
    localised=[{"module": r"layers\.0\.self_attn.*"}, {"layer": 0},
               {"file": "ouro/engine/prefix_cache.py", "function": ["insert", "match"]}],
    probes=[["numerics", "--model", "tiny", "--a", "prefix=cold", "--b", "prefix=hit"]],
    symptom="answers to repeated prompts change when prefix caching is on",
)
