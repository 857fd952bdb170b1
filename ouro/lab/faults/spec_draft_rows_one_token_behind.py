from .patch import Fault

FAULT = Fault(
    name="spec_draft_rows_one_token_behind",
    description="the MTP draft layer's rows pair the trunk's state at position p with token p instead of token p+1, "
                "so its drafts are not the checkpoint's MTP head's; outputs unchanged (verification rejects the "
                "drafts), speculation just accepts almost nothing",
    file="ouro/engine/speculative.py", function="Speculator.draft",
    replace=[("ids = [t for r, s, h in rows for t in r.all_ids[s + 1: s + 1 + h.shape[0]]]",
              "ids = [t for r, s, h in rows for t in r.all_ids[s: s + h.shape[0]]]  # FAULT: one token behind")],
    localised=[{"file": "ouro/engine/speculative.py", "function": ["draft"], "module": "mtp"}],
    probes=[["redundancy", "--model", "tiny-py", "--spec", "nextn:3"]],
    symptom="with --speculative-algorithm NEXTN the accept length is far lower than the checkpoint's MTP head "
            "promises; outputs are right",
)
