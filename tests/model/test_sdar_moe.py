"""SDAR-MoE checkpoints load natively as a block-causal Qwen3-MoE.

No reference output of SDAR-MoE's own code exists here (unlike the other families in
``tests/fixtures/real-families/``), so this test builds a tiny random checkpoint in its
on-disk format and checks what can be checked without that code:

- the format. Config keys and tensor names are those the published SDAR-MoE loaders read:
  JetEngine (Labman42/JetEngine@11563d1, ``jetengine/models/sdar_moe.py``: ``num_experts``,
  ``num_experts_per_tok``, ``moe_intermediate_size``, ``decoder_sparse_step``, Qwen3's
  attention keys; checkpoint names ``mlp.gate``, ``mlp.experts.E.{gate,up,down}_proj``,
  ``self_attn.{q,k}_norm``) and SGLang (sgl-project/sglang, ``srt/models/sdar_moe.py``:
  also ``norm_topk_prob``), with ``model_type`` ``sdar_moe``, ``architectures``
  ``SDARMoeForCausalLM`` (both name these), and the remaining keys as in SDAR-4B-Chat's
  config (``block_size``, ``mask_token_id``, ``auto_map`` to ``modeling_sdar_moe`` /
  ``configuration_sdar_moe``, the training flags);
- the mapping. dloom's load (``trust_remote_code=False``) gives the logits of a
  ``Qwen3MoeForCausalLM`` that this test builds from the same tensors itself (experts
  stacked by hand), and of a plain-torch forward written from JetEngine's description
  (softmax router, top-k, renormalised; SiLU-gated experts; QK norms before RoPE), under
  dloom's block-causal mask with blocks aligned at position 0;
- clear errors for a misspelled or missing tensor name or config key, and a greedy decode.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dloom import DiffusionDecoder, ModelAdapter, load_model
from dloom.errors import ModelError
from dloom.model.attention import absolute_block_ids, mask_from_block_ids

SDAR_FIXTURE = Path(__file__).parents[1] / "fixtures" / "real-families" / "sdar" / "checkpoint"
TOKENIZER_FILES = (
    "added_tokens.json", "chat_template.jinja", "merges.txt", "special_tokens_map.json",
    "tokenizer_config.json", "vocab.json",
)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 16, 2, 1, 8, 2
EXPERTS, TOP_K, EXPERT_WIDTH, VOCAB = 4, 2, 8, 151936
BLOCK = 4

#: SDAR-MoE's config.json at tiny widths (published key names; see the module docstring).
CONFIG = {
    "architectures": ["SDARMoeForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_sdar_moe.SDARMoeConfig",
        "AutoModel": "modeling_sdar_moe.SDARMoeModel",
        "AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM",
    },
    "model_type": "sdar_moe",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_implementation": "flex_attention",
    "block_size": BLOCK,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "mask_token_id": 151669,
    "decoder_sparse_step": 1,
    "ep_size": 1,
    "fuse_cross_entropy": True,
    "head_dim": HEAD_DIM,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": 32,
    "max_position_embeddings": 32768,
    "max_window_layers": LAYERS,
    "mlp_only_layers": [],
    "moe_intermediate_size": EXPERT_WIDTH,
    "norm_topk_prob": True,
    "num_attention_heads": HEADS,
    "num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "num_hidden_layers": LAYERS,
    "num_key_value_heads": KV_HEADS,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": False,
    "use_deepep": False,
    "use_sliding_window": False,
    "vocab_size": VOCAB,
}


def random_tensors(seed: int = 7) -> dict[str, torch.Tensor]:
    """SDAR-MoE's tensors by their checkpoint names, random, bfloat16-exact in float32."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (shift + scale * torch.randn(*shape, generator=generator)).bfloat16().float()

    tensors = {
        "model.embed_tokens.weight": normal(VOCAB, HIDDEN),
        "model.norm.weight": normal(HIDDEN, scale=0.1, shift=1.0),
        "lm_head.weight": normal(VOCAB, HIDDEN, scale=1.5),
    }
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "input_layernorm.weight": normal(HIDDEN, scale=0.1, shift=1.0),
            p + "post_attention_layernorm.weight": normal(HIDDEN, scale=0.1, shift=1.0),
            p + "self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN, scale=HIDDEN ** -0.5),
            p + "self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN, scale=HIDDEN ** -0.5),
            p + "self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN, scale=HIDDEN ** -0.5),
            p + "self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM, scale=(HEADS * HEAD_DIM) ** -0.5),
            p + "self_attn.q_norm.weight": normal(HEAD_DIM, scale=0.1, shift=1.0),
            p + "self_attn.k_norm.weight": normal(HEAD_DIM, scale=0.1, shift=1.0),
            p + "mlp.gate.weight": normal(EXPERTS, HIDDEN),
        }
        for e in range(EXPERTS):
            tensors |= {
                p + f"mlp.experts.{e}.gate_proj.weight": normal(EXPERT_WIDTH, HIDDEN, scale=HIDDEN ** -0.5),
                p + f"mlp.experts.{e}.up_proj.weight": normal(EXPERT_WIDTH, HIDDEN, scale=HIDDEN ** -0.5),
                p + f"mlp.experts.{e}.down_proj.weight": normal(HIDDEN, EXPERT_WIDTH, scale=EXPERT_WIDTH ** -0.5),
            }
    return tensors


def write_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """An SDAR-MoE checkpoint directory: config, generation config, bfloat16 weights and
    SDAR-4B-Chat's tokenizer files; no ``.py`` file."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or CONFIG, indent=2))
    shutil.copy(SDAR_FIXTURE / "generation_config.json", directory)
    for name in TOKENIZER_FILES:
        shutil.copy(SDAR_FIXTURE / name, directory)
    save_file({k: v.bfloat16() for k, v in tensors.items()}, directory / "model.safetensors")
    return directory


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    return random_tensors()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tensors) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("sdar-moe"), tensors)


@pytest.fixture(scope="module")
def loaded(checkpoint) -> ModelAdapter:
    return load_model(checkpoint, trust_remote_code=False)


def direct_qwen3_moe(tensors: dict[str, torch.Tensor], **overrides) -> torch.nn.Module:
    """A ``Qwen3MoeForCausalLM`` built here from the tensors, experts stacked by hand."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**{
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 32, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "moe_intermediate_size": EXPERT_WIDTH,
        "norm_topk_prob": True, **overrides,
    })
    model = Qwen3MoeForCausalLM(config).eval()
    state = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}.mlp.experts."
        state[p + "gate_up_proj"] = torch.stack([
            torch.cat([tensors[f"{p}{e}.gate_proj.weight"], tensors[f"{p}{e}.up_proj.weight"]])
            for e in range(EXPERTS)
        ])
        state[p + "down_proj"] = torch.stack([tensors[f"{p}{e}.down_proj.weight"] for e in range(EXPERTS)])
    model.load_state_dict(state, strict=True)
    return model


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``(B, heads, L, D)`` by the halves (NeoX layout), theta 1e6."""
    inv = 1.0 / 1e6 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    angles = positions[:, None, :, None].float() * inv
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], -1) * sin


def plain_forward(t: dict[str, torch.Tensor], ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """SDAR-MoE's forward as JetEngine describes it, in plain torch: ``(B, L)`` ids, a
    ``(B, 1, L, L)`` bool mask, ``(B, L)`` positions -> ``(B, L, V)`` logits."""
    batch, length = ids.shape
    h = t["model.embed_tokens.weight"][ids]
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        x = rms(h, t[p + "input_layernorm.weight"])
        q = (x @ t[p + "self_attn.q_proj.weight"].T).view(batch, length, HEADS, HEAD_DIM)
        k = (x @ t[p + "self_attn.k_proj.weight"].T).view(batch, length, KV_HEADS, HEAD_DIM)
        v = (x @ t[p + "self_attn.v_proj.weight"].T).view(batch, length, KV_HEADS, HEAD_DIM)
        q = rotate(rms(q, t[p + "self_attn.q_norm.weight"]).transpose(1, 2), positions)
        k = rotate(rms(k, t[p + "self_attn.k_norm.weight"]).transpose(1, 2), positions)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1)
        scores = (q @ k.transpose(-1, -2)) * HEAD_DIM ** -0.5
        attended = scores.masked_fill(~mask, -torch.inf).softmax(-1) @ v
        h = h + attended.transpose(1, 2).reshape(batch, length, -1) @ t[p + "self_attn.o_proj.weight"].T
        x = rms(h, t[p + "post_attention_layernorm.weight"])
        weights, chosen = (x @ t[p + "mlp.gate.weight"].T).softmax(-1).topk(TOP_K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            expert = torch.nn.functional.silu(x @ t[f"{p}mlp.experts.{e}.gate_proj.weight"].T)
            expert = (expert * (x @ t[f"{p}mlp.experts.{e}.up_proj.weight"].T)) @ t[f"{p}mlp.experts.{e}.down_proj.weight"].T
            out = out + expert * (weights * (chosen == e)).sum(-1, keepdim=True)
        h = h + out
    return rms(h, t["model.norm.weight"]) @ t["lm_head.weight"].T


def block_inputs(prompts: list[list[int]], generated: int = 6) -> dict[str, torch.Tensor]:
    """Left-padded prompts followed by masks, with dloom's block-causal mask (blocks at each
    row's position 0) and padding-aware positions."""
    width = max(len(p) for p in prompts) + generated
    rows = [[0] * (width - len(p) - generated) + p + [151669] * generated for p in prompts]
    padding = torch.tensor([[0] * (width - len(p) - generated) + [1] * (len(p) + generated) for p in prompts])
    positions = (padding.cumsum(-1) - 1).clamp(min=0)
    mask = mask_from_block_ids(padding, absolute_block_ids(positions, BLOCK))
    mask = mask | torch.eye(width, dtype=torch.bool)  # a pad query sees itself (no empty softmax)
    return {"input_ids": torch.tensor(rows), "attention_mask": mask, "position_ids": positions}


PROMPTS = [[151644, 872, 198, 9707, 11, 1879], [151644, 872, 198, 3838, 374, 220, 22, 30, 198]]


def test_loads_natively_with_sdars_conventions(loaded):
    assert type(loaded.model).__name__ == "Qwen3MoeForCausalLM"
    assert loaded.profile == "sdar-moe"
    assert (loaded.mask_token_id, loaded.eos_token_ids, loaded.attention, loaded.default_block_length,
            loaded.block_alignment, loaded.shift_logits) == (
        151669, (151643, 151645), "block-causal", BLOCK, "absolute", False)
    config = loaded.model.config
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, config.norm_topk_prob,
            config.is_causal) == (EXPERTS, TOP_K, EXPERT_WIDTH, True, True)


@pytest.mark.parametrize("batch", [[0], [1], [0, 1]], ids=["prompt 6", "prompt 9", "padded batch"])
def test_logits_equal_a_directly_built_qwen3_moe_and_the_plain_forward(loaded, tensors, batch):
    inputs = block_inputs([PROMPTS[i] for i in batch])
    with torch.no_grad():
        mine = loaded.model(**inputs).logits
        direct = direct_qwen3_moe(tensors)(**inputs).logits
        plain = plain_forward(tensors, inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"])
    # Real positions only (a pad query's output is undefined).
    real = torch.tensor([[0] * (mine.shape[1] - len(PROMPTS[i]) - 6) + [1] * (len(PROMPTS[i]) + 6) for i in batch]).bool()
    assert (mine - direct)[real].abs().max() <= 1e-5
    assert (mine - plain)[real].abs().max() <= 1e-4
    assert torch.equal(mine[real].argmax(-1), plain[real].argmax(-1))


def test_the_block_mask_and_the_routing_keys_matter(loaded, tensors):
    """Negative controls: full attention, or top-k weights left unnormalised (the
    ``norm_topk_prob`` key read wrong), give other logits."""
    inputs = block_inputs([PROMPTS[0]])
    with torch.no_grad():
        mine = loaded.model(**inputs).logits
        full = loaded.model(**{**inputs, "attention_mask": torch.ones_like(inputs["attention_mask"])}).logits
        unnormalised = direct_qwen3_moe(tensors, norm_topk_prob=False)(**inputs).logits
    assert (mine - full).abs().max() > 0.1
    assert (mine - unnormalised).abs().max() > 0.1


def test_a_misspelled_tensor_name_is_refused_naming_it(tmp_path, tensors):
    bad = dict(tensors)
    bad["model.layers.0.mlp.experts.1.gate_prj.weight"] = bad.pop("model.layers.0.mlp.experts.1.gate_proj.weight")
    with pytest.raises(ModelError, match=r"tensors with no place in it: 'model\.layers\.0\.mlp\.experts\.1\.gate_prj\.weight'.*lacks: 'model\.layers\.0\.mlp\.experts\.1\.gate_proj\.weight'"):
        load_model(write_checkpoint(tmp_path / "misspelled", bad))


def test_a_missing_tensor_is_refused_naming_it(tmp_path, tensors):
    bad = {k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_norm.weight"}
    with pytest.raises(ModelError, match=r"lacks: 'model\.layers\.1\.self_attn\.k_norm\.weight'"):
        load_model(write_checkpoint(tmp_path / "missing", bad))
    bad = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.experts.3.down_proj.weight"}
    with pytest.raises(ModelError, match=r"lacks: 'model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight'"):
        load_model(write_checkpoint(tmp_path / "missing-expert", bad))
    bad = {k: v for k, v in tensors.items() if not k.startswith("model.layers.0.mlp.experts.") or "up_proj" not in k}
    with pytest.raises(ModelError, match=r"lacks: 'model\.layers\.0\.mlp\.experts\.0\.up_proj\.weight', .*'model\.layers\.0\.mlp\.experts\.3\.up_proj\.weight'"):
        load_model(write_checkpoint(tmp_path / "missing-projection", bad))


@pytest.mark.parametrize("key", ["num_experts", "norm_topk_prob"])
def test_a_missing_moe_config_key_is_refused_naming_it(tmp_path, tensors, key):
    config = {k: v for k, v in CONFIG.items() if k != key}
    with pytest.raises(ModelError, match=f"config.json lacks '{key}', which a sdar-moe config always has"):
        load_model(write_checkpoint(tmp_path / key, tensors, config))


def test_its_own_code_is_never_imported(tmp_path, tensors):
    directory = write_checkpoint(tmp_path / "poisoned", tensors)
    for module in ("modeling_sdar_moe.py", "configuration_sdar_moe.py"):
        (directory / module).write_text("raise RuntimeError('remote code was imported')\n")
    assert type(load_model(directory, trust_remote_code=True).model).__name__ == "Qwen3MoeForCausalLM"


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_greedy_decode_equals_the_directly_built_model(loaded, tensors, cache):
    """dloom's decoder on the loaded checkpoint gives the tokens and forward counts it gives
    on the directly built Qwen3-MoE with the same conventions, under every cache mode."""
    direct = ModelAdapter(
        direct_qwen3_moe(tensors), mask_token_id=151669, eos_token_ids=loaded.eos_token_ids,
        pad_token_id=loaded.pad_token_id, attention="block-causal", default_block_length=BLOCK,
        block_alignment="absolute",
    )
    settings = {"gen_length": 8, "block_length": BLOCK, "tau": 0.85, "cache": cache}
    mine = DiffusionDecoder(loaded, "threshold", **settings).generate(PROMPTS)
    reference = DiffusionDecoder(direct, "threshold", **settings).generate(PROMPTS)
    assert torch.equal(mine.generated, reference.generated)
    assert torch.equal(mine.nfe, reference.nfe)
    assert (mine.generated[:, :8] != 151669).all()


def test_cli_generates_from_the_checkpoint_without_remote_code(checkpoint, loaded):
    from typer.testing import CliRunner

    from dloom.cli.commands import app

    result = CliRunner().invoke(app, ["generate", "--model", str(checkpoint), "--chat", "--gen-length", "8", "--json", "hello"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout.splitlines()[-1])
    assert row["config"]["block_length"] == BLOCK and isinstance(row["text"], str)
    expected = DiffusionDecoder(loaded, gen_length=8, block_length=BLOCK).generate(loaded.chat_prompts(["hello"]))
    assert row["tokens"] == expected.generated[0, : int(expected.generated_lengths[0])].tolist()
