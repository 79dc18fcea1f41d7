"""docs/failure-behaviour.md names, for each promise, the test that holds it: every test it
names exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_every_test_the_failure_page_names_exists() -> None:
    page = (REPO_ROOT / "docs" / "failure-behaviour.md").read_text()
    missing = []
    current_file: Path | None = None
    for path, name in re.findall(r"`(tests/[\w/]+\.py)?(?:::(\w+))?`", page):
        if path:
            current_file = REPO_ROOT / path
            if not current_file.is_file():
                missing.append(path)
                continue
        if name:
            assert current_file is not None, name
            if not re.search(rf"^def {name}\(", current_file.read_text(), re.MULTILINE):
                missing.append(f"{current_file.relative_to(REPO_ROOT)}::{name}")
    assert missing == []
