"""BailingMoeV2, the network of LLaDA2.0 and LLaDA2.1, as a ``transformers`` model written here.

LLaDA2.x checkpoints (``model_type: "llada2_moe"``) ship their own modelling code, which
dloom never runs, and ``transformers`` has no class for their architecture. This module is
that architecture, so that :func:`dloom.load_model` loads the published checkpoints (their
tensor names as they are) onto it:

- token embedding ``model.word_embeddings``, an untied ``lm_head``, a final RMSNorm;
  logits are unshifted (the output at ``i`` is the distribution of token ``i``);
- attention: one fused ``attention.query_key_value`` projection (query heads, then key
  heads, then value heads), grouped-query attention, per-head RMSNorms on queries and keys
  (``query_layernorm``/``key_layernorm``) before the rotary embedding, rotary embedding on
  the first ``rotary_dim = int(head_dim * partial_rotary_factor)`` dimensions of each head
  only (frequencies ``theta ** (-2i / rotary_dim)``), output projection ``attention.dense``;
- feed-forward: a SwiGLU MLP in the first ``first_k_dense_replace`` layers, then a mixture
  of experts (:class:`BailingMoeV2Experts`): a sigmoid router with a per-expert selection
  bias and group-limited top-k, plus always-on shared experts.

Attention masks (the conventions of the released forward, reproduced entry by entry in
``tests/model/test_bailing.py``):

- no mask: full bidirectional attention;
- a 4-D ``(B, 1, Q, K)`` mask, bool (``True`` = attend) or additive float (``0`` /
  ``-inf``): used as given (dloom's block-causal masks, :mod:`dloom.model.attention`);
- a 2-D ``(B, K)`` padding mask: causal attention over the real keys, as the released code
  computes it (it builds a causal 4-D mask from any 2-D mask).

The forward reads and extends a ``transformers`` cache (``cache=``, a ``DynamicCache`` or
dloom's record views, :mod:`dloom.model.runner`) and computes the head only on
``logits_to_keep`` columns when asked. RoPE frequencies are computed in the forward from
the config, so there is no ``inv_freq`` buffer for loading to leave uninitialised.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.modeling_outputs import CausalLMOutputWithPast

MODEL_TYPE = "dloom_bailing_moe_v2"


class BailingMoeV2Config(PretrainedConfig):
    """The configuration of :class:`BailingMoeV2ForCausalLM` (the LLaDA2.x ``config.json``
    keys of the same names; :func:`dloom.model.checkpoints.native_config` translates one).

    :ivar head_dim: per-head width (``hidden_size // num_attention_heads`` when ``None``).
    :ivar partial_rotary_factor: share of each head's dimensions that the rotary embedding
        turns.
    :ivar num_experts: routed experts per MoE layer (``None`` or 0: every layer is dense).
    :ivar num_experts_per_tok: experts each token is routed to (``k``).
    :ivar n_group: groups the experts are split into; ``topk_group`` of them are eligible
        per token.
    :ivar routed_scaling_factor: factor on the routed experts' weights.
    :ivar norm_topk_prob: the ``k`` routing weights are normalised to sum to 1 (for ``k > 1``).
    :ivar num_shared_experts: width multiple of the shared expert (``None`` or 0: none).
    :ivar first_k_dense_replace: leading layers with a dense MLP of ``intermediate_size``.
    """

    model_type = MODEL_TYPE

    def __init__(
        self,
        vocab_size: int = 157184,
        hidden_size: int = 2048,
        intermediate_size: int = 5120,
        moe_intermediate_size: int = 512,
        num_hidden_layers: int = 20,
        num_attention_heads: int = 16,
        num_key_value_heads: int = 4,
        head_dim: int | None = None,
        partial_rotary_factor: float = 0.5,
        rope_theta: float = 600000.0,
        rms_norm_eps: float = 1e-6,
        hidden_act: str = "silu",
        use_qkv_bias: bool = False,
        use_bias: bool = False,
        use_qk_norm: bool = True,
        num_experts: int | None = 256,
        num_experts_per_tok: int = 8,
        n_group: int = 8,
        topk_group: int = 4,
        routed_scaling_factor: float = 2.5,
        norm_topk_prob: bool = True,
        num_shared_experts: int | None = 1,
        first_k_dense_replace: int = 1,
        max_position_embeddings: int = 16384,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.moe_intermediate_size = moe_intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.partial_rotary_factor = partial_rotary_factor
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.hidden_act = hidden_act
        self.use_qkv_bias = use_qkv_bias
        self.use_bias = use_bias
        self.use_qk_norm = use_qk_norm
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.norm_topk_prob = norm_topk_prob
        self.num_shared_experts = num_shared_experts
        self.first_k_dense_replace = first_k_dense_replace
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.tie_word_embeddings = tie_word_embeddings
        super().__init__(**kwargs)

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that the rotary embedding turns."""
        return int(self.head_dim * self.partial_rotary_factor)


class BailingRMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in float32: ``weight * x / rms(x)``."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class BailingMLP(nn.Module):
    """SwiGLU MLP ``down(act(gate(x)) * up(x))``: the dense layers, each expert, the shared
    experts."""

    def __init__(self, config: BailingMoeV2Config, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class BailingRouter(nn.Module):
    """The MoE router: sigmoid scores, group-limited top-k selection with a selection bias.

    ``weight`` ``(E, H)`` scores each expert; ``expert_bias`` ``(E,)`` (a persistent buffer,
    as in the checkpoints) is added to the scores for choosing experts only.
    """

    expert_bias: torch.Tensor

    def __init__(self, config: BailingMoeV2Config) -> None:
        super().__init__()
        experts = int(config.num_experts or 0)
        if experts % config.n_group:
            raise ValueError(f"num_experts {experts} is not a multiple of n_group {config.n_group}")
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.scale = config.routed_scaling_factor
        self.normalise = config.norm_topk_prob and self.top_k > 1
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(experts))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``(T, H)`` tokens.

        A group's score is the sum of its two best biased scores; the ``topk_group`` best
        groups are eligible and the ``k`` best biased scores among their experts are chosen.
        Their weights are the unbiased sigmoid scores, normalised to sum to 1
        (``norm_topk_prob``, ``k > 1``), times ``routed_scaling_factor``.

        :return: ``(T, k)`` long expert ids and ``(T, k)`` float32 weights.
        """
        scores = torch.sigmoid(F.linear(hidden.float(), self.weight.float()))
        biased = scores + self.expert_bias.float()
        grouped = biased.view(scores.shape[0], self.n_group, -1)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        groups = group_scores.topk(self.topk_group, dim=-1).indices
        eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        eligible = eligible.unsqueeze(-1).expand_as(grouped).reshape_as(scores)
        chosen = biased.masked_fill(~eligible, float("-inf")).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.normalise:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return chosen, weights * self.scale


class BailingMoeV2Experts(nn.Module):
    """The mixture-of-experts feed-forward: routed experts plus shared experts.

    Tensor names: ``gate.weight``, ``gate.expert_bias``, ``experts.N.{gate,up,down}_proj``,
    ``shared_experts.{gate,up,down}_proj``.
    """

    def __init__(self, config: BailingMoeV2Config) -> None:
        super().__init__()
        self.gate = BailingRouter(config)
        self.experts = nn.ModuleList(
            BailingMLP(config, config.moe_intermediate_size) for _ in range(int(config.num_experts or 0))
        )
        shared = int(config.num_shared_experts or 0)
        self.shared_experts = BailingMLP(config, config.moe_intermediate_size * shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, L, H)`` -> ``(B, L, H)``. Tokens are sorted by expert and each expert runs
        once on its tokens (one host read per layer: the tokens per expert)."""
        flat = x.reshape(-1, x.shape[-1])
        chosen, weights = self.gate(flat)
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts)).tolist()
        tokens = flat[order // chosen.shape[1]]
        outputs = torch.empty_like(tokens)
        begin = 0
        for expert, count in zip(self.experts, counts):
            if count:
                outputs[begin : begin + count] = expert(tokens[begin : begin + count])
            begin += count
        routed = torch.empty_like(outputs)
        routed[order] = outputs
        mixed = (routed.view(*chosen.shape, -1).float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)
        if self.shared_experts is not None:
            mixed = mixed + self.shared_experts(flat)
        return mixed.view_as(x)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotary embedding on the first ``rotary_dim`` dimensions of ``(B, N, Q, D)`` heads
    (halves rotated against each other), the rest passed through; ``cos``/``sin``
    ``(B, 1, Q, rotary_dim)``."""
    turned, kept = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = turned.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return torch.cat((turned * cos + rotated * sin, kept), dim=-1)


def attention_bias(
    attention_mask: torch.Tensor | None, query_length: int, key_length: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """The mask :func:`torch.nn.functional.scaled_dot_product_attention` takes, from the
    forward's ``attention_mask`` (see the module docstring): ``None`` (full attention), a
    4-D mask as given (a float one in ``dtype``), or for a 2-D ``(B, K)`` padding mask a
    ``(B, 1, Q, K)`` bool causal mask over the real keys, query ``q`` at key position
    ``K - Q + q``; a query that would see no key sees itself (its output is then not used,
    and no NaN reaches the keys of later layers)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 4:
        return attention_mask if attention_mask.dtype == torch.bool else attention_mask.to(dtype)
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be 2-D or 4-D; got shape {tuple(attention_mask.shape)}")
    device = attention_mask.device
    query_at = torch.arange(key_length - query_length, key_length, device=device)
    causal = torch.arange(key_length, device=device)[None, :] <= query_at[:, None]
    allowed = causal[None] & attention_mask.bool()[:, None, :]
    itself = query_at[:, None] == torch.arange(key_length, device=device)[None, :]
    allowed = allowed | (itself[None] & ~allowed.any(-1, keepdim=True))
    return allowed.unsqueeze(1)


class BailingAttention(nn.Module):
    """Grouped-query attention with a fused QKV projection, QK RMSNorm and partial RoPE."""

    def __init__(self, config: BailingMoeV2Config, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim,
        )
        self.rotary_dim = config.rotary_dim
        width = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.query_key_value = nn.Linear(config.hidden_size, width, bias=config.use_qkv_bias)
        self.dense = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=config.use_bias)
        if config.use_qk_norm:
            self.query_layernorm = BailingRMSNorm(self.head_dim, config.rms_norm_eps)
            self.key_layernorm = BailingRMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.use_qk_norm

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: Any, cache: Any,
    ) -> torch.Tensor:
        """``(B, Q, H)`` -> ``(B, Q, H)``; ``mask`` as :func:`attention_bias` returns it
        (a callable of the key length, evaluated once the cache has been extended)."""
        batch, length, _ = x.shape
        qkv = self.query_key_value(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
        query, key, value = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        if self.qk_norm:
            query, key = self.query_layernorm(query), self.key_layernorm(key)
        cos, sin = rope
        query, key = rotate(query, cos, sin, self.rotary_dim), rotate(key, cos, sin, self.rotary_dim)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_index)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask(key.shape[2]), enable_gqa=self.heads != self.kv_heads,
        )
        return self.dense(out.transpose(1, 2).reshape(batch, length, -1))


class BailingDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attention(norm(x))``, then ``+ mlp(norm(.))``."""

    def __init__(self, config: BailingMoeV2Config, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = BailingRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = BailingAttention(config, layer_index)
        self.post_attention_layernorm = BailingRMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = bool(config.num_experts) and layer_index >= config.first_k_dense_replace
        self.mlp: nn.Module = (
            BailingMoeV2Experts(config) if moe else BailingMLP(config, config.intermediate_size)
        )

    def forward(self, x: torch.Tensor, rope, mask, cache) -> torch.Tensor:
        x = x + self.attention(self.input_layernorm(x), rope, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class BailingMoeV2PreTrainedModel(PreTrainedModel):
    """Weight initialisation and ``transformers`` class attributes of the BailingMoeV2
    classes (only a model built from a config, e.g. on the ``meta`` device, is initialised;
    a loaded one takes every tensor from its checkpoint)."""

    config_class = BailingMoeV2Config
    base_model_prefix = "model"
    _no_split_modules = ["BailingDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, BailingRouter):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            init.zeros_(module.expert_bias)


class BailingMoeV2Model(BailingMoeV2PreTrainedModel):
    """Embedding, decoder layers and final norm: ``(B, Q)`` ids -> ``(B, Q, H)`` states."""

    def __init__(self, config: BailingMoeV2Config) -> None:
        super().__init__(config)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(BailingDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = BailingRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.word_embeddings

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``(B, 1, Q, rotary_dim)`` at ``(B, Q)`` positions, computed in
        float32 and cast to ``dtype``."""
        dim = self.config.rotary_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=position_ids.device) / dim
        inverse = 1.0 / (float(self.config.rope_theta) ** exponents)
        angles = position_ids.float()[..., None] * inverse
        angles = torch.cat((angles, angles), dim=-1)[:, None]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        """Final hidden states ``(B, Q, H)`` of ``(B, Q)`` ids; ``cache`` is read and extended."""
        x = self.word_embeddings(input_ids)
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        rope = self.rope(position_ids, x.dtype)
        mask = functools.partial(attention_bias, attention_mask, x.shape[1], dtype=x.dtype)
        for layer in self.layers:
            x = layer(x, rope, mask, cache)
        return self.norm(x)


class BailingMoeV2ForCausalLM(BailingMoeV2PreTrainedModel):
    """:class:`BailingMoeV2Model` with the output head ``lm_head`` (untied): unshifted logits,
    the output at ``i`` being the distribution of token ``i``."""

    def __init__(self, config: BailingMoeV2Config) -> None:
        super().__init__(config)
        self.model = BailingMoeV2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.word_embeddings

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
    ) -> CausalLMOutputWithPast:
        """Logits of ``(B, Q)`` ids.

        :param attention_mask: ``None``, a 2-D padding mask or a 4-D mask (module docstring).
        :param position_ids: ``(B, Q)`` long; ``past + arange(Q)`` when omitted.
        :param cache: a ``transformers`` cache, read and extended (``use_cache`` is implied
            by passing one).
        :param logits_to_keep: ``0`` for every column, an int ``n`` for the last ``n``, or a
            ``(Q',)`` long tensor of columns.
        :return: ``logits`` ``(B, Q, V)`` (or ``(B, Q', V)``) in the model's dtype, and the
            cache.
        """
        hidden = self.model(input_ids, attention_mask, position_ids, cache)
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        else:
            hidden = hidden[:, logits_to_keep]
        return CausalLMOutputWithPast(logits=self.lm_head(hidden), cache=cache)


def register() -> None:
    """Make :data:`MODEL_TYPE` known to ``transformers``' ``AutoConfig`` and
    ``AutoModelForCausalLM`` (idempotent), so that the loader and the tensor check build
    this class from a :class:`BailingMoeV2Config`."""
    AutoConfig.register(MODEL_TYPE, BailingMoeV2Config, exist_ok=True)
    AutoModelForCausalLM.register(BailingMoeV2Config, BailingMoeV2ForCausalLM, exist_ok=True)
