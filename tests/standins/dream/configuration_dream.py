"""Stand-in for Dream's ``configuration_dream.DreamConfig`` (Qwen2 fields, model_type "Dream")."""

from transformers import Qwen2Config


class DreamConfig(Qwen2Config):
    model_type = "Dream"
