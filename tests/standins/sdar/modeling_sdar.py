"""Stand-in for SDAR's ``modeling_sdar.SDARForCausalLM``: the released calling conventions
around a tiny Qwen3 stack. The caller passes the block-causal mask; ``store_kv`` decides
whether a forward extends the KV cache."""

import copy
from typing import Optional

import torch
from transformers import PreTrainedModel, Qwen3Model
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_sdar import SDARConfig


class SDARForCausalLM(PreTrainedModel):
    config_class = SDARConfig
    base_model_prefix = "model"
    _supports_sdpa = True

    def __init__(self, config: SDARConfig):
        super().__init__(config)
        inner = copy.deepcopy(config)
        inner.is_causal = False  # the mask passed in decides everything
        self.model = Qwen3Model(inner)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.attention_masks = []  # every mask received, for tests
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values=None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        store_kv: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        cache_position=None,
        logits_to_keep: int = 0,
        **kwargs,
    ):
        if attention_mask is None or attention_mask.dim() != 4 or attention_mask.dtype != torch.bool:
            raise ValueError("SDAR builds no mask itself: pass the (B, 1, Q, K) bool block-causal mask")
        self.attention_masks.append(attention_mask)
        seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        hidden = self.model(
            input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
            position_ids=position_ids, cache=past_key_values, use_cache=use_cache,
        ).last_hidden_state
        if past_key_values is not None and not store_kv:
            past_key_values.crop(seen)  # read-only unless store_kv
        return CausalLMOutputWithPast(logits=self.lm_head(hidden[:, -logits_to_keep:, :]))
