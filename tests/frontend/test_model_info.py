"""A model's files read once, and an engine built from them without an `LLM` (what a
data-parallel replica does in its process)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from paged_llm import LLM, EngineArgs, SamplingParams
from paged_llm.engine.request import EngineRequest
from paged_llm.frontend.engine_client import build_engine
from paged_llm.frontend.model_info import ModelInfo

MAX_MODEL_LEN = 64


def test_an_engine_built_without_an_llm_generates_what_the_llms_engine_does(
    llm: LLM, llama_dir: Path
) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (expected,) = llm.generate("The harbour at dawn", params, use_tqdm=False)
    engine = build_engine(EngineArgs(model=llama_dir, max_model_len=MAX_MODEL_LEN))
    try:
        engine.add_request(EngineRequest("alone", None, expected.prompt_token_ids, params))
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
    finally:
        engine.shutdown()
    (output,) = outputs
    assert output.outputs[0].token_ids == expected.outputs[0].token_ids


def test_eos_ids_and_sampling_defaults_come_from_generation_config(
    llama_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    shutil.copytree(llama_dir, folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 7], "temperature": 0.3, "max_new_tokens": 12})
    )
    info = ModelInfo.load(EngineArgs(model=folder))
    assert {2, 7} <= info.eos_token_ids
    defaults = info.default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.3, 12)
    vllm_defaults = ModelInfo.load(EngineArgs(model=folder, generation_config="vllm"))
    assert vllm_defaults.default_sampling_params() == SamplingParams()
    assert {2, 7} <= vllm_defaults.eos_token_ids
    overridden = ModelInfo.load(EngineArgs(model=folder, override_generation_config={"top_k": 5}))
    assert overridden.default_sampling_params().top_k == 5
