"""Published checkpoints (DFlash 1 and DFlash 2) load through every path, what does not fit is refused clearly, and
a drafter exported in the published format round-trips.

Tiny published folders are built from the published config files (tests/fixtures) with small sizes, and safetensors
whose tensor names come from the published tensor table and whose shapes come from the architecture's formulas (the
formulas are first checked against the real-size table).
"""

import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, LlamaConfig, LlamaForCausalLM, Qwen3Config

from dflash2.configuration_dflash2 import DFlash2Config
from dflash2.generation import DFlash2Drafter
from dflash2.generation.export import write_code_files
from dflash2.generation.published import export_published, main, published_config_dict, serving_commands
from dflash2.generation.transformers_patches import assisted_loop_rolls_state_back
from dflash2.modeling_dflash2 import DFlash2DraftModel
from helpers import VOCAB, tiny_drafter, tiny_target

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PUBLISHED = {2: json.loads((FIXTURES / "published-dflash2" / "config.json").read_text()),
             1: json.loads((FIXTURES / "published-dflash1" / "config.json").read_text())}
REFERENCE_TENSORS = json.loads((FIXTURES / "published-dflash2" / "tensor-shapes.json").read_text())["tensors"]
V2_ONLY = ("attention_conv", "mlp_conv", "candidate_selector")
LOADERS = ["DFlash2DraftModel", "DFlash2Drafter", "AutoModel"]


# ------------------------------------------------------------------------------------------------ published layout
def published_shapes(config: dict) -> dict[str, list[int]]:
    """Tensor names of a published checkpoint with this config: the published table's shared names and its layer-0
    names repeated per layer (DFlash 1: without convolutions and selector); shapes from the architecture's formulas."""
    sub = config.get("dflash_config", {})
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    version = 2 if "DFlash2DraftModel" in config["architectures"] else 1
    shapes = {
        "fc.weight": [hidden, len(sub["target_layer_ids"]) * config.get("target_hidden_size", hidden)],
        "hidden_norm.weight": [hidden], "norm.weight": [hidden],
        "self_attn.q_proj.weight": [heads * head_dim, hidden], "self_attn.k_proj.weight": [kv * head_dim, hidden],
        "self_attn.v_proj.weight": [kv * head_dim, hidden], "self_attn.o_proj.weight": [hidden, heads * head_dim],
        "self_attn.q_norm.weight": [head_dim], "self_attn.k_norm.weight": [head_dim],
        "mlp.gate_proj.weight": [inter, hidden], "mlp.up_proj.weight": [inter, hidden],
        "mlp.down_proj.weight": [hidden, inter],
        "input_layernorm.weight": [hidden], "post_attention_layernorm.weight": [hidden],
    }
    if version == 2:
        taps, groups, rank = sub["conv_kernel_size"], hidden // sub["conv_group_size"], sub["selector_rank"]
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"{conv}.base_kernel"] = [2, taps, hidden]
            shapes[f"{conv}.kernel_projection.weight"] = [2 * taps * groups, hidden]
        shapes["candidate_selector.hidden_projection.weight"] = [rank, hidden]
        shapes["candidate_selector.predecessor_codebook"] = [config["vocab_size"], rank]
        shapes["candidate_selector.successor_codebook"] = [config["vocab_size"], rank]
    out = {}
    for name in REFERENCE_TENSORS:
        if version == 1 and any(part in name for part in V2_ONLY):
            continue
        if name.startswith("layers.0."):
            for layer in range(config["num_hidden_layers"]):
                out[f"layers.{layer}.{name[len('layers.0.'):]}"] = shapes[name[len("layers.0."):]]
        elif not name.startswith("layers."):
            out[name] = shapes[name]
    return out


def tiny_published_config(version: int, **overrides) -> dict:
    """The published config file of that version with tiny sizes (same keys, same dialect)."""
    config = json.loads(json.dumps(PUBLISHED[version]))
    config.update(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=VOCAB, num_target_layers=6, bos_token_id=1, eos_token_id=3, pad_token_id=0)
    config["dflash_config"].update(target_layer_ids=[0, 2, 4], mask_token_id=VOCAB - 1, block_size=4)
    if version == 2:
        config["dflash_config"].update(selector_rank=8, selector_top_k=8)
        config["sliding_window"] = 3
    config.update(overrides)
    return config


def write_published_folder(folder: Path, config: dict, extra_tensors=None, seed: int = 0) -> dict:
    """A published-format folder: config.json and model.safetensors (bf16, like the published files)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: (0.1 * torch.randn(shape, generator=generator)).to(torch.bfloat16)
               for name, shape in published_shapes(config).items()}
    tensors.update(extra_tensors or {})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return tensors


def with_our_code(folder: Path, target: Path) -> Path:
    """The same folder plus our remote-code files and an auto_map pointing at our classes (trust_remote_code)."""
    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_dflash2.DFlash2Config", "AutoModel": "drafter.DFlash2Drafter"}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    write_code_files(target)
    return target


def load(loader: str, folder: Path, **kwargs):
    if loader == "AutoModel":
        return AutoModel.from_pretrained(folder, trust_remote_code=True, **kwargs)
    return {"DFlash2DraftModel": DFlash2DraftModel, "DFlash2Drafter": DFlash2Drafter}[loader].from_pretrained(
        folder, **kwargs)


def test_formulas_reproduce_the_published_tensor_table():
    assert published_shapes(PUBLISHED[2]) == REFERENCE_TENSORS and len(REFERENCE_TENSORS) == 81
    dflash1 = published_shapes(PUBLISHED[1])
    assert len(dflash1) == 58 and all(REFERENCE_TENSORS[name] == shape for name, shape in dflash1.items())


# ------------------------------------------------------------------------------------------------ real-size configs
@pytest.mark.parametrize("version", [1, 2])
def test_real_size_published_configs_load_and_build_the_published_layout(version, tmp_path):
    folder = tmp_path / "published"
    folder.mkdir()
    shutil.copyfile(FIXTURES / f"published-dflash{version}" / "config.json", folder / "config.json")
    from_folder = DFlash2Config.from_pretrained(folder)
    from_dict = DFlash2Config.from_dict(PUBLISHED[version])
    assert from_folder.to_dict() | {"_name_or_path": ""} == from_dict.to_dict() | {"_name_or_path": ""}
    assert from_folder.dflash_version == version and from_folder.block_size == 16
    with torch.device("meta"):
        model = DFlash2DraftModel(from_folder)
    ours = {name: list(tensor.shape) for name, tensor in model.state_dict().items()}
    assert ours == published_shapes(PUBLISHED[version])


# ------------------------------------------------------------------------------------------------ every load path
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("version", [1, 2])
def test_published_folder_loads_through_every_path(version, tied, tmp_path):
    config = tiny_published_config(version, tie_word_embeddings=tied)
    tensors = write_published_folder(tmp_path / "published", config)
    remote = with_our_code(tmp_path / "published", tmp_path / "with-code")

    from_folder = DFlash2Config.from_pretrained(tmp_path / "published")
    assert from_folder.to_dict() | {"_name_or_path": ""} == DFlash2Config.from_dict(config).to_dict() | {
        "_name_or_path": ""}
    auto_config = AutoConfig.from_pretrained(remote, trust_remote_code=True)
    assert auto_config.model_type == "dflash2" and auto_config.dflash_version == version
    sub = config["dflash_config"]
    expected = dict(dflash_version=version, block_size=4, mask_token_id=VOCAB - 1, target_layer_ids=[0, 2, 4],
                    layer_types=config["layer_types"], is_causal=False, target_hidden_size=64,
                    rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    if version == 2:
        expected.update(sliding_window=3, conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=8,
                        output_multiplier=sub["output_multiplier"], final_logit_softcapping=20.0)
    for config_object in (from_folder, auto_config):
        assert {name: getattr(config_object, name) for name in expected} == expected

    for loader in LOADERS:
        folder = remote if loader == "AutoModel" else tmp_path / "published"
        model, info = load(loader, folder, output_loading_info=True)
        assert not any(info.values()), (loader, info)  # nothing missing, unexpected or mismatched
        state = model.state_dict()
        assert set(state) == set(tensors) and model.dtype == torch.bfloat16, loader  # the config's dtype
        assert all(torch.equal(state[name], tensors[name]) for name in tensors), loader
        assert not any("lm_head" in n or "embed" in n for n in state), loader
        for layer, kind in zip(model.layers, config["layer_types"]):  # published causality: is_causal false
            assert layer.self_attn.is_causal is False
            assert layer.self_attn.sliding_window == (3 if kind == "sliding_attention" else None)


@pytest.mark.parametrize("tied", [False, True], ids=["untied-target", "tied-target"])
def test_loaded_published_drafter_decodes_losslessly_with_tied_or_untied_target_heads(tied, tmp_path):
    """The drafter has no head of its own: it borrows the target's LM head whether the target ties it to the
    embeddings or not."""
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                          num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=3,
                                          pad_token_id=0, tie_word_embeddings=tied)).eval()
    assert (target.get_output_embeddings().weight is target.get_input_embeddings().weight) == tied
    write_published_folder(tmp_path / "published", tiny_published_config(2, tie_word_embeddings=tied))
    drafter = DFlash2Drafter.from_pretrained(tmp_path / "published", dtype=torch.float32).attach(target)
    ids = torch.tensor([[5, 9, 14, 20, 7, 31]])
    plain = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16)
    for extra in ({}, {"cache_implementation": "static"}):
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                              assistant_model=drafter, **extra)
        assert torch.equal(out, plain), extra
    assert drafter.is_bound_to(target)


# ------------------------------------------------------------------------------------------------ dialect rules
def test_layer_types_without_a_list_follow_qwen3s_rule():
    base = tiny_published_config(2)
    del base["layer_types"]
    config = DFlash2Config.from_dict({**base, "use_sliding_window": True, "max_window_layers": 3, "sliding_window": 4})
    assert config.layer_types == ["full_attention"] * 3 + ["sliding_attention"] * 2 and config.sliding_window == 4
    config = DFlash2Config.from_dict({**base, "use_sliding_window": False})
    assert config.layer_types == ["full_attention"] * 5
    swa = {**base, "dflash_config": {**base["dflash_config"], "use_swa": True, "swa_window_size": 7}}
    config = DFlash2Config.from_dict(swa)
    assert config.layer_types == ["sliding_attention"] * 5 and config.sliding_window == 7


def test_causality_rules():
    base = tiny_published_config(2, layer_types=["sliding_attention", "full_attention"] * 2 + ["full_attention"])
    del base["is_causal"]
    default = DFlash2DraftModel(DFlash2Config.from_dict(base))  # no is_causal: sliding causal, full not
    assert [layer.self_attn.is_causal for layer in default.layers] == [True, False, True, False, False]
    vllm_style = {**base, "dflash_config": {**base["dflash_config"], "causal": True}}
    assert DFlash2Config.from_dict(vllm_style).is_causal is True
    assert DFlash2Config.from_dict({**vllm_style, "is_causal": False}).is_causal is False  # top level decides


def test_rope_theta_is_never_dropped():
    assert DFlash2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         rope_theta=5e5).rope_parameters["rope_theta"] == 5e5
    older = tiny_published_config(1)
    del older["rope_parameters"]
    assert DFlash2Config.from_dict({**older, "rope_theta": 2.5e5}).rope_parameters == {"rope_type": "default",
                                                                                      "rope_theta": 2.5e5}


UNSUPPORTED = [
    ({"dflash_config": {"attention_sink_bias": True}}, "attention sink bias"),
    ({"dflash_config": {"sample_from_anchor": True}}, "drafting from the anchor row"),
    ({"dflash_config": {"projector_type": "domino"}}, "another draft head"),
    ({"dflash_config": {"use_aux_hidden_state": False}}, "no target features"),
    ({"is_neox_style": False}, "interleaved RoPE"),
    ({"has_lm_head": True}, "its own LM head"),
    ({"draft_vocab_size": 32}, "reduced vocabulary"),
]


@pytest.mark.parametrize("change,message", UNSUPPORTED, ids=[m for _, m in UNSUPPORTED])
def test_published_features_we_do_not_implement_are_refused(change, message):
    config = tiny_published_config(2)
    config["dflash_config"].update(change.pop("dflash_config", {}))
    config.update(change)
    with pytest.raises(ValueError, match=message):
        DFlash2Config.from_dict(config)


@pytest.mark.parametrize("extra,message", [
    ({"lm_head.weight": torch.zeros(VOCAB, 64)}, "its own LM head / token embeddings"),
    ({"embed_tokens.weight": torch.zeros(VOCAB, 64)}, "its own LM head / token embeddings"),
    ({"model.layers.0.extra.weight": torch.zeros(4)}, "names dflash2 does not use"),
], ids=["lm_head", "embed_tokens", "other-name"])
def test_published_folders_with_tensors_we_would_drop_are_refused_on_every_path(extra, message, tmp_path):
    write_published_folder(tmp_path / "published", tiny_published_config(2), extra_tensors=extra)
    remote = with_our_code(tmp_path / "published", tmp_path / "with-code")
    with pytest.raises(ValueError, match=message):
        DFlash2Config.from_pretrained(tmp_path / "published")
    for loader in LOADERS:
        with pytest.raises(ValueError, match=message):
            load(loader, remote if loader == "AutoModel" else tmp_path / "published")


def test_a_saved_rotary_buffer_is_not_refused(tmp_path):
    """Older checkpoints may hold `rotary_emb.inv_freq`; it is recomputed from the config, dropping it changes nothing."""
    tensors = write_published_folder(tmp_path / "published", tiny_published_config(2),
                                     extra_tensors={"rotary_emb.inv_freq": torch.ones(8)})
    model = DFlash2DraftModel.from_pretrained(tmp_path / "published")
    assert all(torch.equal(t, tensors[n]) for n, t in model.state_dict().items())


def test_a_separate_mask_embedding_file_is_refused(tmp_path):
    write_published_folder(tmp_path / "published", tiny_published_config(2))
    torch.save(torch.zeros(64), tmp_path / "published" / "mask_embedding.pt")
    with pytest.raises(ValueError, match="mask_embedding.pt"):
        DFlash2DraftModel.from_pretrained(tmp_path / "published")


# ------------------------------------------------------------------------------------------------ export
CONFIG_FIELDS = [name for name in inspect.signature(DFlash2Config.__init__).parameters
                 if name not in ("self", "kwargs")] + ["bos_token_id", "eos_token_id", "pad_token_id",
                                                       "tie_word_embeddings"]
V2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def config_fields(config):
    skip = () if config.dflash_version == 2 else V2_FIELDS  # a DFlash 1 drafter has no convolutions nor selector
    return {name: getattr(config, name) for name in CONFIG_FIELDS if name not in skip}


EXPORT_CASES = [
    (2, torch.float32, None), (2, torch.bfloat16, False), (1, torch.float32, False), (1, torch.bfloat16, None),
]


@pytest.mark.filterwarnings("ignore:Published export:UserWarning")
@pytest.mark.parametrize("version,dtype,is_causal", EXPORT_CASES,
                         ids=[f"dflash{v}-{str(d)[6:]}-causal{c}" for v, d, c in EXPORT_CASES])
def test_export_in_published_format_round_trips(version, dtype, is_causal, tmp_path):
    target = tiny_target("qwen3")
    extra = dict(output_multiplier=0.5, final_logit_softcapping=20.0, input_embedding_scale=1.5) if version == 2 else {}
    drafter = tiny_drafter(target, version=version, num_hidden_layers=3, is_causal=is_causal, sliding_window=3,
                           layer_types=["full_attention", "sliding_attention", "sliding_attention"], **extra)
    out = export_published(drafter, tmp_path / "out", dtype=dtype)

    written = json.loads((out / "config.json").read_text())
    reference = PUBLISHED[version]
    assert written["model_type"] == "qwen3" and "auto_map" not in written
    assert written["architectures"] == [reference["architectures"][0]]
    assert set(reference) - set(written) <= {"is_causal"} and ("is_causal" in written) == (is_causal is not None)
    assert set(reference["dflash_config"]) - {"final_logit_softcapping"} <= set(written["dflash_config"])
    assert not [p for p in out.iterdir() if p.suffix == ".py"]
    files = load_file(out / "model.safetensors")
    assert {name: list(t.shape) for name, t in files.items()} == published_shapes(written)
    assert all(t.dtype == dtype for t in files.values())

    # what transformers' Qwen3Config (the engines' config class) reads back
    qwen3 = Qwen3Config.from_pretrained(out)
    assert qwen3.layer_types == drafter.config.layer_types and qwen3.sliding_window == 3
    assert getattr(qwen3, "is_causal", None) == is_causal and qwen3.dflash_config == written["dflash_config"]

    for loader in ("DFlash2DraftModel", "DFlash2Drafter"):
        loaded = load(loader, out)
        assert config_fields(loaded.config) == config_fields(drafter.config), loader
        assert loaded.dtype == dtype
        original = drafter.state_dict()
        assert all(torch.equal(tensor, original[name].to(dtype)) for name, tensor in loaded.state_dict().items())
    again = export_published(loaded, tmp_path / "again")  # idempotent: the same files again
    assert (again / "config.json").read_text() == (out / "config.json").read_text()
    assert all(torch.equal(files[name], tensor) for name, tensor in load_file(again / "model.safetensors").items())

    if dtype == torch.float32:  # and the loaded drafter drafts exactly like the original
        drafter.bind_target(target), loaded.bind_target(target)
        features = torch.randn(1, 9, 3 * 64)
        block = torch.tensor([[5] + [drafter.config.mask_token_id] * 3])
        first = drafter(input_ids=block, context_hidden_states=features).last_hidden_state
        second = loaded(input_ids=block, context_hidden_states=features).last_hidden_state
        assert torch.equal(first, second)
        assert torch.equal(drafter.propose(block[:, 0], first).tokens, loaded.propose(block[:, 0], second).tokens)


def test_export_is_sharded_when_asked(tmp_path):
    drafter = tiny_drafter(tiny_target("qwen3"))
    out = export_published(drafter, tmp_path / "out", max_shard_size="40KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(drafter.state_dict())
    loaded = DFlash2DraftModel.from_pretrained(out)
    assert all(torch.equal(t, drafter.state_dict()[n]) for n, t in loaded.state_dict().items())


def test_export_refuses_a_config_without_mask_token_and_warns_what_engines_would_not_apply(tmp_path):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    drafter.config.mask_token_id = None
    with pytest.raises(ValueError, match="no mask_token_id"):
        published_config_dict(drafter.config)
    dflash1 = tiny_drafter(target, version=1, output_multiplier=0.5)
    with pytest.warns(UserWarning, match="DFlash 1 path applies none of them"):
        export_published(dflash1, tmp_path / "v1")
    mixed = tiny_drafter(target, layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    with pytest.warns(UserWarning, match="VLLM_USE_V2_MODEL_RUNNER"):
        export_published(mixed, tmp_path / "mixed")


def test_command_line_export_and_serving_commands(tmp_path, capsys):
    drafter = tiny_drafter(tiny_target("qwen3"), block_size=8)
    drafter.save_pretrained(tmp_path / "ours")  # our own folder format (remote code, auto_map)
    main([str(tmp_path / "ours"), str(tmp_path / "published"), "--dtype", "float32"])
    printed = capsys.readouterr().out
    commands = serving_commands(tmp_path / "published", target="Org/Target")
    spec = json.loads(commands["vllm"].split("--speculative-config '")[1].rstrip("'"))
    assert spec == {"method": "dflash", "model": str(tmp_path / "published"), "num_speculative_tokens": 7}
    assert "--speculative-algorithm DFLASH" in commands["sglang"] and "vllm serve" in printed
    loaded = DFlash2Drafter.from_pretrained(tmp_path / "published")
    assert config_fields(loaded.config) == config_fields(drafter.config)
    assert all(torch.equal(t, drafter.state_dict()[n]) for n, t in loaded.state_dict().items())


# ------------------------------------------------------------------------------------------------ what does not fit
def tiny_linear_attention_target():
    """A tiny hybrid target (Qwen3-Next: linear-attention layers with a recurrent state, and full attention)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, bos_token_id=1, eos_token_id=3, pad_token_id=0,
        layer_types=["linear_attention"] * 3 + ["full_attention"])
    return Qwen3NextForCausalLM(config).eval()


def generate_each_loop(target, drafter, loop):
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 6, 7, 8, 9]])
    kwargs = dict(max_new_tokens=6, do_sample=False, assistant_model=drafter)
    if loop == "batched":
        return target.generate(ids, attention_mask=(ids > 0).long(), **kwargs)
    extra = {"cache_implementation": "static"} if loop == "static" else {}
    return target.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]), **kwargs, **extra)


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flex_attention"])
@pytest.mark.parametrize("loop", ["static", "batched"])
def test_own_loops_refuse_attention_implementations_without_explicit_masks(implementation, loop):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target).attach(target)
    target.config._attn_implementation = implementation
    with pytest.raises(ValueError, match=f"attn_implementation='{implementation}' does not take.*'sdpa'"):
        generate_each_loop(target, drafter, loop)


def test_the_assisted_loop_runs_a_target_the_own_loops_refuse_for_its_attention():
    """The refusal's advice holds: transformers' assisted loop takes a flex-attention target (CPU) and stays exact."""
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target).attach(target)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    target.config._attn_implementation = "flex_attention"
    assert torch.equal(generate_each_loop(target, drafter, "assisted"), plain)


@pytest.mark.parametrize("loop", ["static", "batched"])
def test_linear_attention_targets_are_refused_by_the_own_loops(loop):
    target = tiny_linear_attention_target()
    drafter = tiny_drafter(target, target_layer_ids=[0, 1, 2]).attach(target)
    with pytest.raises(ValueError, match=r"\['linear_attention'\] layers, whose state DFlash 2's own loops cannot"):
        generate_each_loop(target, drafter, loop)


def test_the_assisted_loop_takes_a_linear_attention_target_exactly_or_refuses_it_as_the_refusal_says():
    """transformers' assisted loop rolls recurrent state back from 5.25 (and the own loops' refusal sends the user
    there); before, it refused such targets (and the refusal does not send the user to it)."""
    target = tiny_linear_attention_target()
    drafter = tiny_drafter(target, target_layer_ids=[0, 1, 2]).attach(target)
    with pytest.raises(ValueError) as refused:
        generate_each_loop(target, drafter, "static")
    if not assisted_loop_rolls_state_back():
        assert "assisted loop" not in str(refused.value)
        with pytest.raises(ValueError, match="not supported with stateful models"):
            generate_each_loop(target, drafter, "assisted")
        return
    assert "transformers' assisted loop (this version rolls such state back) takes it" in str(refused.value)
    for length in (3, 5, 8):  # every round rejects drafts here: each rolls the recurrent state back
        ids = torch.randint(3, target.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        assisted = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                   assistant_model=drafter)
        assert torch.equal(assisted, plain)


class BlindQwen3:
    """A target whose forward returns no hidden states (as some remote-code models do): nothing to tap."""

    @staticmethod
    def make():
        from transformers import Qwen3ForCausalLM

        class Blind(Qwen3ForCausalLM):
            def forward(self, *args, **kwargs):
                out = super().forward(*args, **kwargs)
                out.hidden_states = None
                return out

        source = tiny_target("qwen3")
        blind = Blind(source.config).eval()
        blind.load_state_dict(source.state_dict())
        return blind


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@pytest.mark.parametrize("loop", ["static", "assisted"])
def test_a_target_without_hidden_states_is_refused_with_a_message(loop):
    target = BlindQwen3.make()
    drafter = tiny_drafter(target).attach(target)
    with pytest.raises(ValueError, match="hidden states"):
        generate_each_loop(target, drafter, loop)


def test_drafters_that_do_not_fit_the_target_are_refused_at_attach():
    target = tiny_target("qwen3")
    wide = tiny_target("qwen3", hidden=32)
    with pytest.raises(ValueError, match="Hidden-size mismatch"):
        tiny_drafter(target).attach(wide)
    shallow = tiny_target("qwen3", layers=3)
    with pytest.raises(ValueError, match="reads target layer 4 .* only 3 layers"):
        tiny_drafter(target).attach(shallow)
    no_mask = tiny_drafter(target)
    no_mask.config.mask_token_id = None
    no_mask.config.mask_token = "<|MASK|>"
    with pytest.raises(ValueError, match="no mask_token_id.*'<\\|MASK\\|>'"):
        no_mask.attach(target)


def test_attach_leaves_the_targets_modules_and_weights_alone():
    target = tiny_target("qwen3")
    names = set(target.state_dict())
    drafter = tiny_drafter(target).attach(target)
    assert set(target.state_dict()) == names and drafter not in list(target.modules())
