"""Stand-in for LLaDA's ``configuration_llada.LLaDAConfig`` (OLMo-style field names)."""

from transformers import PretrainedConfig


class LLaDAConfig(PretrainedConfig):
    model_type = "llada"

    def __init__(
        self,
        d_model=8,
        n_heads=2,
        n_layers=1,
        mlp_hidden_size=16,
        vocab_size=126464,
        embedding_size=126464,
        max_sequence_length=4096,
        rope_theta=500000.0,
        use_cache=False,
        **kwargs,
    ):
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_layers = n_layers
        self.mlp_hidden_size = mlp_hidden_size
        self.vocab_size = vocab_size
        self.embedding_size = embedding_size
        self.max_sequence_length = max_sequence_length
        self.rope_theta = rope_theta
        self.use_cache = use_cache
        super().__init__(**kwargs)
