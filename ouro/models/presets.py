"""Built-in model shapes and deterministic random initialisation (`ouro make-model`).

- `tiny`: < 1M parameters, 3 KDA + 1 DSA layers, sparse selection kicks in past 16 tokens; tests.
- `small`: about 135M parameters; benchmarks on a CPU.
- `flash`: the published GLM-5.3-Flash dimensions; config only (memory planning).
- `tiny-vl`: `tiny` with a small vision tower (`VISION_PRESETS`) and image/video tokens at the top
  of its tokenizer; tests of image input.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from ..config import ModelConfig
from ..config.model import MEDIA_TOKEN_FIELDS, VisionConfig

KDA, DSA = "linear_attention", "indexed_attention"

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
        kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, index_topk=16, index_head_dim=16,
        index_n_heads=2, index_kpool=4, linear_head_dim=16, linear_num_heads=2, max_position_embeddings=4096,
        layer_types=(KDA, KDA, KDA, DSA), mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
        indexer_types=("full",) * 4, pad_token_id=0, eos_token_id=[0, 7, 9]),
    "small": ModelConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=8, n_routed_experts=32, n_group=4, topk_group=2, num_experts_per_tok=4,
        kv_lora_rank=128, q_lora_rank=192, qk_nope_head_dim=64, v_head_dim=64, index_topk=256, index_head_dim=64,
        index_n_heads=4, index_kpool=4, linear_head_dim=64, linear_num_heads=8, max_position_embeddings=65536,
        layer_types=(KDA, KDA, KDA, DSA) * 2, mlp_layer_types=("dense",) + ("sparse",) * 7,
        indexer_types=("full",) * 8, pad_token_id=0, eos_token_id=[0, 7, 9]),
    # trained on the Python standard library by `ouro train` and shipped with ouro (ouro/models/builtin)
    "tiny-py": ModelConfig(
        vocab_size=2048, hidden_size=192, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, n_routed_experts=8, n_group=1, topk_group=1, num_experts_per_tok=2,
        kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=48, v_head_dim=48, index_topk=32, index_head_dim=32,
        index_n_heads=4, index_kpool=4, linear_head_dim=48, linear_num_heads=4, max_position_embeddings=8192,
        layer_types=(KDA, KDA, KDA, DSA), mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
        indexer_types=("full",) * 4, pad_token_id=0, eos_token_id=[0, 7, 9]),
    "flash": ModelConfig(),  # defaults are the published GLM-5.3-Flash dimensions
}
# image/video tokens take the tokenizer's top ids (tokenizer_factory.MEDIA_TOKENS, in that order)
PRESETS["tiny-vl"] = dataclasses.replace(PRESETS["tiny"], **{
    field: PRESETS["tiny"].vocab_size - len(MEDIA_TOKEN_FIELDS) + i for i, field in enumerate(MEDIA_TOKEN_FIELDS)})

VISION_PRESETS: dict[str, VisionConfig] = {
    # swiglu_limit 1: random activations cross it, so the clamp is exercised (and checked)
    "tiny-vl": VisionConfig(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, swiglu_limit=1.0,
                            out_hidden_size=PRESETS["tiny-vl"].hidden_size, projection_intermediate_size=64),
}

CONFIG_ONLY = {"flash"}
TRAINED = {"tiny-py"}     # shipped trained; `make_model` writes only random-init presets
BUILTIN_DIR = Path(__file__).parent / "builtin"
# bumped whenever what make_model writes changes (weights, tokenizer, template): cached presets
# of another format are rebuilt
PRESET_FORMAT = 5    # 5: config.json carries the original GLM keys (linear_attn_config, mhc, ...)


def parameter_count(config: ModelConfig) -> int:
    from .glm5_next import Glm5NextModel
    with torch.device("meta"):
        return sum(p.numel() for p in Glm5NextModel(config).parameters())


@torch.no_grad()
def init_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic random init (same values on every machine): normal(0, std) matrices, unit
    norms, the KDA gate and mHC initialisations transformers uses, then `condition_indexer`."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.state_dict().items()):
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name and leaf in ("weight",) or name.endswith(("hc.scale", "compress_gate")):
            p.fill_(1.0)
        elif name.endswith(("hc.base", "k_norm.bias", "A_log", "compress_ape", "e_score_correction_bias")):
            p.zero_()
        elif name.endswith("dt_bias"):  # dt ~ logUniform(1e-3, 1e-1), stored as softplus^-1(dt)
            dt = torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp().clamp_min(1e-4)
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif "conv1d" in name:
            bound = 1 / math.sqrt(p.shape[-1])
            p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=gen))
        else:
            p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=gen))
    condition_indexer(dict(model.state_dict()), model.config)


@torch.no_grad()
def condition_indexer(params: dict[str, torch.Tensor], config: ModelConfig, prefix: str = "") -> None:
    """Make a random checkpoint's indexer scores free of exact ties.

    With random weights, ReLU(q.k) is zero for every indexer head on about 2^-heads of the pools,
    so many pools score exactly 0 and top-k among them is arbitrary (torch breaks such ties
    differently for different row lengths). Trained checkpoints do not behave like that. Here the
    embeddings get a large constant channel 0 that no block writes to (the output projections'
    row 0 is zeroed, and the head ignores it), so every layer sees it unchanged; `q_a_proj` row 0
    copies it (alone) into the first channel of the query latent, the indexer keys get a shared bias
    direction u, and that latent channel projects onto +u in even heads and -u in odd heads:
    whatever its sign, some head has q.k > 0 on every pool, and scores are distinct. `params` maps names (after `prefix`, e.g.
    "model.language_model." for a transformers model) to tensors, edited in place.
    """
    emb = params[prefix + "embed_tokens.weight"]
    emb[:, 0] += 10 * emb[:, 1:].std()
    for name, t in params.items():
        if name.startswith(prefix + "layers.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            t[0] = 0.0                                            # blocks never write channel 0
        elif name.startswith(prefix + "layers.") and name.endswith("experts.down_proj"):
            t[:, 0] = 0.0
    if "lm_head.weight" in params:
        params["lm_head.weight"][:, 0] = 0.0                      # logits carry no constant part
    d = config.index_head_dim
    u = torch.zeros(d)
    u[0] = 1.0
    sign = torch.tensor([1.0 if h % 2 == 0 else -1.0 for h in range(config.index_n_heads)])
    for i in config.indexer_layers:
        a = f"{prefix}layers.{i}.self_attn."
        params[a + "indexer.k_norm.weight"].fill_(0.5)
        params[a + "indexer.k_norm.bias"].copy_(3.0 * u)
        q_a = params[a + "q_a_proj.weight"]                       # [q_lora, hidden]
        std = q_a[1:].std()
        q_a[0] = 0.0
        q_a[0, 0] = 500 * std                                     # latent channel 0 reads only hidden channel 0
        wq = params[a + "indexer.wq_b.weight"].view(config.index_n_heads, d, -1)
        wq[:, :, 0] = 2.0 * sign[:, None] * u


@torch.no_grad()
def init_vision_weights(tower: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic random init of a vision tower, every tensor random (norm weights around 1,
    biases small), so a comparison of two towers checks each of them."""
    gen = torch.Generator().manual_seed(seed + 7919)     # apart from the text model's stream
    for name, p in sorted(tower.state_dict().items()):
        if "norm" in name and name.endswith(".weight"):
            p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(torch.empty(p.shape).normal_(0.0, 0.1, generator=gen))
        else:   # fan-in scaled: activations stay of order one through the blocks
            fan_in = p[0].numel()
            p.copy_(torch.empty(p.shape).normal_(0.0, max(std, fan_in ** -0.5), generator=gen))


def generation_config(config: ModelConfig) -> dict:
    return {"eos_token_id": config.eos_token_ids, "pad_token_id": config.pad_token_id,
            "do_sample": False, "max_new_tokens": 256}


def make_model(preset: str, directory: str | Path, seed: int = 0, progress: bool = True,
               overwrite: bool = False) -> Path:
    """Write a random-init checkpoint of `preset` (config, weights, tokenizer, generation config).
    Refuses a path that is a file, and a directory that already holds a checkpoint unless `overwrite`."""
    from .glm5_next import Glm5NextModel
    from .loader import save_weights
    from .tokenizer_factory import MEDIA_TOKENS, write_tokenizer_files
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if preset in TRAINED:
        raise ValueError(f"preset {preset!r} is a trained model shipped with ouro (use it by name); "
                         f"`ouro train --preset {preset} --output DIR` trains it again")
    config = PRESETS[preset]
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory} exists and is not a directory; choose another path")
    if (directory / "config.json").exists() and not overwrite:
        raise ValueError(f"{directory} already holds a checkpoint (config.json); pass --overwrite to replace it")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:        # a parent that is a file, no permission, ...
        raise ValueError(f"cannot create {directory}: {e.strerror or e}") from None
    tower_config = VISION_PRESETS.get(preset)
    # text presets: a tiny vision tower config (no weights) so transformers can build the full model class
    vision = tower_config.to_hf_dict() if tower_config else {
        "depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
        "out_hidden_size": config.hidden_size, "projection_intermediate_size": 64}
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict(vision), indent=2))
    (directory / "generation_config.json").write_text(json.dumps(generation_config(config), indent=2))
    media = MEDIA_TOKENS if tower_config else ()
    write_tokenizer_files(directory, config.vocab_size, config.max_position_embeddings, extra_special=media)
    _check_media_ids(directory, config, media)
    # lets `ouro serve` say that the text of a random-init preset is meaningless
    (directory / "ouro_preset.json").write_text(json.dumps({"preset": preset, "random_init": preset not in CONFIG_ONLY,
                                                            "seed": seed, "format": PRESET_FORMAT}, indent=2))
    if preset in CONFIG_ONLY:
        return directory
    model = Glm5NextModel(config)
    init_weights(model, seed)
    tower = None
    if tower_config:
        from .vision import VisionModel
        tower = VisionModel(tower_config)
        init_vision_weights(tower, seed)
    save_weights(model, directory, progress=progress, vision=tower)
    return directory


def _check_media_ids(directory: Path, config: ModelConfig, media: tuple[str, ...]) -> None:
    """The ids config.json names for the image/video tokens are the tokenizer's."""
    from tokenizers import Tokenizer
    if not media:
        return
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    got = {f: tokenizer.token_to_id(t) for f, t in zip(MEDIA_TOKEN_FIELDS, media)}
    want = {f: getattr(config, f) for f in MEDIA_TOKEN_FIELDS}
    if got != want:
        raise RuntimeError(f"the tokenizer's image/video token ids {got} are not config.json's {want}")
