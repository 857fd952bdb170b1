from .patch import Fault

FAULT = Fault(
    name="sinkhorn_rows_by_column_sums",
    description="Sinkhorn's row pass divides by the column sums: comb is column- but not row-stochastic",
    file="ouro/ops/mhc/sinkhorn.py", function="sinkhorn",
    replace=[("m.div_(row_sums())", "m.div_(col_sums())  # FAULT: rows by column sums")],
    localised=[{"module": r"layers\.0\.attn_hc\.comb"}, {"file": "ouro/ops/mhc/sinkhorn.py", "function": ["sinkhorn"]}],
    probes=[["numerics", "--model", "tiny-py", "--a", "impl=transformers", "--b", "impl=ouro"]],
    symptom="the trained model's text is a little worse; every ouro configuration agrees with every other",
)
