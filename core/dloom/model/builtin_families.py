"""The core's model families, registered through ``dloom_register_families`` like a plugin's.

The registry loads this module as the built-in plugin ``families``, before any plugin of the
``dloom`` entry-point group (:data:`dloom.hooks.registry.CORE_PLUGINS`), so these families
take precedence over third-party ones (:mod:`dloom.model.families`). Each family's profile
(:mod:`dloom.model.profiles`) and native layout (:mod:`dloom.model.checkpoints`) are
registered together, as one :class:`~dloom.model.families.FamilyRegistration`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from dloom.hooks.specs import hookimpl
from dloom.model.checkpoints import (
    DREAM_LAYOUT,
    FAST_DLLM_V2_LAYOUT,
    LLADA2_LAYOUT,
    LLADA_LAYOUT,
    SDAR_LAYOUT,
    SDAR_MOE_LAYOUT,
)
from dloom.model.families import FamilyRegistration
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
)


def is_causal_lm(config: Mapping[str, Any]) -> bool:
    """A config of no known family is an autoregressive target when it declares no mask token,
    does not declare its attention bidirectional (``is_causal`` is not ``False``) and has no
    ``dloom`` section."""
    return (
        config.get("mask_token_id") is None
        and config.get("is_causal", True) is not False
        and not config.get("dloom")
    )


BUILTIN_FAMILIES: tuple[FamilyRegistration, ...] = (
    FamilyRegistration(LLADA, LLADA_LAYOUT),
    FamilyRegistration(DREAM, DREAM_LAYOUT),
    FamilyRegistration(SDAR, SDAR_LAYOUT),
    FamilyRegistration(SDAR_MOE, SDAR_MOE_LAYOUT),
    FamilyRegistration(FAST_DLLM_V2, FAST_DLLM_V2_LAYOUT),
    FamilyRegistration(LLADA2, LLADA2_LAYOUT),  # onto dloom's own class (dloom.model.bailing)
    FamilyRegistration(DIFFUSION_GEMMA),  # transformers' own class (profile.model_class), the uniform kernel
    FamilyRegistration(CAUSAL_LM, recognises=is_causal_lm),  # e.g. a Qwen2.5 target
    FamilyRegistration(TRANSFORMERS),  # the catch-all: conventions from the config (the zoo)
)
"""The built-in families, in registration order."""


@hookimpl
def dloom_register_families(register: Callable[[FamilyRegistration], None]) -> None:
    for registration in BUILTIN_FAMILIES:
        register(registration)
