"""lm-evaluation-harness on paged_llm: the same numbers and generations as lm-eval's own hf
model on the same float32 weights, for each kind of request, through simple_evaluate and
through `paged-llm eval`; the model arguments lm-eval passes; the error without the extra."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

# NOTE: before datasets is imported (lm_eval imports it): it reads these once. The tasks'
# data are local files; nothing may come from the hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import lm_eval
import pytest
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

import paged_llm
import paged_llm.cli
import paged_llm.integrations
from paged_llm.cli import main
from paged_llm.integrations import lm_eval as integration
from paged_llm.lora.request import LoRARequest
from tests.conftest import write_peft_adapter

pytestmark = pytest.mark.usefixtures("one_thread")

DATA = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
TASKS = ["tiny_mc", "tiny_rolling", "tiny_generate"]

# One task per request kind: loglikelihood, loglikelihood_rolling, generate_until.
TASK_YAMLS = {
    "tiny_mc": """
output_type: multiple_choice
data_file: multiple_choice.jsonl
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "tiny_rolling": """
output_type: loglikelihood_rolling
data_file: rolling.jsonl
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
    "tiny_generate": """
output_type: generate_until
data_file: generate.jsonl
doc_to_text: "Q: {{question}}\\nA:"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, body in TASK_YAMLS.items():
        lines = body.strip().splitlines()
        (data_file,) = (line.split(": ")[1] for line in lines if line.startswith("data_file"))
        config = [line for line in lines if not line.startswith("data_file")]
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {DATA / data_file}\n"
            "test_split: test\n" + "\n".join(config) + "\n"
        )
    return folder


def local_tasks(tasks_dir: Path) -> TaskManager:
    # NOTE: without lm-eval's thousands of built-in task YAMLs, whose indexing takes a minute
    # on a busy 2-core machine.
    return TaskManager(include_path=str(tasks_dir), include_defaults=False)


def evaluate(
    tasks_dir: Path, model: str, model_args: str, tasks: list[str], **options: Any
) -> dict[str, Any]:
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=local_tasks(tasks_dir),
        device="cpu",
        batch_size=4,
        log_samples=True,
        **options,
    )
    assert results is not None
    return results


def responses(results: dict[str, Any], task: str) -> list[Any]:
    """Each document's filtered responses, in document order."""
    samples = sorted(results["samples"][task], key=lambda sample: sample["doc_id"])
    return [sample["filtered_resps"] for sample in samples]


def check_same_as_hf(ours: dict[str, Any], hf: dict[str, Any], tasks: list[str]) -> None:
    for task in tasks:
        mine, theirs = ours["results"][task], hf["results"][task]
        for metric in ("acc,none", "acc_norm,none", "exact_match,none"):
            if metric in theirs:
                assert mine[metric] == theirs[metric], (task, metric)
        for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
            if metric in theirs:
                assert mine[metric] == pytest.approx(theirs[metric], rel=1e-3), (task, metric)
        if task.endswith("generate"):
            assert responses(ours, task) == responses(hf, task)
        if task.endswith("mc"):
            # Per choice loglikelihoods, not only the argmax that acc sees.
            for mine_doc, theirs_doc in zip(
                responses(ours, task), responses(hf, task), strict=True
            ):
                assert [ll for ll, _ in mine_doc] == pytest.approx(
                    [ll for ll, _ in theirs_doc], abs=1e-3
                )
                assert [g for _, g in mine_doc] == [g for _, g in theirs_doc]


@pytest.fixture(scope="module")
def tiny_model(llama_dir: Path) -> str:
    return str(llama_dir)


@pytest.fixture(scope="module")
def ours(tasks_dir: Path, tiny_model: str) -> dict[str, Any]:
    args = f"pretrained={tiny_model},dtype=float32,max_model_len=512"
    return evaluate(tasks_dir, integration.MODEL_NAME, args, TASKS)


def test_scores_and_generations_equal_lm_evals_hf_model(
    tasks_dir: Path, tiny_model: str, ours: dict[str, Any]
) -> None:
    hf = evaluate(tasks_dir, "hf", f"pretrained={tiny_model},dtype=float32", TASKS)
    check_same_as_hf(ours, hf, TASKS)
    # The comparison means something only if the tasks produced real numbers.
    assert ours["results"]["tiny_rolling"]["word_perplexity,none"] > 1
    assert any(text for (text,) in responses(ours, "tiny_generate"))
    assert len(responses(ours, "tiny_mc")) == 10


def test_chat_template_prompts_equal_lm_evals_hf_model(tasks_dir: Path, tiny_model: str) -> None:
    task = ["tiny_generate"]
    ours = evaluate(
        tasks_dir,
        integration.MODEL_NAME,
        f"pretrained={tiny_model},dtype=float32",
        task,
        apply_chat_template=True,
    )
    hf = evaluate(
        tasks_dir, "hf", f"pretrained={tiny_model},dtype=float32", task, apply_chat_template=True
    )
    check_same_as_hf(ours, hf, task)
    (prompt, *_) = ours["samples"]["tiny_generate"][0]["arguments"][0]
    assert prompt.startswith("<|im_start|>")  # the SmolLM2 template rendered it


def test_paged_llm_eval_runs_lm_eval_with_the_model_registered(
    tasks_dir: Path,
    tiny_model: str,
    ours: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # lm-eval's command line builds its own TaskManager; only the local tasks, as above.
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kwargs: local_tasks(tasks_dir))
    argv = ["eval", "--model", tiny_model, "--model_args", "dtype=float32", "max_model_len=512"]
    argv += ["--tasks", "tiny_mc", "--include_path", str(tasks_dir), "--device", "cpu"]
    assert main([*argv, "--output_path", str(tmp_path)]) == 0
    (written,) = tmp_path.rglob("results_*.json")
    results = json.loads(written.read_text())
    assert results["config"]["model"] == "paged_llm"
    assert results["results"]["tiny_mc"]["acc,none"] == ours["results"]["tiny_mc"]["acc,none"]


def test_lora_local_path_runs_every_request_under_the_adapter_as_lm_evals_hf_model_with_peft(
    tasks_dir: Path, tiny_model: str, ours: dict[str, Any], tmp_path: Path
) -> None:
    """lm-eval's vLLM model argument: every request runs under the adapter; the numbers and
    generations equal lm-eval's hf model with the same adapter through peft."""
    adapter = write_peft_adapter(
        Path(tiny_model), tmp_path / "adapter", rank=8, target_modules=["q_proj", "v_proj"], seed=0
    )
    args = f"pretrained={tiny_model},dtype=float32"
    adapted = evaluate(
        tasks_dir,
        integration.MODEL_NAME,
        f"{args},max_model_len=512,lora_local_path={adapter}",
        TASKS,
    )
    hf = evaluate(tasks_dir, "hf", f"{args},peft={adapter}", TASKS)
    check_same_as_hf(adapted, hf, TASKS)
    # The comparison means something only if the adapter changes what the model says.
    assert responses(adapted, "tiny_mc") != responses(ours, "tiny_mc")
    assert responses(adapted, "tiny_generate") != responses(ours, "tiny_generate")

    model = integration.PagedLM(tiny_model, max_model_len=64, lora_local_path=str(adapter))
    with model.llm:
        assert model.lora_request == LoRARequest("finetuned", 1, str(adapter))
        assert model.llm.config.lora is not None  # enable_lora, turned on by the adapter


def test_the_lm_eval_models_entry_point_loads_the_registered_model() -> None:
    """What `lm_eval --model paged_llm` resolves in lm-eval versions that discover model
    plugins: the installed package's entry point in the "lm_eval.models" group."""
    from importlib.metadata import entry_points

    from lm_eval.api.registry import get_model

    (entry,) = (e for e in entry_points(group="lm_eval.models") if e.name == "paged_llm")
    assert entry.load() is integration.PagedLM
    assert get_model(integration.MODEL_NAME) is integration.PagedLM


def test_lm_eval_model_arguments_reach_the_llm(tiny_model: str) -> None:
    model = integration.PagedLM.create_from_arg_string(
        f"pretrained={tiny_model},dtype=float32,max_length=256",
        {"batch_size": 16, "max_batch_size": 8, "device": "cpu"},
    )
    with model.llm:
        assert model.max_length == model.llm.config.max_model_len == 256
        assert (
            model.llm.config.scheduler.max_num_seqs == 8
        )  # max_batch_size, as lm-eval's vLLM model
        assert model.prefix_token_id == model.tokenizer.bos_token_id
    with pytest.raises(
        ValueError, match="device='cuda:1': paged_llm takes 'auto', 'cpu' or 'cuda'"
    ):
        integration.PagedLM(tiny_model, device="cuda:1")
    with pytest.raises(ValueError, match="max_length=64 and max_model_len=128 name one setting"):
        integration.PagedLM(tiny_model, max_length=64, max_model_len=128)


def test_an_empty_continuation_scores_zero_and_greedy_as_lm_evals_vllm_model(
    tiny_model: str,
) -> None:
    """lm-eval's vLLM model sums no logprob for it (0) and finds no token greedy decoding
    would miss (True); the requests beside it score as they do alone."""
    model = integration.PagedLM(tiny_model, dtype="float32", max_model_len=128)

    def request(context: str, continuation: str) -> Instance:
        return Instance("loglikelihood", {}, (context, continuation), idx=0)

    with model.llm:
        alone = model.loglikelihood([request("Question: 2 + 2?\nAnswer:", " 4")])
        scores = model.loglikelihood(
            [
                request("Question: 2 + 2?\nAnswer:", ""),
                request("Question: 2 + 2?\nAnswer:", " 4"),
                request("Nothing follows", ""),
            ]
        )
        assert model.loglikelihood([request("Only empty ones", "")]) == [(0.0, True)]
    assert scores == [(0.0, True), alone[0], (0.0, True)]
    assert alone[0][0] < 0


def test_unknown_gen_kwargs_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="gen_kwargs 'num_beams' have no meaning for paged_llm"):
        integration._sampling_params({"num_beams": 4}, 8, ["\n"])


def test_without_lm_eval_paged_llm_imports_and_eval_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # None in sys.modules makes `import lm_eval` (and its submodules) fail, as if missing.
    for name in [name for name in sys.modules if name.split(".")[0] == "lm_eval"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "paged_llm.integrations.lm_eval")
    monkeypatch.delattr(paged_llm.integrations, "lm_eval")
    importlib.reload(paged_llm)
    importlib.reload(paged_llm.cli)
    with pytest.raises(ImportError, match=r'pip install "paged_llm\[eval\]"'):
        importlib.import_module("paged_llm.integrations.lm_eval")
    assert paged_llm.cli.main(["eval", "--model", "m", "--tasks", "t"]) == 1
    assert 'pip install "paged_llm[eval]"' in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_scores_equal_lm_evals_hf_model(tasks_dir: Path) -> None:
    from paged_llm.model_files import DEFAULT_MODEL, resolve_model

    model_dir = resolve_model(DEFAULT_MODEL).path
    args = f"pretrained={model_dir},dtype=float32"
    ours = evaluate(tasks_dir, integration.MODEL_NAME, f"{args},max_model_len=512", TASKS)
    hf = evaluate(tasks_dir, "hf", args, TASKS)
    check_same_as_hf(ours, hf, TASKS)
