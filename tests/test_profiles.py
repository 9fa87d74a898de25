"""Model profiles: each family's conventions, detected from its config and checked end to end.

The released checkpoints are 7-26B parameters and cannot be downloaded here, so every family
is exercised with a tiny randomly initialised stand-in saved in its on-disk format: the
remote-code families (LLaDA, Dream, SDAR) through the modules in ``tests/standins/`` loaded
with ``trust_remote_code`` via ``auto_map``; DiffusionGemma and Qwen2.5 through
``transformers``' own classes. The stand-ins keep the vocabularies (and so the real mask and
EOS ids) of LLaDA and Dream with a hidden size of 8-16 and one layer.
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
from dloom.attention import block_causal_mask
from dloom.cli import app
from dloom.errors import ModelError
from dloom.profiles import (
    CAUSAL_LM, DIFFUSION_GEMMA, DREAM, FAMILIES, LLADA, SDAR, TRANSFORMERS, CachedConventionForward,
    ConventionForward, ModelProfile, detect_profile, wrap_forward,
)

STANDINS = Path(__file__).parent / "standins"

LLADA_CONFIG = {
    "model_type": "llada",
    "architectures": ["LLaDAModelLM"],
    "auto_map": {
        "AutoConfig": "configuration_llada.LLaDAConfig",
        "AutoModel": "modeling_llada.LLaDAModelLM",
        "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
    },
    "vocab_size": 126464, "embedding_size": 126464, "d_model": 8, "n_heads": 2, "n_layers": 1,
    "mlp_hidden_size": 16, "max_sequence_length": 4096, "eos_token_id": 126081,
    "pad_token_id": 126081, "use_cache": False,
}
DREAM_CONFIG = {
    "model_type": "Dream",
    "architectures": ["DreamModel"],
    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
    "vocab_size": 152064, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "eos_token_id": 151643, "pad_token_id": 151643, "bos_token_id": 151643,
    "tie_word_embeddings": False, "initializer_range": 0.5,
}
SDAR_MASK = 63
SDAR_CONFIG = {
    "model_type": "sdar",
    "architectures": ["SDARForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_sdar.SDARConfig",
        "AutoModel": "modeling_sdar.SDARForCausalLM",
        "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
    },
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 128, "eos_token_id": 2, "pad_token_id": 0,
    "tie_word_embeddings": False, "initializer_range": 0.2,
}


def remote_checkpoint(directory: Path, family: str, config: dict, seed: int = 0, setup=None) -> Path:
    """Save a stand-in checkpoint as a release would ship it: config.json with ``auto_map``,
    the modelling ``.py`` files and the weights."""
    directory.mkdir(parents=True)
    for source in (STANDINS / family).glob("*.py"):
        shutil.copy(source, directory)
    (directory / "config.json").write_text(json.dumps(config))
    loaded = transformers.AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=True)
    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(loaded, trust_remote_code=True)
    if setup is not None:
        setup(model)
    model.save_pretrained(directory)
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
        ({"model_type": "diffusion_gemma", "architectures": ["DiffusionGemmaForBlockDiffusion"]}, DIFFUSION_GEMMA),
        ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, CAUSAL_LM),
        ({"model_type": "llama", "is_causal": False, "mask_token_id": 1}, TRANSFORMERS),
        ({"model_type": "llama", "mask_token_id": 1}, TRANSFORMERS),
        ({"model_type": "llama", "dloom": {"attention": "causal", "shift": True}}, TRANSFORMERS),
    ],
    ids=[
        "llada", "llada-by-auto_map", "llada-by-architecture", "dream", "dream-by-model_type",
        "sdar", "diffusion-gemma", "qwen2-causal", "native-dllm", "native-with-mask", "zoo-ar",
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
                 p.block_length, p.trust_remote_code, p.padding, p.takes_position_ids, p.kv_cache)
        for p in FAMILIES
    }
    assert table == {
        "llada": (126336, "<|mdm_mask|>", (126081, 126348), False, "bidirectional", None, True, "refuse", False, False),
        "dream": (151666, "<|mask|>", (151643,), True, "bidirectional", None, True, "4d", True, True),
        "sdar": (None, "<|MASK|>", (), False, "block-causal", 4, True, "4d", True, True),
        "diffusion-gemma": (None, None, (), None, None, None, False, "2d", True, True),
    }
    assert DIFFUSION_GEMMA.unsupported and all(p.unsupported is None for p in FAMILIES[:3])
    assert SDAR.cache_kwargs == (("store_kv", True),) and DREAM.no_mask_value == "full"
    assert (CAUSAL_LM.attention, CAUSAL_LM.shift_logits, CAUSAL_LM.mask_token_id) == ("causal", True, None)
    assert all(p.chat_template for p in (LLADA, DREAM, SDAR, CAUSAL_LM))


def test_unknown_padding_mode_is_refused():
    with pytest.raises(ValueError, match="padding 'right'; allowed: 2d, 4d, refuse"):
        ModelProfile(name="x", family="x", padding="right")


def test_native_families_need_no_wrapper():
    model = torch.nn.Linear(1, 1)
    assert wrap_forward(model, TRANSFORMERS) is model and wrap_forward(model, CAUSAL_LM) is model
    assert type(wrap_forward(model, LLADA)) is ConventionForward
    assert type(wrap_forward(model, DREAM)) is CachedConventionForward


class Recorder(torch.nn.Module):
    """Records the keyword arguments of every call."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = "inner config"
        self.calls = []

    def forward(self, **kwargs):
        self.calls.append(kwargs)
        return kwargs


def test_convention_forward_translates_dloom_calls():
    ids = torch.tensor([[4, 5, 6]])
    padding = torch.tensor([[0, 1, 1]])
    positions = torch.tensor([[0, 0, 1]])

    llada = wrap_forward(Recorder(), LLADA)
    assert llada.config == "inner config"
    assert llada(ids, None, positions) == {"input_ids": ids, "attention_mask": None}
    with pytest.raises(ModelError, match="ignores attention masks"):
        llada(ids, padding, positions)

    dream = wrap_forward(Recorder(), DREAM)
    assert dream(ids, None, positions)["attention_mask"] == "full"
    four_d = dream(ids, padding, positions)["attention_mask"]
    assert four_d.dtype == torch.bool and four_d.shape == (1, 1, 3, 3)
    assert torch.equal(four_d[0, 0], torch.tensor([[False, True, True]] * 3))
    assert dream(ids, padding, positions)["position_ids"] is positions
    additive = torch.where(four_d, 0.0, torch.finfo(torch.float32).min)
    assert torch.equal(dream(ids, additive, positions)["attention_mask"], four_d)
    assert "past_key_values" not in dream(ids, padding, positions)

    sdar = wrap_forward(Recorder(), SDAR)
    cached = sdar(ids, four_d, positions, past_key_values="cache", use_cache=True)
    assert (cached["past_key_values"], cached["use_cache"], cached["store_kv"]) == ("cache", True, True)
    assert "store_kv" not in sdar(ids, four_d, positions)


# --- LLaDA: remote code, mask 126336, EOS/EOT, no shift, no padding, no cache ----------------


@pytest.fixture(scope="module")
def llada_dir(tmp_path_factory) -> Path:
    return remote_checkpoint(tmp_path_factory.mktemp("ckpt") / "llada", "llada", LLADA_CONFIG)


def test_remote_code_is_never_run_without_the_flag(llada_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("transformers was asked to load the checkpoint")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)
    with pytest.raises(ModelError, match=r"ships its own modelling code.*pass --trust-remote-code"):
        load_model(llada_dir)


def test_unknown_remote_code_model_needs_the_flag(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "mystery", "auto_map": {"AutoModel": "modeling_mystery.Mystery"}}
    ))
    with pytest.raises(ModelError, match=r"\(model_type 'mystery'\) ships its own modelling code"):
        load_model(tmp_path)


def test_llada_conventions(llada_dir):
    adapter = load_model(llada_dir, trust_remote_code=True)
    assert adapter.profile == "llada"
    assert adapter.mask_token_id == 126336
    assert adapter.eos_token_ids == (126081, 126348)
    assert adapter.pad_token_id == 126081
    assert adapter.shift_logits is False and adapter.attention == "bidirectional"
    assert isinstance(adapter.model, ConventionForward)
    assert type(adapter.model.inner).__name__ == "LLaDAModelLM"


def test_llada_mask_id_precedence(tmp_path):
    """Explicit argument > config ``dloom`` section > config field > profile default."""
    directory = remote_checkpoint(tmp_path / "llada-ids", "llada", {**LLADA_CONFIG, "mask_token_id": 7})
    assert load_model(directory, trust_remote_code=True).mask_token_id == 7
    config = json.loads((directory / "config.json").read_text())
    config["dloom"] = {"mask_token_id": 9, "eos_token_ids": [5]}
    (directory / "config.json").write_text(json.dumps(config))
    adapter = load_model(directory, trust_remote_code=True)
    assert (adapter.mask_token_id, adapter.eos_token_ids) == (9, (5,))
    assert load_model(directory, trust_remote_code=True, mask_token_id=11).mask_token_id == 11


def test_llada_decodes_end_to_end(llada_dir):
    adapter = load_model(llada_dir, trust_remote_code=True)
    decoder = DiffusionDecoder(adapter, "threshold", gen_length=8, block_length=4, steps=8)
    prompts = [[100, 200, 300], [400, 500, 600]]
    result = decoder.generate(prompts)
    assert result.generated.shape == (2, 8)
    finished = result.generated[:, : int(result.generated_lengths.min())]
    assert not (finished == 126336).any()
    alone = decoder.generate(prompts[1:])
    assert torch.equal(alone.generated[0], result.generated[1])


def test_llada_refuses_a_padded_batch_and_a_kv_cache(llada_dir):
    adapter = load_model(llada_dir, trust_remote_code=True)
    decoder = DiffusionDecoder(adapter, gen_length=4, block_length=4)
    with pytest.raises(ModelError, match="ignores attention masks.*equal token length.*--batch-size 1"):
        decoder.generate([[100, 200, 300], [400]])
    with pytest.raises(ModelError, match="cache 'prefix' needs a model whose forward takes a transformers cache"):
        DiffusionDecoder(adapter, gen_length=4, cache="prefix")


def test_cli_generate_from_the_checkpoint_alone(llada_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input_ids": [100, 200, 300]}\n{"input_ids": [400]}\n')
    args = ["generate", "--model", str(llada_dir), "--prompts", str(prompts), "--gen-length", "4",
            "--block-length", "4", "--json"]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 2 and "--trust-remote-code" in refused.output
    result = CliRunner().invoke(app, args + ["--trust-remote-code"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 2 and "decoding one prompt at a time" in result.stderr
    assert rows[0]["config"]["model"] == str(llada_dir) and len(rows[0]["tokens"]) <= 4
    assert load_model(llada_dir, trust_remote_code=True).can_pad is False


# --- Dream: Qwen2-based, logits shifted by one, mask 151666, 4-D masks --------------------

DREAM_MASK = 151666
MASK_SLOT = 15  # the hidden dimension carrying the mask token in the echo stand-in
FROM_MASK = 7  # what the echo stand-in predicts after a mask


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
    return remote_checkpoint(tmp_path_factory.mktemp("ckpt") / "dream_echo", "dream", DREAM_CONFIG, setup=echo_next)


@pytest.fixture(scope="module")
def dream_dir(tmp_path_factory) -> Path:
    return remote_checkpoint(tmp_path_factory.mktemp("ckpt") / "dream", "dream", DREAM_CONFIG, seed=3)


def test_dream_conventions(dream_echo_dir):
    adapter = load_model(dream_echo_dir, trust_remote_code=True)
    assert adapter.profile == "dream"
    assert adapter.mask_token_id == DREAM_MASK
    assert 151643 in adapter.eos_token_ids and adapter.pad_token_id == 151643
    assert adapter.shift_logits is True and adapter.attention == "bidirectional"
    assert isinstance(adapter.model, CachedConventionForward) and adapter.can_pad


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_dream_shift_is_observable(dream_echo_dir, cache):
    adapter = load_model(dream_echo_dir, trust_remote_code=True)
    decoder = DiffusionDecoder(adapter, "quota", gen_length=8, block_length=4, cache=cache)
    result = decoder.generate([[3, 4], [5]])  # left-padded: exercises the 4-D mask
    assert result.generated.tolist() == [list(range(5, 13)), list(range(6, 14))]
    unshifted = load_model(dream_echo_dir, trust_remote_code=True, shift_logits=False)
    wrong = DiffusionDecoder(unshifted, "quota", gen_length=8, block_length=4, cache=cache).generate([[3, 4]])
    assert wrong.generated.tolist() == [[FROM_MASK] * 8]


def test_dream_padded_batch_equals_each_prompt_alone(dream_dir):
    adapter = load_model(dream_dir, trust_remote_code=True, dtype="float64")
    decoder = DiffusionDecoder(adapter, "quota", gen_length=8, block_length=4)
    prompts = [[30, 31, 32, 33], [40]]
    batch = decoder.generate(prompts)
    for row, prompt in enumerate(prompts):
        assert torch.equal(decoder.generate([prompt]).generated[0], batch.generated[row])


def test_dream_forward_takes_the_4d_mask_the_wrapper_builds(dream_dir):
    adapter = load_model(dream_dir, trust_remote_code=True, dtype="float64")
    ids = torch.tensor([[0, 30, 31], [40, 41, 42]])
    padding = torch.tensor([[0, 1, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match="takes a \\(B, 1, Q, K\\) bool mask"):
        adapter.model.inner(input_ids=ids, attention_mask=padding)
    padded = adapter.logits(ids, padding)
    alone = adapter.logits(ids[:1, 1:])
    torch.testing.assert_close(padded[:1, 2], alone[:, 1], rtol=0, atol=1e-10)


# --- SDAR: block-causal, block size 4, mask from the tokenizer, exact prefix cache ---------


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory) -> Path:
    directory = remote_checkpoint(tmp_path_factory.mktemp("ckpt") / "sdar", "sdar", SDAR_CONFIG, seed=1)
    word_tokenizer(directory, 64, mask="<|MASK|>")
    return directory


def test_sdar_conventions(sdar_dir):
    adapter = load_model(sdar_dir, trust_remote_code=True, dtype="float64")
    assert adapter.profile == "sdar"
    assert adapter.tokenizer.mask_token_id is None  # found by the profile's token text
    assert adapter.mask_token_id == SDAR_MASK
    assert adapter.attention == "block-causal" and adapter.shift_logits is False
    assert adapter.default_block_length == 4
    assert DiffusionDecoder(adapter, gen_length=8).block_length == 4
    assert DiffusionDecoder(adapter, gen_length=8, block_length=8).block_length == 8


def test_sdar_gets_the_block_causal_mask(sdar_dir):
    adapter = load_model(sdar_dir, trust_remote_code=True, dtype="float64")
    decoder = DiffusionDecoder(adapter, gen_length=8)
    decoder.generate(["w10 w11 w12", "w20"])
    seen = adapter.model.inner.attention_masks[0]  # the first forward: whole batch, no cache
    padding = torch.tensor([[1, 1, 1] + [1] * 8, [0, 0, 1] + [1] * 8])
    assert torch.equal(seen, block_causal_mask(padding, 3, 4))


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_sdar_kv_cache_is_exact(sdar_dir, cache):
    adapter = load_model(sdar_dir, trust_remote_code=True, dtype="float64")
    prompts = [[10, 11, 12], [20], [30, 31]]
    reference = DiffusionDecoder(adapter, "threshold", gen_length=12, tau=0.3).generate(prompts)
    cached = DiffusionDecoder(adapter, "threshold", gen_length=12, tau=0.3, cache=cache).generate(prompts)
    assert torch.equal(cached.generated, reference.generated)
    assert cached.forwards == reference.forwards


# --- DiffusionGemma: native in transformers 5, refused with the reason ---------------------


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


def test_diffusion_gemma_is_refused_with_the_reason(tmp_path):
    model = tiny_diffusion_gemma()
    model.save_pretrained(tmp_path / "dg")
    with pytest.raises(ModelError, match="uniform-noise block diffusion model, not a masked one"):
        load_model(tmp_path / "dg")


def test_diffusion_gemma_structure_behind_the_refusal():
    """The facts docs/models.md gives as the reason, on the real transformers classes."""
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
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSampler

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
    assert adapter.model is not None and not isinstance(adapter.model, ConventionForward)
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
    import importlib.util

    path = Path(__file__).parents[1] / "benchmarks" / "gpu" / "run_papers.py"
    spec = importlib.util.spec_from_file_location("run_papers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_run_papers_plan_lists_pending_strategies(capsys):
    module = run_papers_module()
    assert module.main(["--plan", "--llada", "/l", "--dream", "/d", "--qwen", "/q"]) == 0
    runs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len([r for r in runs if r["model"] == "llada" and "pending" not in r]) == 15
    assert {r["strategy"] for r in runs if "pending" in r} == {"failfast", "failfast target"}
    assert module.final_number("so 3 + 4 = 7\n#### 1,234.") == "1234"
    assert module.main([]) == 2


def test_run_papers_end_to_end_on_stand_ins(llada_dir, dream_echo_dir, qwen_dir, tmp_path):
    llada, dream = tmp_path / "llada", tmp_path / "dream"
    shutil.copytree(llada_dir, llada)
    shutil.copytree(dream_echo_dir, dream)
    for directory in (llada, dream):
        word_tokenizer(directory, 64, chat=True)
    problems = tmp_path / "gsm.jsonl"
    problems.write_text("".join(
        json.dumps({"question": f"w{10 + i} w{20 + i}", "answer": f"w6 #### {i}"}) + "\n" for i in range(3)
    ))
    out = tmp_path / "report.json"
    args = ["--llada", llada, "--dream", dream, "--qwen", qwen_dir, "--prompts", problems,
            "--fewshot", "1", "--gen-length", "8", "--block-length", "4", "--batch-size", "2",
            "--dtype", "float32", "--device-map", "none", "--device", "cpu", "--out", out]
    assert run_papers_module().main([str(a) for a in args]) == 0
    runs = json.loads(out.read_text())["runs"]
    ran = {(r["model"], r["strategy"], r["cache"]): r for r in runs if "accuracy" in r}
    strategies = ("quota", "threshold", "frechet", "spiffy", "spiffy+threshold")
    assert set(ran) == {(m, s, c) for m in ("llada", "dream") for s in strategies
                        for c in (("none",) if m == "llada" else ("none", "prefix", "dual"))}
    assert all(r["n"] == 2 and r["nfe_mean"] > 0 for r in ran.values())
    skipped = [r for r in runs if "skipped" in r]
    assert len(skipped) == 10 and all(r["model"] == "llada" for r in skipped), skipped
    assert {r["strategy"] for r in runs if "pending" in r} == {"failfast", "failfast target"}
    target = next(r for r in runs if r["model"] == "qwen")
    assert target["loaded"] == {"profile": "causal-lm", "attention": "causal", "dtype": "torch.float32"}


def test_cli_device_map_reaches_load_model(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(transformers.utils, "is_accelerate_available", lambda: False)
    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_model_dir), "--device-map", "auto", "w"])
    assert result.exit_code == 2 and "device_map='auto' needs the accelerate package" in result.output
