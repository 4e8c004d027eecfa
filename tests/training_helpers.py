"""A tiny random target saved as a loadable folder (weights + a word-level tokenizer with a chat template), prompt
files and self-distilled rows, for the training tests that go through `load_target`, the CLI and torchrun."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from helpers import EOS, VOCAB, tiny_target

ROOT = Path(__file__).resolve().parents[1]
SPECIAL = ["<pad>", "<s>", "<unk>", "</s>"]  # ids 0..3: pad, bos, unk, eos (helpers.EOS == 3)
CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<s> assistant {% endif %}")


def word(i: int) -> str:
    return SPECIAL[i] if i < len(SPECIAL) else f"w{i}"


def save_tiny_target(folder: Path, seed: int = 11, arch: str = "llama") -> Path:
    """A tiny random target (helpers.tiny_target) and a word-level tokenizer over its vocabulary, in `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    assert EOS == 3
    vocab = {word(i): i for i in range(VOCAB - 2)}
    vocab.update({"user": VOCAB - 2, "assistant": VOCAB - 1})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    target = tiny_target(arch, seed=seed)
    target.generation_config.eos_token_id = EOS
    target.generation_config.pad_token_id = 0
    target.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def write_prompt_file(path: Path, count: int, seed: int = 0, words: int = 6, conversations: int = 0) -> Path:
    """`count` prompts of random words (the last `conversations` of them as 3-turn conversations)."""
    generator = torch.Generator().manual_seed(seed)

    def text(n):
        return " ".join(word(int(i)) for i in torch.randint(4, VOCAB - 2, (n,), generator=generator))

    with open(path, "w") as handle:
        for i in range(count):
            row = {"source": "test", "prompt": text(words)}
            if i >= count - conversations:
                row["messages"] = [{"role": "user", "content": text(words)},
                                   {"role": "assistant", "content": text(words)},
                                   {"role": "user", "content": row["prompt"]}]
            handle.write(json.dumps(row) + "\n")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, module_args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc_per_node nproc -m <module_args>` on the CPU (gloo), one thread per
    process; fails the test with both processes' output if it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), "-m", *module_args]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"torchrun failed ({result.returncode}):\n{result.stdout[-4000:]}\n" \
                                   f"{result.stderr[-6000:]}"
    return result
