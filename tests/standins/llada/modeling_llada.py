"""Stand-in for LLaDA's ``modeling_llada.LLaDAModelLM``: the released calling conventions
around a tiny bidirectional Llama stack."""

from typing import Optional

import torch
from transformers import LlamaConfig, LlamaModel, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_llada import LLaDAConfig


class LLaDAModelLM(PreTrainedModel):
    config_class = LLaDAConfig
    base_model_prefix = "model"

    def __init__(self, config: LLaDAConfig):
        super().__init__(config)
        inner = LlamaConfig(
            vocab_size=config.embedding_size, hidden_size=config.d_model,
            intermediate_size=config.mlp_hidden_size, num_hidden_layers=config.n_layers,
            num_attention_heads=config.n_heads, num_key_value_heads=config.n_heads,
            max_position_embeddings=config.max_sequence_length, rope_theta=config.rope_theta,
            is_causal=False, initializer_range=0.5,
        )
        self.model = LlamaModel(inner)
        self.ff_out = torch.nn.Linear(config.d_model, config.embedding_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        attention_bias: Optional[torch.Tensor] = None,
        past_key_values=None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        cache_position=None,
    ):
        if use_cache is None:
            use_cache = self.config.use_cache
        assert past_key_values is None and not use_cache, "The kvcache is not suppotred for MDM."
        # The released attention passes no mask to SDPA: attention_mask / attention_bias are
        # accepted and ignored, and positions are 0 .. L-1 whatever the padding.
        hidden = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds).last_hidden_state
        return CausalLMOutputWithPast(logits=self.ff_out(hidden))
