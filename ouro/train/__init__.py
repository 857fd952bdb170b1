"""`ouro train`: trains a built-in glm5_next shape on a text corpus (optional extra `[train]`).

transformers' `Glm5NextForConditionalGeneration` is the differentiable trunk (ouro's own model
stays inference-only); ouro adds what transformers does not train: the DSA indexer (distilled
from dense attention), the MTP draft layer and the MoE balance.
"""
