# Generated from configuration_dflash2.py by `python -m dflash2.generation.flat_code`; do not edit.
"""Configuration of DFlash 2 block drafters (and DFlash 1, the same model without convolutions and selector)."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
DFLASH1_ARCHITECTURE = "DFlashDraftModel"

# Keys the published checkpoints keep in their `dflash_config` sub-dict (read there first, then at the top level).
_PUBLISHED_DFLASH_KEYS = (
    "block_size",
    "target_layer_ids",
    "num_target_layers",
    "mask_token_id",
    "mask_token",  # a token string some configs give instead of the id (SGLang resolves it with the tokenizer)
    "input_embedding_scale",
    "output_multiplier",
    "final_logit_softcapping",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
)
_PUBLISHED_DEFAULT_BLOCK_SIZE = 16
_QWEN3_DEFAULT_MAX_WINDOW_LAYERS = 28  # transformers' Qwen3Config default, used when a config gives no layer_types

# Published-dialect keys that switch on something dflash2 does not implement: (where, key, is it on?, what it is).
_UNSUPPORTED_PUBLISHED_FEATURES = (
    ("dflash_config", "attention_sink_bias", bool, "a per-head attention sink bias"),
    ("top", "add_swa_attention_sink_bias", bool, "a per-head attention sink bias"),
    ("dflash_config", "sample_from_anchor", bool, "drafting from the anchor row"),
    ("dflash_config", "projector_type", lambda v: v is not None, "another draft head (projector_type)"),
    ("dflash_config", "attention_value_scale", lambda v: v is not None, "a value scale in attention"),
    ("dflash_config", "use_aux_hidden_state", lambda v: v is False, "no target features (use_aux_hidden_state false)"),
    ("top", "use_aux_hidden_state", lambda v: v is False, "no target features (use_aux_hidden_state false)"),
    ("top", "is_neox_style", lambda v: v is False, "interleaved RoPE (is_neox_style false)"),
    ("top", "rope_is_neox_style", lambda v: v is False, "interleaved RoPE (rope_is_neox_style false)"),
    ("top", "has_embed_tokens", bool, "its own token embeddings"),
    ("top", "has_lm_head", bool, "its own LM head"),
)
# Every tensor name a DFlash 1 / DFlash 2 drafter of ours holds (the published names).
_OUR_TENSOR_NAME = re.compile(
    r"(fc\.weight|hidden_norm\.weight|norm\.weight"
    r"|candidate_selector\.(hidden_projection\.weight|predecessor_codebook|successor_codebook)"
    r"|layers\.\d+\.(self_attn\.[qkvo]_proj\.(weight|bias)|self_attn\.[qk]_norm\.weight"
    r"|mlp\.(gate|up|down)_proj\.weight|input_layernorm\.weight|post_attention_layernorm\.weight"
    r"|(attention|mlp)_conv\.(base_kernel|kernel_projection\.weight)))"
    r"|(.*\.)?rotary_emb\.inv_freq")  # saved by some older checkpoints; recomputed from the config, safe to drop


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Spread `num_taps` taps from layer 1 to layer L-3 of an L-layer target (one tap: the middle layer)."""
    if num_taps == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_taps - 1))) for i in range(num_taps)]


def most_tree_nodes(block_size: int, tree_width: int, top_k: int) -> int:
    """The most nodes a tree can have: the root and, at each of the block_size - 1 depths, a beam of tree_width nodes
    (at most top_k, the candidates of a row)."""
    return 1 + (block_size - 1) * min(tree_width, top_k)


def tree_nodes_problem(tree_nodes, config) -> str | None:
    """Why `tree_nodes` does not suit this drafter's config, or None."""
    most = most_tree_nodes(config.block_size, config.tree_width, config.selector_top_k)
    if isinstance(tree_nodes, int) and (tree_nodes == 0 or 2 <= tree_nodes <= most):
        return None
    return (f"tree_nodes={tree_nodes!r}; use 0 (verify one path) or 2 .. {most} (the root and up to block_size - 1 = "
            f"{config.block_size - 1} depths of tree_width = {min(config.tree_width, config.selector_top_k)} nodes).")


class DFlash2Config(PretrainedConfig):
    r"""
    Configuration of a DFlash 2 drafter: a small non-causal Qwen3-style stack that reads the fused hidden states of
    several target layers and drafts a block `[anchor, MASK x (block_size - 1)]` in one pass.

    `dflash_version=1` gives the DFlash 1 layout (no dynamic convolutions, no candidate selector).
    The target's embeddings and LM head are borrowed at run time; `target_hidden_size`, `num_target_layers` and
    `vocab_size` describe the target they must come from.
    """

    model_type = "dflash2"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        hidden_size: int = 1024,
        num_hidden_layers: int = 3,
        num_attention_heads: int = 16,
        num_key_value_heads: int = 8,
        head_dim: int | None = None,
        intermediate_size: int = 3072,
        hidden_act: str = "silu",
        rope_parameters: dict | None = None,
        max_position_embeddings: int = 32768,
        rms_norm_eps: float = 1e-6,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        is_causal: bool | None = False,
        initializer_range: float = 0.02,
        # link to the target
        target_layer_ids: list[int] | None = None,
        num_target_layers: int | None = None,
        target_hidden_size: int | None = None,
        vocab_size: int = 32000,
        mask_token_id: int | None = None,
        target_name_or_path: str | None = None,
        target_gguf_file: str | None = None,
        # DFlash 2
        dflash_version: int = 2,
        block_size: int = 8,
        conv_kernel_size: int = 2,
        conv_group_size: int = 16,
        selector_rank: int = 64,
        selector_top_k: int = 16,
        output_multiplier: float = 1.0,
        final_logit_softcapping: float | None = None,
        input_embedding_scale: float = 1.0,
        # serving
        max_speculative_batch_size: int | None = None,
        tree_nodes: int = 0,
        tree_width: int = 4,
        **kwargs,
    ):
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // max(num_attention_heads, 1)
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.rope_parameters = _rope_parameters(rope_parameters, kwargs.pop("rope_theta", None),
                                                kwargs.pop("rope_scaling", None))
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.layer_types = list(layer_types) if layer_types is not None else ["full_attention"] * num_hidden_layers
        self.sliding_window = sliding_window
        self.is_causal = is_causal
        self.initializer_range = initializer_range

        self.num_target_layers = num_target_layers
        self.target_hidden_size = target_hidden_size if target_hidden_size is not None else hidden_size
        if target_layer_ids is None and num_target_layers is not None:
            target_layer_ids = default_target_layer_ids(num_target_layers, min(5, num_target_layers))
        self.target_layer_ids = list(target_layer_ids) if target_layer_ids is not None else [0]
        self.vocab_size = vocab_size
        self.mask_token_id = mask_token_id
        self.target_name_or_path = target_name_or_path
        self.target_gguf_file = target_gguf_file

        self.dflash_version = dflash_version
        self.block_size = block_size
        self.conv_kernel_size = conv_kernel_size
        self.conv_group_size = conv_group_size
        self.selector_rank = selector_rank
        self.selector_top_k = selector_top_k
        self.output_multiplier = output_multiplier
        self.final_logit_softcapping = final_logit_softcapping
        self.input_embedding_scale = input_embedding_scale
        # batches larger than this decode without speculation (with a warning); None: the measured default per device
        self.max_speculative_batch_size = max_speculative_batch_size
        # DFlash 2's own loop, greedy and sampled: verify a tree of this many nodes (root included) drafted by a beam
        # of `tree_width` over the candidates, instead of one path (0); `generate(..., tree_nodes=N)` overrides it
        self.tree_nodes = tree_nodes
        self.tree_width = tree_width
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        self.check()

    # ------------------------------------------------------------------ validation
    def check(self) -> None:
        """Raise one clear ValueError for the first inconsistent field."""
        problems = list(self._problems())
        if problems:
            raise ValueError(f"Invalid DFlash2Config: {problems[0]}")

    def _problems(self):
        if self.dflash_version not in (1, 2):
            yield f"dflash_version={self.dflash_version}; use 1 (DFlash 1) or 2 (DFlash 2)."
        if self.block_size < 2:
            yield f"block_size={self.block_size}; a block needs the anchor plus at least one mask, use >= 2."
        if self.num_attention_heads % self.num_key_value_heads:
            yield (
                f"num_key_value_heads={self.num_key_value_heads} does not divide num_attention_heads="
                f"{self.num_attention_heads}; pick a divisor for grouped-query attention."
            )
        if len(self.layer_types) != self.num_hidden_layers:
            yield f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers; give one per layer."
        bad_types = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if bad_types:
            yield f"unknown layer_types {bad_types}; use 'full_attention' or 'sliding_attention'."
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            yield "a 'sliding_attention' layer needs sliding_window; set it or use 'full_attention'."
        if not self.target_layer_ids:
            yield "target_layer_ids is empty; list at least one target decoder layer to read."
        if self.num_target_layers is not None:
            out = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
            if out:
                yield (
                    f"target_layer_ids {out} out of range for a target of num_target_layers={self.num_target_layers}"
                    f" (valid: 0..{self.num_target_layers - 1})."
                )
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            yield f"mask_token_id={self.mask_token_id} is outside the vocabulary (vocab_size={self.vocab_size})."
        if self.dflash_version == 2:
            if self.conv_kernel_size < 1:
                yield f"conv_kernel_size={self.conv_kernel_size}; use >= 1 taps (2 in the published checkpoints)."
            if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
                yield (
                    f"hidden_size={self.hidden_size} is not divisible by conv_group_size={self.conv_group_size}; "
                    "choose a group size that divides the hidden size."
                )
            if self.selector_rank < 1:
                yield f"selector_rank={self.selector_rank}; use >= 1."
            if not 1 <= self.selector_top_k <= self.vocab_size:
                yield f"selector_top_k={self.selector_top_k} must be between 1 and vocab_size={self.vocab_size}."
        limit = self.max_speculative_batch_size
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            yield f"max_speculative_batch_size={limit!r}; use a positive integer, or None for the measured default."
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            yield f"final_logit_softcapping={self.final_logit_softcapping}; use a positive cap or None."
        if not isinstance(self.tree_width, int) or self.tree_width < 1:
            yield f"tree_width={self.tree_width!r}; use a positive integer (nodes kept per depth while drafting a tree)."
        else:
            problem = tree_nodes_problem(self.tree_nodes, self)
            if problem:
                yield problem

    @property
    def uses_conv_and_selector(self) -> bool:
        return self.dflash_version == 2

    @property
    def num_target_taps(self) -> int:
        return len(self.target_layer_ids)

    # ------------------------------------------------------------------ published dialects
    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if is_published_config(config_dict) and Path(str(pretrained_model_name_or_path)).is_dir():
            check_published_tensors(Path(str(pretrained_model_name_or_path)))
        return convert_published_config(config_dict), kwargs

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs):
        return super().from_dict(convert_published_config(config_dict), **kwargs)

    # ------------------------------------------------------------------ building for a target
    @classmethod
    def for_target(cls, target_config, **overrides) -> "DFlash2Config":
        """A drafter config that fits the HF causal LM `target_config` (sizes, vocab, special ids, taps).

        The drafter mirrors the target's attention geometry; `overrides` set any field (e.g. `num_hidden_layers=3`).
        A target without a spare token for MASK gets the pad token, else the last vocabulary id, as mask.
        """
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        num_layers = text.num_hidden_layers
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        rope = getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
        fields = dict(
            hidden_size=text.hidden_size,
            num_hidden_layers=3,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=text.intermediate_size,
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            rope_parameters={"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)},
            max_position_embeddings=getattr(text, "max_position_embeddings", 32768),
            num_target_layers=num_layers,
            target_hidden_size=text.hidden_size,
            target_layer_ids=default_target_layer_ids(num_layers, min(5, num_layers)),
            vocab_size=text.vocab_size,
            mask_token_id=_pick_mask_token(text),
            bos_token_id=_first_id(getattr(text, "bos_token_id", None)),
            eos_token_id=getattr(text, "eos_token_id", None),
            pad_token_id=getattr(text, "pad_token_id", None),
            target_name_or_path=getattr(target_config, "_name_or_path", None) or None,
        )
        fields.update(overrides)
        if "num_hidden_layers" in overrides and "layer_types" not in overrides:
            fields["layer_types"] = None
        group = fields.get("conv_group_size", 16)
        if fields["hidden_size"] % group:
            fields["conv_group_size"] = math.gcd(fields["hidden_size"], group)
        return cls(**fields)

    def check_target(self, target_config) -> None:
        """Raise one clear ValueError if this drafter cannot read `target_config`'s hidden states and vocabulary."""
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        if text.vocab_size != self.vocab_size:
            raise ValueError(
                f"Vocabulary mismatch: the drafter was built for vocab_size={self.vocab_size}, the target has "
                f"{text.vocab_size}. Use a drafter trained for this target (DFlash2Config.for_target)."
            )
        if text.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"Hidden-size mismatch: the drafter reads target features of size {self.target_hidden_size}, the "
                f"target's hidden size is {text.hidden_size}. Use a drafter trained for this target."
            )
        deepest = max(self.target_layer_ids)
        if deepest >= text.num_hidden_layers:
            raise ValueError(
                f"The drafter reads target layer {deepest} (target_layer_ids={self.target_layer_ids}) but the target "
                f"has only {text.num_hidden_layers} layers. Use a drafter trained for this target."
            )
        if self.mask_token_id is None:
            mask_token = getattr(self, "mask_token", None)
            named = f" (its config names the token {mask_token!r}: tokenizer.convert_tokens_to_ids of it)" if (
                mask_token) else ""
            raise ValueError(
                "The drafter's config gives no mask_token_id, the token that fills a block after the anchor. Set "
                f"drafter.config.mask_token_id to the id it was trained with{named}."
            )


def _first_id(token_id):
    return token_id[0] if isinstance(token_id, (list, tuple)) and token_id else token_id


def _pick_mask_token(text_config) -> int:
    pad = _first_id(getattr(text_config, "pad_token_id", None))
    return pad if pad is not None else text_config.vocab_size - 1


def _rope_parameters(rope_parameters, rope_theta=None, rope_scaling=None) -> dict:
    """RoPE settings as transformers 5 writes them; older configs give `rope_theta` (and `rope_scaling`) instead."""
    params = dict(rope_parameters) if rope_parameters else {}
    if rope_scaling and not rope_parameters:
        params.update({k: v for k, v in rope_scaling.items() if k != "type"})
        params.setdefault("rope_type", rope_scaling.get("type", "default"))
    if rope_theta is not None:
        params.setdefault("rope_theta", rope_theta)
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", 1e6)
    return params


def is_published_config(config_dict: dict[str, Any]) -> bool:
    """The published checkpoints' dialect: a DFlash architecture string, not our own `model_type`."""
    architectures = config_dict.get("architectures") or []
    return (config_dict.get("model_type") != DFlash2Config.model_type and "dflash_version" not in config_dict
            and (DFLASH2_ARCHITECTURE in architectures or DFLASH1_ARCHITECTURE in architectures))


def check_published_tensors(folder: Path) -> None:
    """Refuse a published folder whose weights hold tensors dflash2 would not load (its own LM head or embeddings, a
    separate mask embedding, a reduced-vocabulary map, other names): loading it would silently drop them or leave
    parts random, and the drafter would draft differently from how it was trained."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = set(json.loads(index.read_text())["weight_map"])
    else:
        names = set()
        for file in sorted(folder.glob("*.safetensors")):
            with open(file, "rb") as handle:
                header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
            names |= set(header) - {"__metadata__"}
    foreign = sorted(name for name in names if not _OUR_TENSOR_NAME.fullmatch(name))
    extra_files = [name for name in ("mask_embedding.pt",) if (folder / name).exists()]
    if foreign or extra_files:
        own = [n for n in foreign if "lm_head" in n or "embed_tokens" in n]
        what = ("its own LM head / token embeddings (dflash2 always uses the target's)" if own
                else "tensors under names dflash2 does not use")
        raise ValueError(
            f"The drafter in {folder} holds {what}: {(foreign + extra_files)[:8]}"
            f"{' ...' if len(foreign) + len(extra_files) > 8 else ''}. Loading it here would drop them or leave weights "
            "random, so the drafts would not be the trained drafter's. Serve it with an engine that reads them "
            "(see docs/serving.md), or remove them if they only repeat the target's weights.")


def _refuse_unsupported_features(published: dict[str, Any], sub: dict[str, Any]) -> None:
    for where, key, is_on, what in _UNSUPPORTED_PUBLISHED_FEATURES:
        source = sub if where == "dflash_config" else published
        if key in source and is_on(source[key]):
            raise ValueError(
                f"This published drafter uses {what} ({'dflash_config.' if where == 'dflash_config' else ''}{key}="
                f"{source[key]!r}), which dflash2 does not implement; its drafts here would differ from the trained "
                "drafter's. Serve it with vLLM or SGLang instead (docs/serving.md).")
    draft_vocab = published.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != published.get("vocab_size"):
        raise ValueError(f"This published drafter drafts over a reduced vocabulary (draft_vocab_size={draft_vocab}, "
                         f"vocab_size={published.get('vocab_size')}), which dflash2 does not implement.")


def _published_layer_types(published: dict[str, Any], sub: dict[str, Any]) -> tuple[list[str] | None, int | None]:
    """Layer types and window as the engines that serve published drafters read them: explicit `layer_types` win;
    without them transformers' Qwen3Config rule applies (layer i slides when use_sliding_window is set and
    i >= max_window_layers); `dflash_config.use_swa` makes every layer slide (window `swa_window_size`)."""
    num_layers = published.get("num_hidden_layers")
    layer_types = published.get("layer_types")
    window = published.get("sliding_window")
    if layer_types is None and num_layers is not None and published.get("use_sliding_window") and window is not None:
        first = published.get("max_window_layers", _QWEN3_DEFAULT_MAX_WINDOW_LAYERS)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if sub.get("use_swa") and num_layers is not None and "sliding_attention" not in (layer_types or []):
        layer_types = ["sliding_attention"] * num_layers
    if "sliding_attention" in (layer_types or []):
        window = sub.get("swa_window_size", window)
    # (Qwen3Config drops the window unless use_sliding_window is set; here it is kept: only sliding layers read it.)
    return (list(layer_types) if layer_types is not None else None), window


def convert_published_config(config_dict: dict[str, Any]) -> dict[str, Any]:
    """Translate a published DFlash checkpoint config (`model_type` "qwen3" + `dflash_config`) into ours.

    Our own configs pass through unchanged. The architecture string selects DFlash 2 (convolutions + selector) or
    DFlash 1; each DFlash key comes from `dflash_config`, then the top level, then its default. A config that switches
    on something dflash2 does not implement raises one ValueError that names it.
    """
    # ours, or already converted (from_pretrained converts in get_config_dict, then again in from_dict)
    if not is_published_config(config_dict):
        return config_dict
    architectures = config_dict.get("architectures") or []
    published = copy.deepcopy(config_dict)
    sub = published.pop("dflash_config", None) or {}
    _refuse_unsupported_features(published, sub)
    dropped = ("model_type", "use_sliding_window", "max_window_layers", "rope_theta", "rope_scaling")
    out = {k: v for k, v in published.items() if k not in dropped}
    for key in _PUBLISHED_DFLASH_KEYS:
        if key in sub:
            out[key] = sub[key]
    is_v2 = DFLASH2_ARCHITECTURE in architectures
    out["dflash_version"] = 2 if is_v2 else 1
    out.setdefault("block_size", _PUBLISHED_DEFAULT_BLOCK_SIZE)
    if is_v2:
        missing = [k for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k") if k not in out]
        if missing:
            raise ValueError(f"Published DFlash 2 config lacks {missing} (in dflash_config or at the top level).")
    if "target_layer_ids" not in out:
        if out.get("num_target_layers") is None:
            raise ValueError("Published DFlash config gives neither target_layer_ids nor num_target_layers.")
        out["target_layer_ids"] = default_target_layer_ids(out["num_target_layers"], out.get("num_hidden_layers", 1))
    out["rope_parameters"] = _rope_parameters(published.get("rope_parameters"), published.get("rope_theta"),
                                              published.get("rope_scaling"))
    layer_types, window = _published_layer_types(published, sub)
    if layer_types is not None:
        out["layer_types"] = layer_types
    out["sliding_window"] = window
    # Causality: a top-level is_causal decides; else dflash_config.causal (vLLM's reading); else None, i.e. sliding
    # layers are causal and full-attention layers are not (the reference implementation's rule).
    if "is_causal" not in out:
        out["is_causal"] = sub.get("causal")
    # Published drafters read features of the target's width, which equals theirs.
    out.setdefault("target_hidden_size", out.get("hidden_size"))
    out["architectures"] = [DFLASH2_ARCHITECTURE]
    return out
