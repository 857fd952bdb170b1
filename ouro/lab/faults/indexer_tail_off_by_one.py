from .patch import Fault

FAULT = Fault(
    name="indexer_tail_off_by_one",
    description="the indexer's incomplete tail pool starts one token late (drops the first tail token)",
    file="ouro/ops/dsa/indexer.py", function="index_select",
    replace=[("tail = n_vis[:, None] * kpool + torch.arange(kpool - 1, device=dev)",
              "tail = n_vis[:, None] * kpool + 1 + torch.arange(kpool - 1, device=dev)  # FAULT")],
    localised=[{"module": r"layers\.\d+\.self_attn(\.indexer)?", "layer": "dsa"},
               {"file": "ouro/ops/dsa/indexer.py", "function": ["index_select"]},
               {"op": r"index_select|indexer|sparse_mla"}],
    probes=[["numerics", "--model", "tiny", "--a", "impl=transformers", "--b", "impl=ouro,fused=off"]],
    symptom="long prompts read slightly worse; nothing crashes",
)
