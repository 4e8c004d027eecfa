"""Tiny random targets and drafters for CPU tests."""

import os
import subprocess
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash2.configuration_dflash2 import DFlash2Config
from dflash2.generation import DFlash2Drafter as DFlash2DraftModel

VOCAB = 96
EOS = 3


def tiny_target(arch: str = "llama", seed: int = 0, vocab: int = VOCAB, layers: int = 6, hidden: int = 64,
                tied: bool = False):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
        eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=tied,
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


def sliding_qwen3(vocab: int = VOCAB, seed: int = 0, layers: int = 6, window: int = 8):
    """A tiny Qwen3 target whose layers alternate sliding-window (`window`) and full attention, logits sharpened as
    in `tiny_target`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=EOS, pad_token_id=0, use_sliding_window=True,
                         sliding_window=window, layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    target = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    return target


def tiny_drafter(target, seed: int = 1, identity: bool = False, version: int = 2, **overrides):
    torch.manual_seed(seed)
    fields = dict(num_hidden_layers=2, block_size=4, selector_top_k=8, selector_rank=8, conv_group_size=16,
                  dflash_version=version, target_layer_ids=[0, 2, 4][: min(3, target.config.num_hidden_layers)],
                  max_speculative_batch_size=64)  # speculate at every batch size the CPU tests use
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


# ------------------------------------------------------------------------------------------------ sampling checks
def chi2_critical(dof: int, alpha_z: float = 3.09) -> float:
    """Wilson-Hilferty upper quantile of chi-square (alpha_z = 3.09: p = 0.001)."""
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + alpha_z * h ** 0.5) ** 3


def exact_distribution_of_step(target, ids, step, processors):
    """Exact marginal distribution of the token `step` positions after the prompt under the processed target."""
    sequences = {tuple(ids[0].tolist()): 1.0}
    for _ in range(step + 1):
        grown = {}
        for sequence, weight in sequences.items():
            prefix = torch.tensor([sequence])
            with torch.no_grad():
                logits = target(prefix).logits[:, -1].float()
            probs = processors(prefix, logits).softmax(-1)[0]
            for token in probs.nonzero().flatten().tolist():
                key = sequence + (token,)
                grown[key] = grown.get(key, 0.0) + weight * float(probs[token])
        sequences = grown
    marginal = torch.zeros(target.config.vocab_size, dtype=torch.float64)
    for sequence, weight in sequences.items():
        marginal[sequence[-1]] += weight
    return marginal


def assert_follows(counts, expected):
    """Chi-square goodness of fit of observed `counts` against `expected` counts (rare cells pooled), p > 0.001."""
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token the target gives zero probability"
    cells = expected[support] >= 5
    observed = torch.cat([counts[support][cells], counts[support][~cells].sum().view(1)])
    wanted = torch.cat([expected[support][cells], expected[support][~cells].sum().view(1)])
    if wanted[-1] == 0:
        observed, wanted = observed[:-1], wanted[:-1]
    statistic = float(((observed - wanted) ** 2 / wanted).sum())
    assert statistic < chi2_critical(len(wanted) - 1), statistic


def sampling_case(vocab: int = 12):
    """A flat-ish tiny target (many tokens with real probability) and a drafter whose drafts it sometimes accepts."""
    target = tiny_target("llama", seed=7, vocab=vocab)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.35)
    drafter = tiny_drafter(target, seed=8, block_size=4, selector_top_k=6, mask_token_id=vocab - 1).attach(target)
    return target, drafter


def check_sampling_is_exact(settings, draws, device="cpu", **generate_kwargs):
    """Speculative samples of the 2nd and 3rd new tokens follow the target's own processed distribution (the pair run
    on `device`, the exact distribution computed on the CPU first)."""
    target, drafter = sampling_case()
    ids = torch.tensor([[5, 6, 7]])
    generation = dict(do_sample=True, top_k=0, max_new_tokens=3, eos_token_id=None, **settings)
    processors = target._get_logits_processor(target.generation_config.__class__(**generation), 3)
    expected = [exact_distribution_of_step(target, ids, step, processors) for step in (1, 2)]
    target, drafter, ids = target.to(device), drafter.to(device).attach(target), ids.to(device)
    torch.manual_seed(0)
    counts = torch.zeros(2, target.config.vocab_size, dtype=torch.float64)
    accepted = 0
    for _ in range(draws):
        out = target.generate(ids, assistant_model=drafter, **generation, **generate_kwargs)
        for row, step in enumerate((1, 2)):
            counts[row, out[0, 3 + step]] += 1
        accepted += drafter.last_stats.accepted_per_position[0]
    assert accepted > draws * 0.05, "no draft was ever accepted: the test would not test acceptance"
    for row in range(2):
        assert_follows(counts[row], expected[row] * draws)


def background_equals_plain(target, drafter, ids, max_new_tokens, **settings):
    """One greedy call with compile="background" (and `settings`, on both sides): its output equals plain greedy.
    Returns the drafter's one runner."""
    reference = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **settings)
    ours = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=drafter,
                           cache_implementation="static", compile="background", **settings)
    assert torch.equal(ours, reference)
    (runner,) = drafter.round_runners()
    return runner


FOLDERS_WITHOUT_DFLASH2 = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("dflash2", "configuration_dflash2", "modeling_dflash2", "generation", "training",
                                  "benchmarks", "tasks", "cli"):
            raise ImportError("the dflash2 project is not importable in this process: " + name)
sys.meta_path.insert(0, Block())
sys.path = [p for p in sys.path if p not in ("", ".")]
try:
    import dflash2
except ImportError:
    pass
else:
    raise AssertionError("dflash2 is importable from " + str(dflash2.__file__))
import torch
from transformers import AutoModel, LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)  # a random target of the default target's shape: the drafter attaches and stays lossless
target = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)).eval()
ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
plain = target.generate(ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids))
for folder in sys.argv[1:]:
    drafter = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
    assert type(drafter).__name__ == "DFlash2Drafter"
    drafter.attach(target)
    for extra in ({}, {"cache_implementation": "static"}):
        out = target.generate(ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids),
                              assistant_model=drafter, **extra)
        assert torch.equal(out, plain), (folder, extra)
    drafter.detach(target)
print("FOLDERS-LOAD-OK")
"""


def assert_folders_load_without_dflash2(folders, tmp_path):
    """In a fresh process where `import dflash2` fails (asserted there), with the Hub offline, each drafter folder
    loads through AutoModel (trust_remote_code), attaches to a random target and generates greedy tokens equal to plain
    `generate` (transformers' loop and the static one)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", FOLDERS_WITHOUT_DFLASH2, *map(str, folders)], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=600)
    assert "FOLDERS-LOAD-OK" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]
