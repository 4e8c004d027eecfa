"""Tests and benchmarks use the runtime through its public API: no `obj._name` read of our objects.

An AST scan of every file there for attribute reads whose name starts with one underscore. Names of other libraries'
private members that a test genuinely needs are allowed below, each with its reason; nothing of dflash2's runtime is.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("tests", "benchmarks")
ALLOWED = {
    "_attn_implementation": "transformers' config field naming the attention kernel (no public setter)",
    "_from_config": "transformers' constructor from a config without loading weights",
    "_get_logits_processor": "transformers' own processors: the reference a sampling test compares against",
    "_prepare_generation_config": "transformers' own filling of the settings a generate call leaves unset: the "
                                  "reference the own loop's settings are tested against",
    "_actions": "argparse's list of a parser's options: the help test reads every option",
    "_get_help_string": "argparse's formatter hook the CLI overrides, called by its test",
    "_dynamo": "torch's compiler package",
    "_inductor": "torch's compiler package",
    "_C": "torch's extension module",
    "_foreach_sub_": "torch's in-place list op (subtracts from every layer's write column in one launch)",
    "_words": "a word-splitting helper of the training prompt lists (a module function, no runtime object)",
}


def private_reads(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if node.attr not in ALLOWED:
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    return found


def test_no_test_or_benchmark_reads_a_private_attribute():
    files = [path for folder in SCANNED for path in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 20  # the scan sees the suite
    assert private_reads(Path(__file__)) == []  # the allow-list itself is no read
    found = [read for path in files for read in private_reads(path)]
    assert not found, "\n".join(found)


def test_the_scan_finds_a_private_read(tmp_path):
    path = tmp_path / "sample.py"
    path.write_text("runner = drafter.round_runners()\nrunners = drafter._round_runners\n")
    assert private_reads(path) == ["sample.py:2: ._round_runners"]
