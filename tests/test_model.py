"""The drafter's pieces against naive loops, identity initialisation, layouts, dialects, save/load, bad configs."""

import json
from pathlib import Path

import pytest
import torch

from dflash2.configuration_dflash2 import DFlash2Config, default_target_layer_ids
from helpers import VOCAB, tiny_drafter, tiny_target
from dflash2.modeling_dflash2 import (
    DFlash2DraftModel,
    DFlash2DynamicConv,
    dynamic_block_conv,
    pair_scores,
    sample_gumbel,
    scatter_scores,
    walk_path,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"  # published configs and tensor tables (see its README.md)
DFLASH2_FOLDER = FIXTURES / "published-dflash2"
DFLASH1_FOLDER = FIXTURES / "published-dflash1"


# ------------------------------------------------------------------------------------------------ naive references
def naive_conv(x, base, delta, group_size):
    """Row by row, channel by channel: y[t, c] = sum_tap (base[tap, c] + delta[t, tap, c // gs]) * x[t - tap, c]."""
    rows, hidden = x.shape
    out = torch.zeros_like(x)
    for t in range(rows):
        for tap in range(base.shape[0]):
            if t - tap < 0:
                continue
            for c in range(hidden):
                out[t, c] += (base[tap, c] + delta[t, tap, c // group_size]) * x[t - tap, c]
    return out


def naive_pair_scores(unary, candidates, anchor, gate, pred_codebook, succ_codebook):
    rows, k = candidates.shape
    out = torch.zeros(rows, k, k, dtype=torch.float64)
    for t in range(rows):
        for i in range(k):
            previous = anchor if t == 0 else candidates[t - 1, i]
            for j in range(k):
                bilinear = sum(
                    float(pred_codebook[previous, r]) * float(gate[t, r]) * float(succ_codebook[candidates[t, j], r])
                    for r in range(gate.shape[-1])
                )
                out[t, i, j] = float(unary[t, j]) + bilinear
    return out


def naive_walk(pairs, candidates, noise=None):
    previous, tokens = 0, []
    for t in range(pairs.shape[0]):
        scores = [float(pairs[t, previous, j]) + (0.0 if noise is None else float(noise[t, j]))
                  for j in range(pairs.shape[-1])]
        choice = max(range(len(scores)), key=lambda j: (scores[j], -j))
        tokens.append(int(candidates[t, choice]))
        previous = choice
    return tokens


# ------------------------------------------------------------------------------------------------ pieces
@pytest.mark.parametrize("taps,group_size,rows", [(2, 4, 5), (3, 8, 4), (2, 16, 1)])
def test_dynamic_conv_matches_naive_loop(taps, group_size, rows):
    torch.manual_seed(taps * 10 + rows)
    hidden = 16
    x = torch.randn(rows, hidden, dtype=torch.float64)
    base = torch.randn(taps, hidden, dtype=torch.float64)
    delta = torch.randn(rows, taps, hidden // group_size, dtype=torch.float64)
    torch.testing.assert_close(dynamic_block_conv(x, base, delta), naive_conv(x, base, delta, group_size))


def test_conv_never_crosses_blocks_and_sides_share_input_coefficients():
    torch.manual_seed(0)
    conv = DFlash2DynamicConv(hidden_size=8, kernel_size=2, group_size=4).double()
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    u = torch.randn(3, 4, 8, dtype=torch.float64)  # three blocks of four rows
    z = torch.randn(3, 4, 8, dtype=torch.float64)
    y, delta_after = conv.prepare(u)
    w = conv.finish(z, delta_after)
    for block in range(3):  # each block alone gives the same answer: no tap reaches into the previous block
        delta = conv.kernel_projection(u[block]).unflatten(-1, (2, 2, 2))
        torch.testing.assert_close(y[block], naive_conv(u[block], conv.base_kernel[0], delta[:, 0], 4))
        torch.testing.assert_close(w[block], naive_conv(z[block], conv.base_kernel[1], delta[:, 1], 4))


def test_pair_scores_match_naive_loop():
    torch.manual_seed(1)
    rows, k, rank, vocab = 4, 5, 3, 20
    unary = torch.randn(1, rows, k)
    candidates = torch.stack([torch.randperm(vocab)[:k] for _ in range(rows)]).unsqueeze(0)
    anchor = torch.tensor([7])
    gate = torch.randn(1, rows, rank)
    pred, succ = torch.randn(vocab, rank), torch.randn(vocab, rank)
    got = pair_scores(unary, candidates, anchor, gate, pred, succ)
    want = naive_pair_scores(unary[0], candidates[0], 7, gate[0], pred, succ)
    torch.testing.assert_close(got[0].double(), want, rtol=1e-5, atol=1e-5)
    assert got.dtype == torch.float32


@pytest.mark.parametrize("sampled", [False, True])
def test_walk_matches_naive_loop(sampled):
    torch.manual_seed(2)
    batch, rows, k = 3, 5, 6
    pairs = torch.randn(batch, rows, k, k)
    candidates = torch.randint(0, 50, (batch, rows, k))
    noise = sample_gumbel((batch, rows, k), "cpu") if sampled else None
    tokens, row_scores = walk_path(pairs, candidates, noise)
    for b in range(batch):
        assert tokens[b].tolist() == naive_walk(pairs[b], candidates[b], None if noise is None else noise[b])
    # the returned scores are the rows the choices were made from: row t is pairs[t, index chosen at t-1]
    for b in range(batch):
        previous = 0
        for t in range(rows):
            torch.testing.assert_close(row_scores[b, t], pairs[b, t, previous])
            previous = int((candidates[b, t] == tokens[b, t]).nonzero()[0])


def test_gumbel_walk_samples_from_softmax_of_row_scores():
    torch.manual_seed(3)
    k, draws = 4, 40000
    pairs = torch.randn(1, 1, k, k).expand(draws, 1, k, k)
    candidates = torch.arange(k).view(1, 1, k).expand(draws, 1, k)
    tokens, _ = walk_path(pairs, candidates, sample_gumbel((draws, 1, k), "cpu"))
    frequencies = torch.bincount(tokens[:, 0], minlength=k).float() / draws
    torch.testing.assert_close(frequencies, pairs[0, 0, 0].softmax(-1), atol=0.01, rtol=0)


def test_scatter_scores_is_minus_inf_off_the_candidates():
    scores = torch.tensor([[[1.0, 2.0]]])
    full = scatter_scores(scores, torch.tensor([[[3, 1]]]), 5)
    assert full[0, 0].tolist() == [float("-inf"), 2.0, float("-inf"), 1.0, float("-inf")]


# ------------------------------------------------------------------------------------------------ the model
def test_identity_init_dflash2_equals_dflash1():
    target = tiny_target()
    v2 = tiny_drafter(target, identity=True)
    v1_config = DFlash2Config.from_dict({**v2.config.to_dict(), "dflash_version": 1})
    v1 = DFlash2DraftModel(v1_config).eval()
    v1.load_state_dict(v2.state_dict(), strict=False)
    v1.bind_target(target), v2.bind_target(target)
    torch.manual_seed(0)
    features = torch.randn(1, 9, 3 * 64)
    block = torch.tensor([[5] + [v2.config.mask_token_id] * 3])
    positions = torch.arange(13).unsqueeze(0)
    h2 = v2(input_ids=block, context_hidden_states=features, position_ids=positions).last_hidden_state
    h1 = v1(input_ids=block, context_hidden_states=features, position_ids=positions).last_hidden_state
    assert torch.equal(h1, h2)
    drafts2 = v2.propose(block[:, 0], h2).tokens
    drafts1 = v1.propose(block[:, 0], h1).tokens
    assert torch.equal(drafts1, drafts2)


def test_forward_with_cache_equals_forward_over_whole_context():
    target = tiny_target()
    drafter = tiny_drafter(target).bind_target(target)
    features = torch.randn(1, 10, 3 * 64)
    block = torch.tensor([[9] + [drafter.config.mask_token_id] * 3])
    whole = drafter(input_ids=block, context_hidden_states=features, position_ids=torch.arange(14)[None])
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()  # a plain growing cache: the drafter applies sliding windows by mask
    drafter(input_ids=block, context_hidden_states=features[:, :6], position_ids=torch.arange(10)[None], cache=cache)
    cache.crop(-4)
    assert cache.get_seq_length() == 6
    step = drafter(input_ids=block, context_hidden_states=features[:, 6:], position_ids=torch.arange(6, 14)[None],
                   cache=cache)
    torch.testing.assert_close(step.last_hidden_state, whole.last_hidden_state, rtol=1e-5, atol=1e-5)


def test_block_rows_attend_bidirectionally_unless_causal():
    target = tiny_target()
    features = torch.randn(1, 5, 3 * 64)
    for causal in (False, True):
        drafter = tiny_drafter(target, is_causal=causal).bind_target(target)
        ids_a = torch.tensor([[4, 5, 6, 7]])
        ids_b = torch.tensor([[4, 5, 6, 8]])  # differs in the last row only
        out_a = drafter(input_ids=ids_a, context_hidden_states=features).last_hidden_state
        out_b = drafter(input_ids=ids_b, context_hidden_states=features).last_hidden_state
        first_rows_equal = torch.allclose(out_a[:, :3], out_b[:, :3])
        assert first_rows_equal == causal


def test_published_dflash2_layout_matches_reference_exactly():
    config = DFlash2Config.from_pretrained(DFLASH2_FOLDER)
    with torch.device("meta"):
        model = DFlash2DraftModel(config)
    reference = json.loads((DFLASH2_FOLDER / "tensor-shapes.json").read_text())["tensors"]
    ours = {name: list(tensor.shape) for name, tensor in model.state_dict().items()}
    assert ours == reference and len(ours) == 81


def test_published_dflash1_layout_has_58_tensors():
    published = json.loads((DFLASH1_FOLDER / "config.json").read_text())
    for config in (DFlash2Config.from_dict(published), DFlash2Config.from_pretrained(DFLASH1_FOLDER)):
        assert config.dflash_version == 1 and config.mask_token_id == 201818
    with torch.device("meta"):
        names = set(DFlash2DraftModel(config).state_dict())
    assert len(names) == 58
    assert not any("conv" in n or "selector" in n for n in names)
    per_layer = {n.split(".", 2)[2] for n in names if n.startswith("layers.0.")}
    assert per_layer == {
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
    }


def test_published_dialect_fields():
    config = DFlash2Config.from_pretrained(DFLASH2_FOLDER)
    assert config.model_type == "dflash2"
    assert (config.block_size, config.mask_token_id, config.selector_top_k) == (16, 201818, 16)
    assert config.target_layer_ids == [1, 13, 25, 37, 49]
    assert config.final_logit_softcapping == 20.0 and config.sliding_window == 2048
    assert config.is_causal is False and config.target_hidden_size == 6656
    # without dflash_config the keys come from the top level, then defaults (block 16, spread taps)
    flat = {"model_type": "qwen3", "architectures": ["DFlashDraftModel"], "num_target_layers": 36,
            "num_hidden_layers": 5, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 100, "mask_token_id": 99}
    config = DFlash2Config.from_dict(flat)
    assert config.block_size == 16 and config.target_layer_ids == [1, 9, 17, 25, 33]


def test_default_layer_spread():
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # layer 1 to L-3, evenly
    assert default_target_layer_ids(30, 1) == [15]


def test_save_load_round_trip(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path / "drafter")
    loaded = DFlash2DraftModel.from_pretrained(tmp_path / "drafter")
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    # non-persistent buffers (RoPE frequencies) must come back too: same outputs, not just same tensors
    features = torch.randn(1, 7, 3 * 64)
    block = torch.tensor([[5] + [drafter.config.mask_token_id] * 3])
    drafter.bind_target(target), loaded.bind_target(target)
    assert torch.equal(drafter(input_ids=block, context_hidden_states=features).last_hidden_state,
                       loaded(input_ids=block, context_hidden_states=features).last_hidden_state)
    assert loaded.config.to_dict()["selector_rank"] == drafter.config.selector_rank
    saved = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert saved["auto_map"]["AutoModel"] == "drafter.DFlash2Drafter"


def test_drafter_never_stores_target_parts(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target).bind_target(target)
    names = set(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)


BAD_CONFIGS = [
    (dict(num_target_layers=6, target_layer_ids=[0, 6]), "out of range"),
    (dict(block_size=1), "block_size=1"),
    (dict(vocab_size=10, selector_top_k=11), "selector_top_k=11"),
    (dict(hidden_size=40, num_attention_heads=4, conv_group_size=16), "not divisible by conv_group_size"),
    (dict(num_attention_heads=6, num_key_value_heads=4), "does not divide"),
    (dict(layer_types=["sliding_attention"], num_hidden_layers=1), "needs sliding_window"),
    (dict(vocab_size=10, mask_token_id=10), "outside the vocabulary"),
    (dict(dflash_version=3), "dflash_version=3"),
]


@pytest.mark.parametrize("fields,message", BAD_CONFIGS)
def test_bad_configs_are_rejected_with_one_clear_message(fields, message):
    with pytest.raises(ValueError, match=message):
        DFlash2Config(**{"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, **fields})


def test_for_target_fits_the_target():
    target = tiny_target("qwen3")
    config = DFlash2Config.for_target(target.config)
    assert config.vocab_size == VOCAB and config.target_hidden_size == 64 and config.num_target_layers == 6
    assert config.mask_token_id == 0  # the pad token
    assert max(config.target_layer_ids) < 6
    config.check_target(target.config)
    other = tiny_target("llama", vocab=VOCAB + 1)
    with pytest.raises(ValueError, match="Vocabulary mismatch"):
        config.check_target(other.config)
