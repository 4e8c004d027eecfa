"""Tiny random targets and drafters for CPU tests."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from configuration_dflash2 import DFlash2Config
from modeling_dflash2 import DFlash2DraftModel

VOCAB = 96
EOS = 3


def tiny_target(arch: str = "llama", seed: int = 0, vocab: int = VOCAB, layers: int = 6, hidden: int = 64):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
        eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    else:
        raise ValueError(arch)
    # sharpen the logits so a random target has a few dominant continuations (and greedy has no near ties)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def tiny_drafter(target, seed: int = 1, identity: bool = False, version: int = 2, **overrides):
    torch.manual_seed(seed)
    fields = dict(num_hidden_layers=2, block_size=4, selector_top_k=8, selector_rank=8, conv_group_size=16,
                  dflash_version=version, target_layer_ids=[0, 2, 4][: min(3, target.config.num_hidden_layers)])
    fields.update(overrides)
    config = DFlash2Config.for_target(target.config, **fields)
    drafter = DFlash2DraftModel(config).eval()
    if not identity and version == 2:
        scramble_dflash2_parts(drafter, seed)
    return drafter


def scramble_dflash2_parts(drafter, seed: int):
    """Give convolutions and selector non-identity weights so tests exercise them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
