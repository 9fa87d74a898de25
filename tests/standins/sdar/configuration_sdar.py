"""Stand-in for SDAR's ``configuration_sdar.SDARConfig`` (Qwen3 fields, model_type "sdar")."""

from transformers import Qwen3Config


class SDARConfig(Qwen3Config):
    model_type = "sdar"
