"""Cache policies registered through ``dloom_register_cache_policies``: the built-ins from the
core, a third-party one from a ``dloom`` entry point (a fake distribution on ``sys.path``,
as in ``test_plugin_loading.py``), and the policies a plugin gets wrong."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from conftest import MASK_ID, PAD_ID
from dloom import DiffusionDecoder, ModelAdapter
from dloom.cli.commands import app
from dloom.errors import ConfigurationError, PluginLoadError
from dloom.hooks.cache_policies import (
    cache_help,
    cache_modes,
    cache_policy,
    registered_cache_policies,
)
from dloom.hooks.registry import get_registry, reset_registry
from dloom.model.cache_policy import BUILTIN_CACHE_MODES, CachePolicy
from dloom.model.runner import BlockForward

# The block and the next one recomputed, everything else read from the record: exact on a
# block-causal model (no block attends to a later one), like dual.
WIDE_SOURCE = """
    import dloom


    class WideDual:
        name = "wide"
        help = "recompute the block and the next one"
        records = True
        fixed_context = False

        def window_width(self, length, block_length, shift, first_window, static_width):
            return 2 * block_length + shift

        def static_slack(self, block_length, shift, static_width):
            return 2 * block_length + shift  # the next block runs past the end in the last one


    @dloom.hookimpl
    def dloom_register_cache_policies(register):
        register(WideDual())
"""

TAKEN_SOURCE = """
    import dloom
    from dloom.model.cache_policy import DualCache


    @dloom.hookimpl
    def dloom_register_cache_policies(register):
        register(DualCache())
"""

NOT_A_POLICY_SOURCE = """
    import dloom


    @dloom.hookimpl
    def dloom_register_cache_policies(register):
        register("dual-ish")
"""

EXITS_SOURCE = """
    import sys

    import dloom


    @dloom.hookimpl
    def dloom_register_cache_policies(register):
        sys.exit(4)
"""

PROMPTS = [[5], [5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15, 16, 17], [18, 19, 20, 21, 22]]


@pytest.fixture
def block_causal(sharp_adapter) -> ModelAdapter:
    """``sharp_adapter``'s model with SDAR's block-causal attention: caching is exact."""
    return ModelAdapter(
        sharp_adapter.model, mask_token_id=MASK_ID, eos_token_ids=(), pad_token_id=PAD_ID,
        attention="block-causal", block_alignment="absolute", max_context=96, name="block-causal",
    )


def test_the_builtin_policies_register_through_the_hook_from_the_core():
    policies = registered_cache_policies()
    assert tuple(policies)[:3] == BUILTIN_CACHE_MODES == ("none", "prefix", "dual")
    assert all(isinstance(p, CachePolicy) for p in policies.values())
    assert cache_policy("dual") is policies["dual"] and cache_policy(policies["prefix"]) is policies["prefix"]
    assert cache_modes(records=True)[:2] == ("prefix", "dual")
    assert "dual: also reuse the keys and values after the block" in cache_help()


def test_a_third_party_cache_policy_from_an_entry_point_decodes_exactly(site, block_causal):
    """The plugin's "wide" policy is a value of ``cache`` like the built-ins; on a block-causal
    model it decodes the uncached reference's tokens in as many forwards (a left-padded
    batch of mixed lengths, with and without static shapes), and its cached forwards are
    ``2K`` wide."""
    site.install("wideplug", WIDE_SOURCE)
    assert "wide" in cache_modes() and "wide" in cache_modes(records=True)
    assert "wide: recompute the block and the next one" in cache_help()
    widths: list[int] = []
    handle = block_causal.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        reference = DiffusionDecoder(block_causal, "threshold", tau=0.7, gen_length=8, block_length=4).generate(PROMPTS)
        assert widths and set(widths) == {widths[0]}  # every uncached forward is the whole sequence
        for static in (False, True):
            widths.clear()
            wide = DiffusionDecoder(
                block_causal, "threshold", tau=0.7, gen_length=8, block_length=4, cache="wide", static_shapes=static,
            ).generate(PROMPTS)
            assert wide.token_lists == reference.token_lists, static
            assert wide.nfe.tolist() == reference.nfe.tolist()
            assert 8 in widths  # the cached forwards: the block and the next one
    finally:
        handle.remove()
    forward = BlockForward(block_causal, "wide", None, torch.arange(12)[None], 4, 4)
    assert forward.policy.name == "wide" and forward.query_width(4) == 8


def test_a_third_party_cache_policy_serves_the_failfast_drafter(site):
    """A drafter cache is any registered policy that records nothing or can keep the
    accepted columns settled (:meth:`BlockForward.settle`): "wide" records and does not fix
    the context, so it keeps them as "prefix" does, forward for forward."""
    from dloom.ar.decoder import drafter_cache_modes
    from dloom.check.target import target_greedy
    from dloom.check.tiny import tiny_ar, tiny_dllm
    from dloom_plugins.failfast import FailFastDecoder

    site.install("wideplug", WIDE_SOURCE)
    assert drafter_cache_modes() == ("none", "prefix", "wide")
    pair = dict(vocab=16, hidden=32, layers=2, init=0.8, context=128)
    target, drafter = tiny_ar(0, **pair), tiny_dllm(0, **pair)
    prompts = [[5, 6, 7, 8], [9, 3], [3, 4, 5]]
    results = {
        cache: FailFastDecoder(target, drafter, max_new_tokens=12, drafter_cache=cache).generate(prompts)
        for cache in ("prefix", "wide")
    }
    assert results["wide"].token_lists == target_greedy(target, prompts, 12)
    assert results["wide"].drafter_forwards == results["prefix"].drafter_forwards
    assert results["wide"].accepted == results["prefix"].accepted
    with pytest.raises(ConfigurationError, match="drafter_cache is 'dual'; allowed: none, prefix, wide"):
        FailFastDecoder(target, drafter, drafter_cache="dual")


def test_a_policy_refuses_what_it_cannot_do(site, tiny_adapter):
    site.install("wideplug", WIDE_SOURCE)
    with pytest.raises(ConfigurationError, match="cache is 'wider'; allowed: none, prefix, dual, wide"):
        DiffusionDecoder(tiny_adapter, "quota", cache="wider")
    with pytest.raises(ConfigurationError, match="cache_refresh=2 needs cache='prefix' or 'dual' or 'wide'"):
        DiffusionDecoder(tiny_adapter, "quota", cache="none", cache_refresh=2)


@pytest.mark.parametrize("source, message", [
    (TAKEN_SOURCE, "cache policy 'dual' is already registered"),
    (NOT_A_POLICY_SOURCE, "register\\(\\) takes a dloom cache policy .*got 'dual-ish'"),
    (EXITS_SOURCE, "SystemExit: 4"),
])
def test_a_broken_cache_policy_is_reported_and_skipped(site, monkeypatch, source, message):
    site.install("badcache", source)
    with pytest.warns(RuntimeWarning, match=f"badcache \\(dloom_register_cache_policies\\).*{message}"):
        policies = registered_cache_policies()
    assert tuple(policies) == BUILTIN_CACHE_MODES
    assert policies["dual"] is cache_policy("dual")
    assert any(f.name == "badcache (dloom_register_cache_policies)" for f in get_registry().failures)
    reset_registry()
    monkeypatch.setenv("DLOOM_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match=message):
        registered_cache_policies()


def test_the_cache_option_lists_the_registered_policies(site):
    site.install("wideplug", WIDE_SOURCE)
    result = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "wide: recompute the block and the next one" in result.output
    assert "prefix: reuse the keys and values before the block" in result.output
