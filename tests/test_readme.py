"""The README as a newcomer meets it: its Python examples run as written (every ```python block, in order, in one
namespace, from the repository's root, with the Hub out of reach: conftest sets HF_HUB_OFFLINE=1), and `.ci/run`
installs what the README's first command installs."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, flags=re.S | re.M)


def test_the_examples_load_the_default_target_from_the_installed_package_and_define_every_name():
    assert len(BLOCKS) >= 3
    first = BLOCKS[0]
    assert "load_target(drafter.config" in first and "from_pretrained(\"HuggingFaceTB" not in README
    assert "input_ids, attention_mask = " in first
    generate_calls = re.findall(r"\.generate\((.*?)\)\n", "\n".join(BLOCKS), flags=re.S)
    assert generate_calls and all("max_new_tokens=" in call for call in generate_calls), generate_calls
    pipeline_calls = re.findall(r"chat\((.*?)\)\[0\]", "\n".join(BLOCKS), flags=re.S)
    assert pipeline_calls and all("max_new_tokens=" in call for call in pipeline_calls)


@pytest.fixture(scope="module")
def namespace():
    """The README's names, shared by its blocks as in one session; None after a block failed."""
    return {"__name__": "__readme__", "failed": None}


# a keyword the installed transformers deprecates (e.g. `past_key_values` for `cache` from 5.24) fails the block: the
# examples use the names of the version the README's first command installs
@pytest.mark.filterwarnings(r"error:`\w+` is deprecated and will be removed:FutureWarning")
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"block{i + 1}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs_as_written(index, namespace, monkeypatch):
    if namespace["failed"] is not None:
        pytest.fail(f"README python block {namespace['failed']} failed; the later blocks build on it")
    monkeypatch.chdir(ROOT)  # the examples name the shipped drafter by its path in the repository
    code = compile(BLOCKS[index], f"README.md python block {index + 1}", "exec")
    namespace["failed"] = index + 1
    exec(code, namespace)
    namespace["failed"] = None
    if index == 0:  # the shipped drafter really drafted: tau of a trained drafter, not 1.0
        first_greedy = namespace["plain"]
        assert first_greedy.shape[1] > namespace["input_ids"].shape[1]
        assert namespace["drafter"].last_stats.completion_tokens > 0


def test_ci_installs_what_the_readme_first_command_installs_and_runs_its_test_command():
    """An ordinary install (no --no-deps, a clean `pip check`), the same in .ci/run, which then runs the README's test
    command."""
    first = re.search(r"^python3 -m venv .*$", README, flags=re.M).group(0)
    installs = [part.strip() for part in first.split("&&") if part.strip().startswith("pip install")]
    assert installs and not [command for command in installs if "--no-deps" in command], installs
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for command in installs:
        assert command.replace("pip install", "python -m pip install -q", 1) in ci, command
    assert re.search(r"^python -m pip check$", ci, flags=re.M)
    test_command = re.search(r"^\. \.venv/bin/activate && (python -m pytest .*)$", README, flags=re.M).group(1)
    assert re.search(rf"^{re.escape(test_command.strip())}$", ci, flags=re.M), test_command
