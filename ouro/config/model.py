"""Frozen configuration objects. `ModelConfig` mirrors the text part of a `glm5_next` config.json
(and its top-level image/video token ids); `VisionConfig` its `vision_config`."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from . import original_keys
from .errors import CheckpointError


def _is_int(v) -> bool:
    """An integer that is not a bool (bool is an int subclass but never a valid count)."""
    return isinstance(v, int) and not isinstance(v, bool)


# layer_types spellings transformers reads as its own two: the GLM checkpoint's DSA name (its legacy remap),
# glm5_next's older "full_attention" and "mamba"
LAYER_TYPE_SPELLINGS = {"deepseek_sparse_attention": "indexed_attention", "full_attention": "indexed_attention",
                        "mamba": "linear_attention"}
# keys of the GLM checkpoint (not transformers') whose one supported value ouro writes and checks
GLM_FIXED = {"index_kpool_compress": True, "scoring_func": "sigmoid"}
KNOWN_TYPES = {"layer_types": ("linear_attention", "indexed_attention"), "mlp_layer_types": ("dense", "sparse"),
               "indexer_types": ("full", "shared")}


def _default_layer_types(n: int) -> list[str]:
    # Three KDA layers then one DSA layer, repeating (transformers' default schedule).
    return ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 288
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 1536
    qk_nope_head_dim: int = 256
    v_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    indexer_types: tuple[str, ...] = ()
    has_mtp: bool = False  # checkpoint layer `num_hidden_layers` is an MTP draft layer
    # placeholder and delimiter tokens of images and videos (top level of config.json)
    image_token_id: int = 154854
    image_start_token_id: int = 154830
    image_end_token_id: int = 154831
    video_token_id: int = 154855
    video_start_token_id: int = 154832
    video_end_token_id: int = 154833

    def __post_init__(self):
        n = self.num_hidden_layers
        if not self.layer_types:
            object.__setattr__(self, "layer_types", tuple(_default_layer_types(n)))
        if not self.mlp_layer_types:
            object.__setattr__(self, "mlp_layer_types", tuple(["dense"] * min(3, n) + ["sparse"] * (n - 3)))
        if not self.indexer_types:
            object.__setattr__(self, "indexer_types", tuple(["full"] * n))
        # the other spellings transformers reads (the GLM checkpoint's own "deepseek_sparse_attention")
        object.__setattr__(self, "layer_types", tuple(LAYER_TYPE_SPELLINGS.get(t, t) for t in self.layer_types))
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            if len(getattr(self, name)) != n:
                raise CheckpointError(f"config: {name} has {len(getattr(self, name))} entries, expected {n}")
            bad = sorted({t for t in getattr(self, name) if t not in KNOWN_TYPES[name]}, key=str)
            if bad:
                raise CheckpointError(f"config: {name} has {bad}; glm5_next layers are one of "
                                      f"{list(KNOWN_TYPES[name])}")
        if self.index_topk % self.index_kpool:
            raise CheckpointError(f"config: index_topk {self.index_topk} must be a multiple of index_kpool")
        if self.n_routed_experts % self.n_group:
            raise CheckpointError("config: n_routed_experts must be divisible by n_group")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise CheckpointError("config: group-limited routing scores each group by its top 2 experts; "
                                  "n_routed_experts / n_group must be at least 2")
        first_dsa = next((i for i, t in enumerate(self.layer_types) if t == "indexed_attention"), None)
        if first_dsa is not None and self.indexer_types[first_dsa] == "shared":
            raise CheckpointError(f"config: layer {first_dsa} is the first DSA layer but its indexer is 'shared'")
        # the reference hands a full indexer layer's selection to the next layer only
        for i, (kind, indexer) in enumerate(zip(self.layer_types, self.indexer_types)):
            if kind == "indexed_attention" and indexer == "shared" and i != first_dsa and not (
                    self.layer_types[i - 1] == "indexed_attention" and self.indexer_types[i - 1] == "full"):
                raise CheckpointError(
                    f"config: layer {i}'s indexer is 'shared' but layer {i - 1} is not a DSA layer with a 'full' "
                    "indexer (a shared layer reuses the selection of the full DSA layer right before it)")
        lb = self.linear_lower_bound
        if lb is not None and (isinstance(lb, bool) or not isinstance(lb, (int, float)) or lb > 0):
            raise CheckpointError(
                f"config: linear_lower_bound (linear_attn_config.gate_lower_bound) = {lb!r} is not supported: "
                "the KDA forget gate is a log-decay, lower_bound * sigmoid(...) <= 0, so the bound must be a "
                "number <= 0, or null (linear_attn_config.safe_gate false) for the unbounded softplus gate")
        if not self.index_kpool_always_select_tail:
            raise CheckpointError(
                "config: index_kpool_always_select_tail=false is not supported: without the incomplete tail "
                f"pool, the first index_kpool-1 ({self.index_kpool - 1}) tokens of a sequence select no key at "
                "all and transformers' output for them depends on its attention backend (sdpa: zero attention "
                "output; eager: uniform attention over every key, later tokens included), so there is no "
                "defined reference to match")

    # ---- derived facts used across the package ----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim  # NoPE: qk_rope_head_dim is always 0

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def dsa_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "indexed_attention"]

    @property
    def indexer_layers(self) -> list[int]:
        """DSA layers that run their own indexer (and so own an indexer cache)."""
        return [i for i in self.dsa_layers if self.indexer_types[i] == "full"]

    def with_mtp_layer(self) -> "ModelConfig":
        """This config with the MTP draft layer as one more layer (index `num_hidden_layers`): a DSA
        layer with its own indexer and a routed MoE. A cache built from it holds the draft layer's
        latent rows and indexer keys beside the trunk's (the trunk's layer ids are unchanged)."""
        return dataclasses.replace(self, num_hidden_layers=self.num_hidden_layers + 1,
                                   layer_types=(*self.layer_types, "indexed_attention"),
                                   mlp_layer_types=(*self.mlp_layer_types, "sparse"),
                                   indexer_types=(*self.indexer_types, "full"), has_mtp=False)

    @property
    def linear_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    def cache_bytes_per_token(self, dtype, kv_kinds: dict | None = None) -> int:
        """Paged bytes one token of context costs across all DSA layers (`layers.context.ModelCache`'s
        layout: latent row, indexer key and gate in `dtype`, the fp32 compressed key per pool).
        `kv_kinds` {DSA layer id: "fp8_e4m3" | "int8"}: those layers' latent rows and indexer keys
        are quantised rows (`quantised_row_bytes`)."""
        e, d, kinds = dtype.itemsize, self.index_head_dim, kv_kinds or {}
        total = 0
        for layer in self.dsa_layers:
            q = layer in kinds
            total += quantised_row_bytes(self.kv_lora_rank) if q else e * self.kv_lora_rank
            if layer in self.indexer_layers:
                total += (quantised_row_bytes(d) if q else e * d) + e * d + 4 * d // self.index_kpool
        return total

    @property
    def state_bytes_per_slot(self) -> int:
        """Bytes of one KDA state slot (fp32 conv window and recurrent state of every KDA layer)."""
        per_layer = 3 * self.linear_dim * (self.linear_conv_kernel_dim - 1) + self.linear_num_heads * self.linear_head_dim ** 2
        return 4 * len(self.kda_layers) * per_layer

    @property
    def eos_token_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else ([e] if isinstance(e, int) else list(e))

    # ---- (de)serialisation in the Hugging Face layout ----
    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        text = d.get("text_config") or d  # flat (text-only) configs keep fields at top level
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in text.items() if k in names}
        for k in ("layer_types", "mlp_layer_types", "indexer_types"):
            if kw.get(k) is not None:
                kw[k] = tuple(kw[k])
            else:
                kw.pop(k, None)
        original_keys.read(text, kw, cls)    # the original GLM keys, as transformers reads them
        if text.get("qk_rope_head_dim", 0):
            raise CheckpointError("config: glm5_next DSA layers are NoPE; qk_rope_head_dim must be 0")
        for key, want in GLM_FIXED.items():   # GLM checkpoint keys naming what every glm5_next is
            if key in text and text[key] != want:
                raise CheckpointError(f"config: {key} = {text[key]!r} is not supported; glm5_next (in ouro and "
                                      f"transformers) runs with {key} = {want!r}")
        if text.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"config: hidden_act {text['hidden_act']!r} is not supported; ouro's "
                                  "SwiGLU experts and KDA short conv use silu")
        if "eos_token_id" not in kw and d.get("eos_token_id") is not None:
            kw["eos_token_id"] = d["eos_token_id"]
        if text.get("num_nextn_predict_layers"):
            kw["has_mtp"] = True
        if "tie_word_embeddings" in d:
            kw["tie_word_embeddings"] = d["tie_word_embeddings"]
        kw.update({k: d[k] for k in MEDIA_TOKEN_FIELDS if d.get(k) is not None})
        cfg = cls(**kw)
        original_keys.check(cfg, text)
        return cfg

    @classmethod
    def from_hf(cls, directory: str | Path) -> "ModelConfig":
        path = Path(directory) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{directory}: no config.json (expected a Hugging Face glm5_next checkpoint directory)")
        d = json.loads(path.read_text())
        if d.get("model_type") not in ("glm5_next", "glm5_next_text"):
            raise CheckpointError(
                f"{path}: model_type is {d.get('model_type')!r}, ouro serves only 'glm5_next' checkpoints")
        return cls.from_dict(d)

    def to_text_config(self) -> dict:
        d = dataclasses.asdict(self)
        for k in MEDIA_TOKEN_FIELDS:   # top-level fields of config.json, not the text model's
            d.pop(k)
        if d.pop("has_mtp"):
            d["num_nextn_predict_layers"] = 1
        for k in ("layer_types", "mlp_layer_types", "indexer_types"):
            d[k] = list(d[k])
        # DSA layers in the GLM checkpoint's spelling, which transformers reads as "indexed_attention"
        # (llama.cpp's glm5next converter reads the DSA layers from this spelling of the raw config.json)
        d["layer_types"] = ["deepseek_sparse_attention" if t == "indexed_attention" else t for t in d["layer_types"]]
        d.update(GLM_FIXED, indexer_rope_interleave=True)   # (no rotary part: inert, written as GLM does)
        d.update(model_type="glm5_next_text", qk_rope_head_dim=0, head_dim=0, num_key_value_heads=self.num_attention_heads,
                 hidden_act="silu", attention_bias=False)
        d.update(original_keys.write(self))   # what other tools read (llama.cpp's converter)
        return d

    def to_hf_dict(self, vision_config: dict | None = None) -> dict:
        return {
            "architectures": ["Glm5NextForConditionalGeneration"],
            "model_type": "glm5_next",
            "text_config": self.to_text_config(),
            "vision_config": vision_config or {},
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": "float32",
            **{k: getattr(self, k) for k in MEDIA_TOKEN_FIELDS},
        }


# in the order of models/tokenizer_factory.MEDIA_TOKENS, their tokens in a vision preset
MEDIA_TOKEN_FIELDS = ("image_start_token_id", "image_end_token_id", "video_start_token_id",
                      "video_end_token_id", "image_token_id", "video_token_id")


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower of a `glm5_next` checkpoint (`vision_config`); defaults are transformers'."""
    depth: int = 24
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 4096
    out_hidden_size: int = 1536
    projection_intermediate_size: int = 10240
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 10.0
    attention_bias: bool = True
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.hidden_act != "silu":
            raise CheckpointError(f"vision_config: hidden_act {self.hidden_act!r} is not supported; "
                                  "ouro's clamped SwiGLU uses silu")
        for name in ("patch_size", "temporal_patch_size", "spatial_merge_size"):
            if not _is_int(getattr(self, name)):
                raise CheckpointError(f"vision_config: {name} must be one integer, got {getattr(self, name)!r}")
        # the axial rope splits each head into (h, w) x (cos pair) quarters
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise CheckpointError(f"vision_config: hidden_size {self.hidden_size} / num_heads {self.num_heads} "
                                  "must be a head size divisible by 4")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch (a row of `pixel_values`)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_hf(cls, d: dict) -> "VisionConfig":
        """From a checkpoint's `vision_config` (transformers' aliases and rope spellings accepted)."""
        d = dict(d)
        for alias, name in (("num_attention_heads", "num_heads"), ("num_hidden_layers", "depth")):
            if alias in d:
                d.setdefault(name, d.pop(alias))
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise CheckpointError(f"vision_config: rope_type {rope['rope_type']!r} is not supported (axial only)")
        theta = rope.get("rope_theta", d.get("rope_theta"))
        names = {f.name for f in dataclasses.fields(cls)} - {"rope_theta"}
        kw = {k: v for k, v in d.items() if k in names}
        return cls(**kw, **({} if theta is None else {"rope_theta": float(theta)}))

    def to_hf_dict(self) -> dict:
        d = dataclasses.asdict(self)
        theta = d.pop("rope_theta")
        return dict(d, model_type="glm5_next_vision", rope_parameters={"rope_theta": theta, "rope_type": "axial"})


KV_GROUP = 128                      # values per scale in a quantised cache row (ops/quant/kv_rows.py)
KV_QUANTISED = ("fp8_e4m3", "int8")
KV_DTYPES = ("auto", "bfloat16", "bf16", "float32", "float16") + KV_QUANTISED


def quantised_row_bytes(d: int) -> int:
    """A quantised cache row of d values: d value bytes and one float32 scale per KV_GROUP values."""
    return d + 4 * -(-d // KV_GROUP)
