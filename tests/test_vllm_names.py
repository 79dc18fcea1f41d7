"""docs/vllm_compat.md's table is paged_llm/vllm_names.py's, and every name in it is what the
table says: a Y or differs name exists at its paged_llm path, a refused one raises its note."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

from paged_llm.settings_docs import DOCS_COMMAND, rewrite_vllm_names_table
from paged_llm.vllm_names import STATUSES, VLLM_NAMES, VllmName

REPO_ROOT = Path(__file__).resolve().parents[1]


def _owner_and_name(path: str) -> tuple[Any, str]:
    """The object that holds the last part of a dotted ``path`` (the deepest importable
    module, then attributes), and that part."""
    parts = path.split(".")
    owner: Any = None
    for end in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:end]))
        except ModuleNotFoundError:
            continue
        for part in parts[end:-1]:
            owner = getattr(owner, part)
        return owner, parts[-1]
    raise AssertionError(f"no module of {path} imports")


def test_the_compat_page_holds_the_generated_table() -> None:
    page = (REPO_ROOT / "docs" / "vllm_compat.md").read_text()
    assert rewrite_vllm_names_table(page) == page, f"docs/vllm_compat.md is stale: {DOCS_COMMAND}"
    assert page.count("| `vllm.") == len(VLLM_NAMES)


def test_every_name_has_a_known_status_and_refusals_say_why() -> None:
    assert len({name.path for name in VLLM_NAMES}) == len(VLLM_NAMES)
    for name in VLLM_NAMES:
        assert name.status in STATUSES, name
        assert (name.status == "Y") == (name.note == ""), name


@pytest.mark.parametrize(
    "name", [n for n in VLLM_NAMES if n.status != "refused"], ids=lambda n: n.path
)
def test_a_name_paged_llm_has_is_at_vllms_path(name: VllmName) -> None:
    owner, attribute = _owner_and_name(name.paged_llm_path)
    if isinstance(owner, type) and attribute not in dir(owner):
        # An instance attribute (LLM.llm_engine), declared on the class.
        assert attribute in owner.__annotations__
    else:
        assert getattr(owner, attribute) is not None


@pytest.mark.parametrize(
    "name", [n for n in VLLM_NAMES if n.status == "refused"], ids=lambda n: n.path
)
def test_a_refused_name_raises_its_note(name: VllmName) -> None:
    owner, attribute = _owner_and_name(name.paged_llm_path)
    if isinstance(owner, type):
        instance = owner.__new__(owner)
        with pytest.raises(AttributeError) as raised:
            getattr(instance, attribute)
    else:
        with pytest.raises(ImportError) as raised:
            exec(f"from {owner.__name__} import {attribute}", {})
    assert str(raised.value) == name.note


def test_a_missing_name_that_vllm_lacks_too_is_pythons_attribute_error() -> None:
    import paged_llm
    from paged_llm import LLM

    assert not hasattr(paged_llm, "NoSuchName")
    assert not hasattr(LLM.__new__(LLM), "no_such_method")


def test_current_platform_is_the_one_device_auto_picks() -> None:
    import torch

    from paged_llm.platforms import current_platform, get_platform

    assert type(current_platform) is type(get_platform("auto"))
    assert current_platform.is_cuda() == torch.cuda.is_available() != current_platform.is_cpu()
    assert current_platform.device_type == ("cuda" if torch.cuda.is_available() else "cpu")
