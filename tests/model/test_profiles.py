"""Model profiles: each family's conventions, detected from its config and checked end to end.

The released checkpoints are 4-26B parameters and cannot be downloaded here. Every known
family is loaded onto ``transformers``' own classes without its code; its logits and decodes
are checked against the published code in ``tests/model/test_real_families.py`` (tiny real-format
checkpoints with the reference outputs). This module checks detection, the profile table and
the decoder-level conventions on small checkpoints saved in each family's format: LLaDA from
the real-format fixture, Dream and SDAR written here in their on-disk format (the tensor
names are the native ones), with hand-set weights where a convention must be observable.
DiffusionGemma and Qwen2.5 go through ``transformers``' own classes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from conftest import tiny_model
from dloom import DiffusionDecoder, ModelAdapter, load_model
from dloom.cli.commands import app
from dloom.errors import ModelError
from dloom.hooks.registry import get_registry
from dloom.model.checkpoints import native_config
from dloom.model.profiles import (
    CAUSAL_LM,
    DIFFUSION_GEMMA,
    DREAM,
    FAST_DLLM_V2,
    LLADA,
    LLADA2,
    SDAR,
    SDAR_MOE,
    TRANSFORMERS,
    ModelProfile,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "real-families"


def detect_profile(config) -> ModelProfile:
    """The profile of the registered family that recognises ``config``."""
    return get_registry().families.detect(config).profile


def native_layout(family: str):
    """The native layout registered with ``family``'s profile."""
    return get_registry().families.get(family).layout

LLADA_CONFIG = json.loads((FIXTURES / "llada" / "checkpoint" / "config.json").read_text())
DREAM_CONFIG = {
    "model_type": "Dream",
    "architectures": ["DreamModel"],
    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
    "vocab_size": 152064, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "eos_token_id": 151643, "pad_token_id": 151643, "bos_token_id": 151643, "mask_token_id": 151666,
    "tie_word_embeddings": False, "initializer_range": 0.5, "rope_theta": 1000000.0,
}
SDAR_MASK = 63
SDAR_CONFIG = {
    "model_type": "sdar",
    "architectures": ["SDARForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_sdar.SDARConfig",
        "AutoModel": "modeling_sdar.SDARModel",
        "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
    },
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "block_size": 4,
    "max_position_embeddings": 128, "eos_token_id": 2, "pad_token_id": 0,
    "tie_word_embeddings": False, "initializer_range": 0.2, "rope_theta": 1000000,
}
FAST_DLLM_V2_CONFIG = {
    "model_type": "Fast_dLLM_Qwen",
    "architectures": ["Fast_dLLM_QwenForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration.Fast_dLLM_QwenConfig",
        "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM",
    },
    "vocab_size": 151936, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256,
    "bd_size": 32, "eos_token_id": 151645, "bos_token_id": 151643, "tie_word_embeddings": False,
    "rope_theta": 1000000.0, "use_sliding_window": False,
}
LLADA2_CONFIG = {
    "model_type": "llada2_moe",
    "architectures": ["LLaDA2MoeModelLM"],
    "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                 "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
}


def family_checkpoint(directory: Path, family: str, config: dict, seed: int = 0, setup=None) -> Path:
    """Save a checkpoint as the family's release ships it: its own ``config.json`` (with
    ``auto_map``, no ``.py`` files) and weights under the released tensor names (for Dream,
    SDAR and Fast-dLLM v2 the native Qwen names)."""
    layout = native_layout(family)
    assert not layout.key_mapping, "this helper writes native tensor names"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(native_config(layout, config))
    if setup is not None:
        setup(model)
    model.save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def word_tokenizer(directory: Path, size: int, mask: str | None = None, chat: bool = False) -> None:
    """A word-level tokenizer over ``w3 .. w{size-1}`` with ``<pad>`` 0, ``<unk>`` 1,
    ``<eos>`` 2; ``mask`` is put in the vocabulary (as the last id) without being declared
    the tokenizer's mask token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = size - 1 if mask is not None else size
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, words)}}
    if mask is not None:
        vocab[mask] = size - 1
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    if chat:
        tokenizer.chat_template = (
            "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"
            "{% if add_generation_prompt %}w5{% endif %}"
        )
    tokenizer.save_pretrained(directory)


# --- detection from the config alone ------------------------------------------------------


def qwen25_config(**overrides) -> transformers.Qwen2Config:
    values = dict(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
    )
    values.update(overrides)
    return transformers.Qwen2Config(**values)


@pytest.mark.parametrize(
    "config, expected",
    [
        (LLADA_CONFIG, LLADA),
        ({"auto_map": {"AutoModel": "GSAI-ML/LLaDA-8B-Instruct--modeling_llada.LLaDAModelLM"}}, LLADA),
        ({"architectures": ["LLaDAModelLM"]}, LLADA),
        (DREAM_CONFIG, DREAM),
        ({"model_type": "Dream"}, DREAM),
        (SDAR_CONFIG, SDAR),
        (FAST_DLLM_V2_CONFIG, FAST_DLLM_V2),
        ({"architectures": ["Fast_dLLM_QwenForCausalLM"]}, FAST_DLLM_V2),
        (LLADA2_CONFIG, LLADA2),
        ({"model_type": "diffusion_gemma", "architectures": ["DiffusionGemmaForBlockDiffusion"]}, DIFFUSION_GEMMA),
        ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, CAUSAL_LM),
        ({"model_type": "llama", "is_causal": False, "mask_token_id": 1}, TRANSFORMERS),
        ({"model_type": "llama", "mask_token_id": 1}, TRANSFORMERS),
        ({"model_type": "llama", "dloom": {"attention": "causal", "shift": True}}, TRANSFORMERS),
    ],
    ids=[
        "llada", "llada-by-auto_map", "llada-by-architecture", "dream", "dream-by-model_type",
        "sdar", "fast-dllm-v2", "fast-dllm-v2-by-architecture", "llada2", "diffusion-gemma",
        "qwen2-causal", "native-dllm", "native-with-mask", "zoo-ar",
    ],
)
def test_detect_profile_from_the_config_alone(config, expected):
    assert detect_profile(config) is expected


def test_detect_profile_reads_a_transformers_config_and_a_directory(tmp_path):
    assert detect_profile(qwen25_config()) is CAUSAL_LM
    (tmp_path / "config.json").write_text(json.dumps(DREAM_CONFIG))
    assert detect_profile(tmp_path) is DREAM
    with pytest.raises(ModelError, match="no config.json in"):
        detect_profile(tmp_path / "absent")


def test_family_conventions():
    """The published conventions each profile encodes (docs/models.md cites the sources)."""
    table = {
        p.name: (p.mask_token_id, p.mask_token, p.eos_token_ids, p.shift_logits, p.attention,
                 p.block_length, p.block_size_key, p.block_alignment, p.ships_code)
        for p in (family.profile for family in get_registry().families if family.identifiers)
    }
    assert table == {
        "llada": (126336, "<|mdm_mask|>", (126081, 126348), False, "bidirectional", None, None, "prompt", True),
        "dream": (151666, "<|mask|>", (151643,), True, "bidirectional", None, None, "prompt", True),
        "sdar": (None, "<|MASK|>", (), False, "block-causal", 4, "block_size", "absolute", True),
        "sdar-moe": (None, "<|MASK|>", (), False, "block-causal", 4, "block_size", "absolute", True),
        "fast-dllm-v2": (151665, "|<MASK>|", (151645,), True, "block-causal", 32, "bd_size", "absolute", True),
        "llada2": (156895, "<|mask|>", (156892,), False, "block-causal", 32, None, "absolute", True),
        "diffusion-gemma": (None, None, (1,), None, "block-causal", None, "canvas_length", "prompt", False),
    }
    assert (DIFFUSION_GEMMA.kernel, DIFFUSION_GEMMA.has_mask_token) == ("uniform", False)
    assert all(p.unsupported is None for p in (LLADA, DREAM, SDAR, SDAR_MOE, FAST_DLLM_V2, LLADA2, DIFFUSION_GEMMA))
    assert all(native_layout(p.name) is not None for p in (LLADA, DREAM, SDAR, SDAR_MOE, FAST_DLLM_V2, LLADA2))
    assert (CAUSAL_LM.attention, CAUSAL_LM.shift_logits, CAUSAL_LM.mask_token_id) == ("causal", True, None)
    assert all(p.chat_template for p in (LLADA, DREAM, SDAR, FAST_DLLM_V2, CAUSAL_LM))


def test_trained_block_length_comes_from_the_config_key():
    assert SDAR.trained_block_length({"block_size": 8}) == 8 and SDAR.trained_block_length({}) == 4
    assert FAST_DLLM_V2.trained_block_length(FAST_DLLM_V2_CONFIG) == 32
    assert LLADA.trained_block_length({"block_size": 8}) is None


def test_unknown_block_alignment_is_refused():
    with pytest.raises(ValueError, match="block_alignment 'left'; allowed: prompt, absolute"):
        ModelProfile(name="x", family="x", block_alignment="left")
    with pytest.raises(ModelError, match="block_alignment 'left' is not supported; allowed: prompt, absolute"):
        ModelAdapter(torch.nn.Linear(1, 1), mask_token_id=1, eos_token_ids=(), pad_token_id=0, block_alignment="left")


# --- remote code --------------------------------------------------------------------------


def test_unknown_remote_code_model_needs_the_flag(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("transformers was asked to load the checkpoint")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "mystery", "auto_map": {"AutoModel": "modeling_mystery.Mystery"}}
    ))
    with pytest.raises(ModelError, match=r"\(model_type 'mystery'\) ships its own modelling code.*pass --trust-remote-code"):
        load_model(tmp_path)


@pytest.mark.parametrize("key, value", [("score_function", "softmax"), ("use_sliding_window", True)])
def test_a_llada2_config_the_native_class_does_not_compute_is_refused_before_loading(tmp_path, monkeypatch, key, value):
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", None)
    directory = tmp_path / "llada2"
    shutil.copytree(FIXTURES / "llada2" / "checkpoint", directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ModelError, match=rf"LLaDA2 config {key}={value!r} is not computed by dloom's BailingMoeV2"):
        load_model(directory, trust_remote_code=True)


# --- LLaDA: a bidirectional Llama, mask 126336, EOS/EOT, no shift, padding honoured --------


@pytest.fixture(scope="module")
def llada_dir() -> Path:
    return FIXTURES / "llada" / "checkpoint"


def test_llada_mask_id_precedence(tmp_path, llada_dir):
    """Explicit argument > config ``dloom`` section > config field > profile default."""
    directory = tmp_path / "llada-ids"
    shutil.copytree(llada_dir, directory)
    config = {**LLADA_CONFIG, "mask_token_id": 7}
    (directory / "config.json").write_text(json.dumps(config))
    assert load_model(directory).mask_token_id == 7
    del config["mask_token_id"]
    (directory / "config.json").write_text(json.dumps(config))
    assert load_model(directory).mask_token_id == 126336
    config["dloom"] = {"mask_token_id": 9, "eos_token_ids": [5]}
    (directory / "config.json").write_text(json.dumps(config))
    adapter = load_model(directory)
    assert (adapter.mask_token_id, adapter.eos_token_ids) == (9, (5,))
    assert load_model(directory, mask_token_id=11).mask_token_id == 11


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_llada_padded_batch_equals_each_prompt_alone(llada_dir, cache):
    """The native forward honours the padding mask, so LLaDA batches prompts of different
    lengths (its released forward ignored the mask; dloom refused such batches)."""
    adapter = load_model(llada_dir)
    decoder = DiffusionDecoder(adapter, "threshold", gen_length=8, block_length=4, cache=cache)
    prompts = [[100, 200, 300], [400], [500, 600]]
    batch = decoder.generate(prompts)
    for row, prompt in enumerate(prompts):
        assert torch.equal(decoder.generate([prompt]).generated[0], batch.generated[row])


# --- Dream: Qwen2-based, logits shifted by one, mask 151666 --------------------------------

DREAM_MASK = 151666
MASK_SLOT = 15  # the hidden dimension carrying the mask token in the echo checkpoint
FROM_MASK = 7  # what the echo checkpoint predicts after a mask


def echo_next(model) -> None:
    """Hand-set weights: the output at position ``i`` is ``x[i] + 1`` (tokens 0..13), or,
    less confidently, ``FROM_MASK`` after a mask. Attention and MLP write nothing, so each
    output depends on its own input only. A Dream-style (shifted) decoder therefore commits
    the position right after the last decoded token first and continues the prompt with
    ``last + 1, last + 2, ...``; an unshifted one writes ``FROM_MASK`` everywhere."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.model.norm.weight.fill_(1.0)
        embed = model.model.embed_tokens.weight
        for token in range(MASK_SLOT):
            embed[token, token] = 1.0
            if token < 14:
                model.lm_head.weight[token + 1, token] = 10.0
        embed[DREAM_MASK, MASK_SLOT] = 1.0
        model.lm_head.weight[FROM_MASK, MASK_SLOT] = 5.0


@pytest.fixture(scope="module")
def dream_echo_dir(tmp_path_factory) -> Path:
    return family_checkpoint(tmp_path_factory.mktemp("ckpt") / "dream_echo", "dream", DREAM_CONFIG, setup=echo_next)


def test_dream_conventions(dream_echo_dir):
    adapter = load_model(dream_echo_dir)
    assert adapter.profile == "dream"
    assert type(adapter.model).__name__ == "Qwen2ForCausalLM"
    assert adapter.mask_token_id == DREAM_MASK
    assert 151643 in adapter.eos_token_ids and adapter.pad_token_id == 151643
    assert adapter.shift_logits is True and adapter.attention == "bidirectional"


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_dream_shift_is_observable(dream_echo_dir, cache):
    adapter = load_model(dream_echo_dir)
    decoder = DiffusionDecoder(adapter, "quota", gen_length=8, block_length=4, cache=cache)
    result = decoder.generate([[3, 4], [5]])  # left-padded
    assert result.generated.tolist() == [list(range(5, 13)), list(range(6, 14))]
    unshifted = load_model(dream_echo_dir, shift_logits=False)
    wrong = DiffusionDecoder(unshifted, "quota", gen_length=8, block_length=4, cache=cache).generate([[3, 4]])
    assert wrong.generated.tolist() == [[FROM_MASK] * 8]


def test_dream_padded_batch_equals_each_prompt_alone():
    adapter = load_model(FIXTURES / "dream" / "checkpoint", dtype="float64")
    decoder = DiffusionDecoder(adapter, "quota", gen_length=8, block_length=4)
    prompts = [[30, 31, 32, 33], [40]]
    batch = decoder.generate(prompts)
    for row, prompt in enumerate(prompts):
        assert torch.equal(decoder.generate([prompt]).generated[0], batch.generated[row])


# --- SDAR: Qwen3, block-causal, block size from the config, mask from the tokenizer -------


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory) -> Path:
    directory = family_checkpoint(tmp_path_factory.mktemp("ckpt") / "sdar", "sdar", SDAR_CONFIG, seed=1)
    word_tokenizer(directory, 64, mask="<|MASK|>")
    return directory


def test_sdar_conventions(sdar_dir):
    adapter = load_model(sdar_dir, dtype="float64")
    assert adapter.profile == "sdar" and type(adapter.model).__name__ == "Qwen3ForCausalLM"
    assert adapter.tokenizer.mask_token_id is None  # found by the profile's token text
    assert adapter.mask_token_id == SDAR_MASK
    assert adapter.attention == "block-causal" and adapter.shift_logits is False
    assert (adapter.default_block_length, adapter.block_alignment) == (4, "absolute")
    assert DiffusionDecoder(adapter, gen_length=8).block_length == 4
    assert DiffusionDecoder(adapter, gen_length=8, block_length=8).block_length == 8


def test_sdar_gets_the_block_causal_mask(sdar_dir):
    adapter = load_model(sdar_dir, dtype="float64")
    seen = []
    adapter.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["attention_mask"]), with_kwargs=True
    )
    DiffusionDecoder(adapter, gen_length=8).generate(["w10 w11 w12", "w20"])
    # SDAR's layout: blocks of 4 from each row's own position 0, prompt included, so the
    # canvas runs K - 1 = 3 positions past gen_length; each row's blocks end at its last
    # block's boundary (row 0: 3 + 8 -> 12 positions, row 1: 1 + 8 -> 12), padding after.
    real = torch.tensor([[1] * 12 + [0] * 2, [0, 0] + [1] * 12])
    block = ((real.cumsum(-1) - 1).clamp(min=0) // 4)
    expected = (block[:, None, :] <= block[:, :, None]) & real.bool()[:, None, :]
    first = seen[0]  # first forward: no cache
    assert first.shape[-1] == 14
    assert torch.equal(first[:, 0] & real.bool()[:, :, None], expected & real.bool()[:, :, None])


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_sdar_kv_cache_is_exact(sdar_dir, cache):
    adapter = load_model(sdar_dir, dtype="float64")
    prompts = [[10, 11, 12], [20], [30, 31]]
    reference = DiffusionDecoder(adapter, "threshold", gen_length=12, tau=0.3).generate(prompts)
    cached = DiffusionDecoder(adapter, "threshold", gen_length=12, tau=0.3, cache=cache).generate(prompts)
    assert torch.equal(cached.generated, reference.generated)
    assert cached.forwards == reference.forwards


# --- Fast-dLLM v2: Qwen2, block-causal, shifted, block size bd_size -------------------------


def test_fast_dllm_v2_loads_natively_with_its_block_mask(tmp_path):
    directory = family_checkpoint(tmp_path / "fast-dllm-v2", "fast-dllm-v2", FAST_DLLM_V2_CONFIG, seed=2)
    adapter = load_model(directory)
    assert type(adapter.model).__name__ == "Qwen2ForCausalLM"
    assert (adapter.mask_token_id, adapter.eos_token_ids, adapter.shift_logits, adapter.attention) == (
        151665, (151645,), True, "block-causal")
    assert (adapter.default_block_length, adapter.block_alignment) == (32, "absolute")
    # Its eval mask: query block >= key block, blocks of bd_size from position 0.
    ids = torch.arange(100, 140)[None]
    blocks = torch.arange(40) // 32
    mask = (blocks[None, :] <= blocks[:, None])[None, None]
    with torch.no_grad():
        logits = adapter.model(input_ids=ids, attention_mask=mask).logits
        first_block = adapter.model(input_ids=ids[:, :32], attention_mask=mask[..., :32, :32]).logits
    torch.testing.assert_close(logits[:, :32], first_block, rtol=0, atol=1e-5)


# --- DiffusionGemma: native in transformers 5, loaded onto its own class ---------------------


def tiny_diffusion_gemma() -> transformers.DiffusionGemmaForBlockDiffusion:
    text = dict(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=8,
        max_position_embeddings=128, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], num_experts=2, top_k_experts=1,
        moe_intermediate_size=16,
    )
    vision = dict(
        model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    )
    config = transformers.DiffusionGemmaConfig(
        text_config=text, vision_config=vision, canvas_length=4, boi_token_id=60,
        eoi_token_id=61, image_token_id=62,
    )
    torch.manual_seed(0)
    return transformers.DiffusionGemmaForBlockDiffusion(config).eval()


def test_diffusion_gemma_loads_without_a_mask_token(tmp_path):
    model = tiny_diffusion_gemma()
    model.save_pretrained(tmp_path / "dg")
    adapter = load_model(tmp_path / "dg")
    assert type(adapter.model) is transformers.DiffusionGemmaForBlockDiffusion
    assert (adapter.mask_token_id, adapter.kernel, adapter.default_block_length) == (None, "uniform", 4)


def test_diffusion_gemma_structure_behind_the_uniform_kernel():
    """The facts docs/models.md gives for its kernel, on the real transformers classes."""
    model = tiny_diffusion_gemma()
    assert getattr(model.config, "mask_token_id", None) is None
    assert getattr(model.config.text_config, "mask_token_id", None) is None
    from inspect import signature

    parameters = signature(model.forward).parameters
    assert {"decoder_input_ids", "self_conditioning_logits", "cache"} <= set(parameters)
    prompt = torch.tensor([[5, 6, 7]])
    canvas = torch.randint(0, 64, (1, model.config.canvas_length))
    with torch.no_grad():
        first = model(input_ids=prompt, decoder_input_ids=canvas)
        second = model(input_ids=prompt, decoder_input_ids=canvas, self_conditioning_logits=first.logits)
    assert first.logits.shape == (1, 4, 64)  # logits for the canvas only
    assert not torch.equal(first.logits, second.logits)  # the step's state includes the logits
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        EntropyBoundSampler,
    )

    assert hasattr(EntropyBoundSampler, "renoise_canvas")


# --- Qwen2.5-style causal target -------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt") / "qwen"
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(qwen25_config()).save_pretrained(directory)
    word_tokenizer(directory, 64, chat=True)
    return directory


def test_causal_target_profile(qwen_dir):
    with pytest.raises(ModelError, match="declares no mask token"):
        load_model(qwen_dir)
    adapter = load_model(qwen_dir, require_mask=False, dtype="float64")
    assert adapter.profile == "causal-lm"
    assert adapter.mask_token_id is None
    assert (adapter.attention, adapter.shift_logits) == ("causal", True)
    assert type(adapter.model).__name__ == "Qwen2ForCausalLM"
    ids = torch.tensor([[5, 6, 7, 8]])
    raw = adapter.model(input_ids=ids).logits
    torch.testing.assert_close(adapter.logits(ids)[:, 1:], raw[:, :-1])
    with pytest.raises(ModelError, match="has no mask token; it cannot be a dLLM"):
        DiffusionDecoder(adapter)


def test_chat_template_through_the_tokenizer(qwen_dir, tiny_model_dir):
    adapter = load_model(qwen_dir, require_mask=False)
    assert adapter.chat_prompts(["w9 w10"]) == ["w3 w9 w10 w4 w5"]
    with pytest.raises(ModelError, match="has no tokenizer chat template; drop --chat"):
        load_model(tiny_model_dir).chat_prompts(["w9"])


def test_cli_chat_flag(tmp_path, monkeypatch):
    directory = tmp_path / "chat-dllm"
    tiny_model().to(torch.float32).save_pretrained(directory)
    word_tokenizer(directory, 39, chat=True)
    seen = []
    original = DiffusionDecoder.generate

    def spy(self, prompts, attention_mask=None, **options):
        seen.extend(prompts)
        return original(self, prompts, attention_mask, **options)

    monkeypatch.setattr(DiffusionDecoder, "generate", spy)
    args = ["generate", "w9", "--model", str(directory), "--gen-length", "4", "--json"]
    assert CliRunner().invoke(app, args + ["--chat"]).exit_code == 0
    assert CliRunner().invoke(app, args).exit_code == 0
    assert seen == ["w3 w9 w4 w5", "w9"]
    prompts = tmp_path / "ids.jsonl"
    prompts.write_text('{"input_ids": [5, 6]}\n')
    refused = CliRunner().invoke(
        app, ["generate", "--model", str(directory), "--prompts", str(prompts), "--chat"]
    )
    assert refused.exit_code == 2 and "--chat applies to text prompts" in refused.output


def test_device_map_reaches_from_pretrained(tiny_model_dir, monkeypatch):
    calls = []
    original = transformers.AutoModelForCausalLM.from_pretrained

    def spy(path, **kwargs):
        calls.append(kwargs.pop("device_map"))  # accelerate may be absent here: place on CPU
        return original(path, **kwargs)

    monkeypatch.setattr(transformers.utils, "is_accelerate_available", lambda: True)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    adapter = load_model(tiny_model_dir, device_map="auto", dtype="bfloat16", device="meta")
    assert calls == ["auto"]
    assert adapter.dtype == torch.bfloat16 and adapter.device.type == "cpu"  # device ignored


def test_device_map_without_accelerate(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(transformers.utils, "is_accelerate_available", lambda: False)
    with pytest.raises(ModelError, match="device_map='auto' needs the accelerate package"):
        load_model(tiny_model_dir, device_map="auto")


# --- benchmarks/gpu/run_papers.py on the stand-ins (CPU, tiny lengths) ----------------------


def run_papers_module():
    from benchmarks.gpu import run_papers

    return run_papers


def test_run_papers_plan_includes_failfast(capsys):
    module = run_papers_module()
    assert module.main(["--plan", "--llada", "/l", "--dream", "/d", "--qwen", "/q"]) == 0
    runs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len([r for r in runs if r["model"] == "llada"]) == 15
    assert [r for r in runs if r["strategy"] == "failfast"] == [
        {"model": "qwen", "path": "/q", "drafter": "/d", "strategy": "failfast", "params": {}, "cache": "none"}
    ]
    assert not any("pending" in r for r in runs)
    assert module.main(["--plan", "--qwen", "/q"]) == 0
    alone = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert alone == [{"model": "qwen", "strategy": "failfast", "pending": module.FAILFAST_NEEDS}]
    assert module.final_number("so 3 + 4 = 7\n#### 1,234.") == "1234"
    assert module.main([]) == 2


def test_run_papers_device_map_defaults_to_what_is_installed(monkeypatch):
    import importlib.util

    module = run_papers_module()
    args = module.parse_args(["--llada", "/l"])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert module.device_map_of(args) is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert module.device_map_of(args) == "auto"
    assert module.device_map_of(module.parse_args(["--device-map", "none"])) is None


def test_run_papers_end_to_end_on_real_format_checkpoints(tmp_path):
    directories = {}
    for family in ("llada", "dream"):
        directories[family] = tmp_path / family
        shutil.copytree(FIXTURES / family / "checkpoint", directories[family])
        word_tokenizer(directories[family], 64, chat=True)
    problems = tmp_path / "gsm.jsonl"
    problems.write_text("".join(
        json.dumps({"question": f"w{10 + i} w{20 + i}", "answer": f"w6 #### {i}"}) + "\n" for i in range(3)
    ))
    out = tmp_path / "report.json"
    args = ["--llada", directories["llada"], "--dream", directories["dream"], "--prompts", problems, "--fewshot", "1", "--gen-length", "8", "--block-length", "4",
            "--batch-size", "2", "--dtype", "float32", "--device-map", "none", "--device", "cpu", "--out", out]
    assert run_papers_module().main([str(a) for a in args]) == 0
    runs = json.loads(out.read_text())["runs"]
    ran = {(r["model"], r["strategy"], r["cache"]): r for r in runs if "accuracy" in r}
    strategies = ("quota", "threshold", "frechet", "spiffy", "spiffy+threshold")
    expected = {(m, s, c) for m in ("llada", "dream") for s in strategies for c in ("none", "prefix", "dual")}
    assert set(ran) == expected
    assert all(r["n"] == 2 and r["nfe_mean"] > 0 for r in ran.values())
    assert not any("skipped" in r or "failed" in r for r in runs)
    assert [r for r in runs if "pending" in r] == [
        {"model": "qwen", "strategy": "failfast", "pending": run_papers_module().FAILFAST_NEEDS}
    ]


def test_cli_device_map_reaches_load_model(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(transformers.utils, "is_accelerate_available", lambda: False)
    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_model_dir), "--device-map", "auto", "w"])
    assert result.exit_code == 2 and "device_map='auto' needs the accelerate package" in result.output


def test_the_dloom_section_names_the_kernel(tmp_path, tiny_model_dir):
    """A zoo model trained to edit its drafts names the revisable kernel in its ``dloom``
    section; an editing rule then runs on it, and a kernel name that is not a name is refused
    when the model loads."""
    config_path = tiny_model_dir / "config.json"
    config = json.loads(config_path.read_text())
    assert load_model(tiny_model_dir).kernel == "absorbing"
    config["dloom"] = {**config.get("dloom", {}), "kernel": "revisable"}
    config_path.write_text(json.dumps(config))
    adapter = load_model(tiny_model_dir)
    assert adapter.kernel == "revisable"
    DiffusionDecoder(adapter, "joint_threshold", gen_length=8, block_length=4).generate([[3, 4]])
    config["dloom"]["kernel"] = ["revisable"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"dloom.kernel is \['revisable'\] \(list\); allowed: a kernel name"):
        load_model(tiny_model_dir)
