from .patch import Fault

FAULT = Fault(
    name="prefix_hit_zero_state",
    description="a prefix-cache hit restores the KDA conv and recurrent state as zeros",
    file="ouro/engine/checkpointer.py", function="CheckpointStore.restore",
    replace=[("self.cache.conv[:, slot] = self.conv[:, i]", "self.cache.conv[:, slot] = 0.0  # FAULT"),
             ("self.cache.recurrent[:, slot] = self.recurrent[:, i]", "self.cache.recurrent[:, slot] = 0.0  # FAULT")],
    localised=[{"module": r"layers\.0\.self_attn.*"}, {"layer": 0},
               {"file": "ouro/engine/checkpointer.py", "function": ["restore"]}],
    probes=[["numerics", "--model", "tiny-py", "--a", "prefix=cold", "--b", "prefix=hit"]],
    symptom="with prefix caching on, the trained model's text stays fluent but differs from a cold run",
)
