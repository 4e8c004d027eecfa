"""docs/architecture.md names every runtime module (each file a drafter folder carries) and links the round."""

import re
from pathlib import Path

from dflash2.generation.export import flat_code_files

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def test_every_runtime_module_is_named_and_every_named_module_exists():
    doc = DOC.read_text()
    carried = sorted(flat_code_files())
    assert len(carried) >= 16 and "round_core.py" in carried
    missing = [name for name in carried if not re.search(rf"`(generation/)?{re.escape(name)}`", doc)]
    assert not missing, f"docs/architecture.md does not name {missing}"
    named = set(re.findall(r"`((?:generation/)?[\w/]+\.py)`", doc))
    stale = [name for name in named if not (ROOT / name).is_file() and not (ROOT / "generation" / name).is_file()]
    assert not stale, f"docs/architecture.md names files that do not exist: {stale}"


def test_the_round_is_linked_and_the_page_stays_short():
    doc = DOC.read_text()
    assert "](../generation/round_core.py)" in doc and "`RoundCore.round`" in doc
    assert "](../generation/transformers_patches.py)" in doc
    assert len(doc.splitlines()) <= 200
