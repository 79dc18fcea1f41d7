"""Inside a training loop, against transformers: weights updated in place (whole, partial,
int8) give transformers' greedy tokens with the same weights, even on prompts cached under
the old ones; a bad update changes nothing; sleep gives the KV cache's memory (level 2: the
weights' too) back and wake_up restores the same outputs, cycle after cycle;
collective_rpc and apply_model reach the model runner."""

from __future__ import annotations

import gc
import multiprocessing
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from paged_llm import LLM, SamplingParams
from paged_llm.distributed.ports import get_open_port
from paged_llm.distributed.weight_transfer import TrainerWeightSender, WeightTransferUpdateInfo
from paged_llm.engine.model_runner import ModelRunner
from tests.conftest import TINY_BASE_CONFIG, TINY_MODELS, hf_greedy
from tests.layers.quantization.test_int8 import dequantized_reference

# Small blocks, so the prompts leave full blocks in the prefix cache.
SETTINGS = {"block_size": 4, "max_model_len": 96, "kv_cache_memory_bytes": 2**22}
PROMPTS = [[100 + 7 * i for i in range(13)], [300 + 11 * i for i in range(29)], [50, 51, 52]]
MAX_NEW_TOKENS = 6


def greedy(llm: LLM, prompts: list[list[int]] = PROMPTS) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of each prompt, and how many of its prompt tokens the cache served."""
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outputs], [o.num_cached_tokens for o in outputs]


def hf_model(model_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def perturbed(model_dir: Path, seed: int = 1) -> transformers.PreTrainedModel:
    """Model B: the model of ``model_dir`` (A) with every parameter moved by seeded noise
    as large as the weights themselves, so that B's tokens differ from A's."""
    model = hf_model(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * param.std().nan_to_num(1))
    return model.eval()


def hf_tokens(model: transformers.PreTrainedModel, prompts: list[list[int]] = PROMPTS) -> list:
    return [hf_greedy(model, prompt, MAX_NEW_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("arch", list(TINY_MODELS))
def test_a_full_update_equals_transformers_with_the_new_weights_on_cached_prompts(
    arch: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    model_dir = tiny_model_dir(arch)
    new_model = perturbed(model_dir)
    # A tied model's state_dict names the shared tensor twice (lm_head.weight too).
    weights = new_model.state_dict() if arch == "llama3-tied" else new_model.named_parameters()
    with LLM(model_dir, **SETTINGS) as llm:
        before, _ = greedy(llm)
        _, cached = greedy(llm)
        assert all(cached[:2]), "the longer prompts are cached before the update"
        llm.update_weights(weights)
        after, cached = greedy(llm)
    assert cached == [0] * len(PROMPTS), "KV computed with the old weights is not reused"
    assert after == hf_tokens(new_model)
    assert after != before


def test_a_partial_update_equals_transformers_load_state_dict_of_the_same_tensors(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    """One slice of each packed projection (q of q/k/v, up of gate/up), a bias, a norm."""
    model_dir = tiny_model_dir("qwen2")
    source = perturbed(model_dir).state_dict()
    names = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.v_proj.bias",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.norm.weight",
    ]
    partial = {name: source[name].to(torch.bfloat16) for name in names}
    reference = hf_model(model_dir)
    reference.load_state_dict(partial, strict=False)
    with LLM(model_dir, **SETTINGS) as llm:
        before, _ = greedy(llm)
        llm.update_weights(partial)
        after, _ = greedy(llm)
    assert after == hf_tokens(reference.eval())
    assert after != before


def test_an_int8_engine_requantizes_the_new_weights(llama_dir: Path, tmp_path: Path) -> None:
    new_model = perturbed(llama_dir)
    new_model.save_pretrained(tmp_path)
    with LLM(llama_dir, quantization="int8", **SETTINGS) as llm:
        llm.update_weights(new_model.named_parameters())
        after, _ = greedy(llm)
    assert after == hf_tokens(dequantized_reference(tmp_path))


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (("model.layers.0.self_attn.q_rope.weight", None), r"'model.layers.0.self_attn.q_rope"),
        (("model.layers.1.self_attn.k_proj.weight", (3, 64)), r"k_proj.weight.*shape \(3, 64\)"),
        (("model.norm.weight", (65,)), r"'model.norm.weight' has shape \(65,\)"),
        (("model.embed_tokens.weight", "int"), r"floating-point"),
    ],
)
def test_a_bad_update_raises_naming_the_parameter_and_changes_nothing(
    bad: tuple[str, object], message: str, llama_dir: Path
) -> None:
    new_model = perturbed(llama_dir)
    good = list(new_model.named_parameters())
    name, shape = bad
    params = dict(new_model.named_parameters())
    tensor = (
        params[name].detach().long()
        if shape == "int"
        else torch.zeros(shape)
        if isinstance(shape, tuple)
        else torch.zeros(1)
    )
    with LLM(llama_dir, **SETTINGS) as llm:
        before, _ = greedy(llm)
        # The good tensors come first: none of them may be applied either.
        with pytest.raises(ValueError, match=message):
            llm.update_weights([*good, (name, tensor)])
        assert greedy(llm)[0] == before


def rss_bytes() -> int:
    gc.collect()
    status = Path("/proc/self/status").read_text()
    kib = re.search(r"VmRSS:\s+(\d+) kB", status)
    assert kib is not None
    return int(kib.group(1)) * 1024


# A model whose weights (about 110 MiB in float32, half of them the untied embedding and LM
# head) and KV cache (256 MiB) dwarf the process's other memory changes.
_LARGE_CONFIG = {
    **TINY_BASE_CONFIG,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}
_KV_BYTES = 2**28


@pytest.fixture(scope="module")
def larger_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**_LARGE_CONFIG), dtype=torch.float32
    )
    path = tmp_path_factory.mktemp("larger-llama")
    model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


def weight_bytes(model_dir: Path) -> int:
    return sum(p.numel() * 4 for p in hf_model(model_dir).parameters())


def test_sleep_gives_the_memory_back_and_wake_up_restores_the_outputs(
    larger_model_dir: Path,
) -> None:
    weights = weight_bytes(larger_model_dir)
    with LLM(larger_model_dir, block_size=4, kv_cache_memory_bytes=_KV_BYTES) as llm:
        expected, _ = greedy(llm)
        awake = rss_bytes()
        llm.sleep(level=1)
        assert llm.is_sleeping()
        assert awake - rss_bytes() > 0.8 * _KV_BYTES
        with pytest.raises(RuntimeError, match=r"asleep.*wake_up"):
            greedy(llm)
        assert llm.wake_up() is True
        assert greedy(llm) == (expected, [0] * len(PROMPTS))

        llm.sleep(level=2)
        assert awake - rss_bytes() > 0.8 * (_KV_BYTES + weights)
        assert llm.wake_up(["weights"]) is False
        with pytest.raises(RuntimeError, match=r"asleep \(kv_cache"):
            greedy(llm)
        assert llm.wake_up(["kv_cache"]) is True
        assert greedy(llm)[0] == expected

        after_first_cycle = rss_bytes()
        for level in (1, 2) * 5:
            llm.sleep(level=level)
            llm.wake_up()
        assert greedy(llm)[0] == expected
        # No cycle leaves memory behind: ten of them grow the process by less than a
        # tenth of what one releases.
        assert rss_bytes() - after_first_cycle < 0.1 * (_KV_BYTES + weights)


def test_sleep_level_2_then_update_weights_serves_the_new_weights(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    """The RL pattern: free everything for the training step, take the weights' memory
    back, push the trained weights, then the cache."""
    model_dir = tiny_model_dir("qwen3")
    new_model = perturbed(model_dir)
    with LLM(model_dir, **SETTINGS) as llm:
        greedy(llm)
        llm.sleep(level=2)
        with pytest.raises(RuntimeError, match=r"wake_up\(tags=\['weights'\]\)"):
            llm.update_weights(new_model.named_parameters())
        llm.wake_up(tags=["weights"])
        llm.update_weights(new_model.named_parameters())
        llm.wake_up(tags=["kv_cache"])
        assert greedy(llm)[0] == hf_tokens(new_model)


def test_sleep_and_wake_up_refuse_bad_arguments(llama_dir: Path) -> None:
    # vLLM's scripts pass enable_sleep_mode=True: accepted, sleep needs nothing more.
    with LLM(llama_dir, enable_sleep_mode=True, **SETTINGS) as llm:
        with pytest.raises(ValueError, match=r"level must be 1.*or 2.*level 0"):
            llm.sleep(level=0)
        with pytest.raises(ValueError, match=r"'scheduling'"):
            llm.wake_up(["scheduling"])
        assert not llm.is_sleeping()


def test_requests_in_flight_block_an_update_and_sleep_aborts_them(llama_dir: Path) -> None:
    with LLM(llama_dir, **SETTINGS) as llm:
        llm.llm_engine.add_request("queued", "hello", SamplingParams(max_tokens=4))
        with pytest.raises(RuntimeError, match=r"update_weights while 1 request"):
            llm.update_weights(perturbed(llama_dir).named_parameters())
        with pytest.raises(RuntimeError, match=r"sleep\(mode='wait'\) with 1 request"):
            llm.sleep(mode="wait")
        llm.sleep()  # mode="abort", vLLM's default
        assert not llm.llm_engine.has_unfinished_requests()
        llm.wake_up()
        assert greedy(llm)[0]


def layer_count(runner: ModelRunner, offset: int = 0) -> int:
    return len(runner.attention_layers) + offset


def refuse(runner: ModelRunner) -> None:
    raise ValueError("refused by the test")


def test_collective_rpc_and_apply_model_reach_the_model_runner(llama_dir: Path) -> None:
    with LLM(llama_dir, **SETTINGS) as llm:
        expected, _ = greedy(llm)
        assert llm.collective_rpc(layer_count, args=(1,)) == [3]
        assert llm.collective_rpc(layer_count, kwargs={"offset": 2}) == [4]
        assert llm.apply_model(lambda model: type(model).__name__) == ["LlamaForCausalLM"]
        with pytest.raises(ValueError, match="refused by the test"):
            llm.collective_rpc(refuse)
        with pytest.raises(ValueError, match="timeout"):
            llm.collective_rpc(layer_count, timeout=5.0)
        assert greedy(llm)[0] == expected


def _trainer(port: int, model_dir: str, infos: multiprocessing.Queue) -> None:
    """A trainer in its own process: makes the group, says what it sends, sends model B."""
    torch.set_num_threads(1)
    pairs = list(perturbed(Path(model_dir)).named_parameters())
    sender = TrainerWeightSender({"master_port": port})
    infos.put(WeightTransferUpdateInfo.describing(pairs))
    sender.send_weights(pairs)


def test_a_trainer_process_sends_the_weights_over_gloo(llama_dir: Path) -> None:
    port = get_open_port()
    context = multiprocessing.get_context("spawn")
    infos = context.Queue()
    trainer = context.Process(target=_trainer, args=(port, str(llama_dir), infos))
    trainer.start()
    try:
        with LLM(llama_dir, **SETTINGS) as llm:
            before, _ = greedy(llm)
            with pytest.raises(RuntimeError, match=r"init_weight_transfer_engine"):
                llm.start_weight_update()
            llm.init_weight_transfer_engine({"master_port": port, "master_address": "127.0.0.1"})
            info = infos.get(timeout=120)
            with pytest.raises(RuntimeError, match=r"start_weight_update\(\) first"):
                llm.update_weights(info)
            llm.start_weight_update()
            llm.update_weights({"names": info.names, "dtype_names": info.dtype_names,
                                "shapes": info.shapes})  # fmt: skip
            assert greedy(llm)[0] == before, "received weights wait for finish_weight_update"
            llm.finish_weight_update()
            after, _ = greedy(llm)
    finally:
        trainer.join(timeout=60)
    assert trainer.exitcode == 0
    assert after == hf_tokens(perturbed(llama_dir))
    assert after != before


@pytest.mark.gpu
def test_on_cuda_updates_reach_the_graphs_and_sleep_frees_the_device(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    """In-place copies keep the captured decode graphs' addresses; level 1 moves the
    weights to host memory and frees the cache, and waking recaptures the graphs."""
    model_dir = tiny_model_dir("qwen3")
    new_model = perturbed(model_dir)
    cache_bytes = 2**26
    with LLM(model_dir, device="cuda", dtype="float32", block_size=16,
             max_model_len=96, kv_cache_memory_bytes=cache_bytes) as llm:  # fmt: skip
        assert llm.engine.model_runner.decode_graphs is not None
        llm.update_weights(new_model.named_parameters())
        expected = hf_tokens(new_model)
        assert greedy(llm)[0] == expected
        allocated = torch.cuda.memory_allocated()
        llm.sleep(level=1)
        weights = sum(p.numel() * 4 for p in new_model.parameters())
        assert allocated - torch.cuda.memory_allocated() > 0.9 * (cache_bytes + weights / 2)
        llm.wake_up()
        assert llm.engine.model_runner.decode_graphs is not None
        assert greedy(llm)[0] == expected
