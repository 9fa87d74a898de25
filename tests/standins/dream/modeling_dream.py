"""Stand-in for Dream's ``modeling_dream.DreamModel``: the released calling conventions around
a tiny Qwen2 stack with bidirectional attention; the output at ``i`` predicts token ``i + 1``."""

import copy
from typing import Optional

import torch
from transformers import PreTrainedModel, Qwen2Model
from transformers.modeling_outputs import MaskedLMOutput

from .configuration_dream import DreamConfig


class DreamModel(PreTrainedModel):
    config_class = DreamConfig
    base_model_prefix = "model"
    _supports_sdpa = True

    def __init__(self, config: DreamConfig):
        super().__init__(config)
        inner = copy.deepcopy(config)
        inner.is_causal = False  # Dream's attention is hard-coded non-causal
        self.model = Qwen2Model(inner)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor = None,
        attention_mask=None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values=None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        cache_position=None,
        num_logits_to_keep: int = 0,
        **loss_kwargs,
    ):
        if not isinstance(attention_mask, torch.Tensor):
            attention_mask = None  # "full" (Dream's own generate) or None: attend everywhere
        elif attention_mask.dim() != 4 or attention_mask.dtype != torch.bool:
            raise ValueError(
                "Dream's SDPA attention takes a (B, 1, Q, K) bool mask, 'full' or None; got "
                f"{attention_mask.dtype} {tuple(attention_mask.shape)}"
            )
        hidden = self.model(
            input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
            position_ids=position_ids, cache=past_key_values, use_cache=use_cache,
        ).last_hidden_state
        return MaskedLMOutput(logits=self.lm_head(hidden[:, -num_logits_to_keep:, :]))
