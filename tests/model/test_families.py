"""Model families registered through ``dloom_register_families``: the core's, a third-party
plugin's from an entry point, the precedence between them, and broken family plugins.

The third-party family is the Dream fixture of ``tests/fixtures/real-families/`` under a
new ``model_type``: a plugin installed as a fake distribution (``conftest.FakeSite``: a
``*.dist-info/entry_points.txt`` in the ``dloom`` group on ``sys.path``) maps it to a profile
and a native layout, and ``dloom.load_model`` then decodes it exactly as the built-in Dream
family decodes the same weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import dloom
from dloom.errors import ModelError, PluginLoadError
from dloom.hooks.registry import get_registry
from dloom.model.builtin_families import BUILTIN_FAMILIES
from dloom.model.checkpoints import DREAM_LAYOUT, NativeLayout
from dloom.model.families import (
    FamilyRegistration,
    FamilyTable,
    check_registration,
    collect_families,
)
from dloom.model.profiles import DREAM, TRANSFORMERS, ModelProfile

DREAM_CHECKPOINT = Path(__file__).parents[1] / "fixtures" / "real-families" / "dream" / "checkpoint"

MYDREAM_SOURCE = """
    import dloom
    from dloom.model.checkpoints import DREAM_LAYOUT, NativeLayout
    from dloom.model.profiles import ModelProfile

    PROFILE = ModelProfile(
        name="mydream",
        family="MyDream (Dream's network under its own model_type)",
        model_types=("mydream",),
        architectures=("MyDreamLM",),
        mask_token_id=151666,
        eos_token_ids=(151643,),
        shift_logits=True,
        attention="bidirectional",
    )


    @dloom.hookimpl
    def dloom_register_families(register):
        register(dloom.FamilyRegistration(
            profile=PROFILE, layout=NativeLayout("mydream", "qwen2", DREAM_LAYOUT.convert),
        ))
"""

CLAIMS_DREAM_SOURCE = """
    import dloom
    from dloom.model.profiles import ModelProfile
    from dloom_plugins.baselines import QuotaCommit


    @dloom.hookimpl
    def dloom_register_strategies(register):
        register(dloom.StrategyRegistration(name="dreamy-quota", plugin_class=QuotaCommit))


    @dloom.hookimpl
    def dloom_register_families(register):
        register(dloom.FamilyRegistration(ModelProfile(name="dream2", family="x", model_types=("dream",))))
"""

RAISES_SOURCE = """
    import dloom


    @dloom.hookimpl
    def dloom_register_families(register):
        raise RuntimeError("family hook exploded")
"""

NOT_A_REGISTRATION_SOURCE = """
    import dloom
    from dloom.model.profiles import ModelProfile


    @dloom.hookimpl
    def dloom_register_families(register):
        register(ModelProfile(name="bare", family="bare", model_types=("bare",)))
"""

BROKEN = {
    "claimsdream": (CLAIMS_DREAM_SOURCE, "family 'dream2' claims model_type 'dream', which the family "
                    "'dream' of plugin 'families' already claims"),
    "familyraiser": (RAISES_SOURCE, "RuntimeError: family hook exploded"),
    "bareprofile": (NOT_A_REGISTRATION_SOURCE, "register() takes a dloom.FamilyRegistration, got ModelProfile"),
}


def renamed_dream(directory: Path) -> Path:
    """The Dream fixture's weights under ``model_type`` ``mydream``, without Dream's
    ``architectures`` or ``auto_map`` (nothing of it names Dream any more)."""
    directory.mkdir()
    for name in ("model.safetensors", "generation_config.json"):
        shutil.copy(DREAM_CHECKPOINT / name, directory / name)
    config = json.loads((DREAM_CHECKPOINT / "config.json").read_text())
    del config["auto_map"]
    config.update(model_type="mydream", architectures=["MyDreamLM"])
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# --- the core's families ---------------------------------------------------------------


def test_the_builtin_families_register_through_the_hook_as_the_core_plugin():
    registry = get_registry()
    assert [f.registration for f in registry.families] == list(BUILTIN_FAMILIES)
    assert {f.plugin for f in registry.families} == {"families"}
    info = registry.plugins["families"]
    assert info.builtin and info.hooks == ("dloom_register_families",) and info.strategies == ()
    assert list(registry.plugins)[0] == "families"  # before every entry-point plugin
    assert registry.families.get("dream").layout is DREAM_LAYOUT
    with pytest.raises(ModelError, match="no model family 'nope' is registered; registered: llada, dream"):
        registry.families.get("nope")


# --- a third-party family from an entry point ------------------------------------------


def test_a_third_party_family_from_an_entry_point_decodes_as_the_builtin_family(site, tmp_path):
    copy = renamed_dream(tmp_path / "mydream")
    assert get_registry().families.detect(copy).name == "transformers"  # unknown without the plugin
    site.install("mydreamplug", MYDREAM_SOURCE, version="2.0")
    registry = get_registry()
    assert registry.failures == []
    assert registry.families.detect(copy).plugin == "mydreamplug"
    assert registry.plugins["mydreamplug"].hooks == ("dloom_register_families",)

    theirs, ours = dloom.load_model(copy), dloom.load_model(DREAM_CHECKPOINT)
    assert (theirs.profile, ours.profile) == ("mydream", "dream")
    assert (theirs.mask_token_id, theirs.shift_logits, theirs.attention) == (
        ours.mask_token_id, ours.shift_logits, ours.attention)
    prompts = [[5, 17, 29, 41, 53, 65], [7, 8]]
    for strategy, params in (("quota", {}), ("threshold", {"tau": 0.9})):
        got = dloom.DiffusionDecoder(theirs, strategy, gen_length=8, block_length=4, **params).generate(prompts)
        want = dloom.DiffusionDecoder(ours, strategy, gen_length=8, block_length=4, **params).generate(prompts)
        assert torch.equal(got.sequences, want.sequences), strategy
        assert torch.equal(got.nfe, want.nfe), strategy


@pytest.mark.parametrize("dist", sorted(BROKEN))
def test_a_broken_family_plugin_is_reported_and_skipped(site, dist):
    source, error = BROKEN[dist]
    site.install(dist, source)
    with pytest.warns(RuntimeWarning, match=f"dloom plugin '{dist}' was skipped") as caught:
        registry = get_registry()
    assert error in str(caught[0].message)
    assert [f.name for f in registry.failures] == [dist] and dist not in registry.plugins
    assert [f.registration for f in registry.families] == list(BUILTIN_FAMILIES)
    assert "dreamy-quota" not in registry.strategies  # the plugin is skipped as a whole
    assert registry.families.detect({"model_type": "dream"}) is registry.families.get("dream")


@pytest.mark.parametrize("dist", sorted(BROKEN))
def test_a_broken_family_plugin_is_fatal_in_strict_mode(site, dist, monkeypatch):
    source, error = BROKEN[dist]
    site.install(dist, source)
    monkeypatch.setenv("DLOOM_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match=f"dloom plugin '{dist}' was skipped") as raised:
        get_registry()
    assert error in str(raised.value) and "DLOOM_STRICT_PLUGINS=1" in str(raised.value)


# --- precedence and conflicts ----------------------------------------------------------


def table_with(*registrations: FamilyRegistration) -> FamilyTable:
    """The built-in families, then ``registrations`` by plugin ``third``."""
    table = FamilyTable()
    table.add(collect_families([lambda register: [register(r) for r in BUILTIN_FAMILIES]], "families", table))
    table.add(collect_families([lambda register: [register(r) for r in registrations]], "third", table))
    return table


def test_identifiers_come_first_then_recognises_tests_then_the_catch_all():
    mine = FamilyRegistration(ModelProfile(name="mine", family="mine"), recognises=lambda c: bool(c.get("mine")))
    table = table_with(mine, FamilyRegistration(ModelProfile(name="by-arch", family="x", architectures=("X",))))
    # Dream's model_type wins over another family's architecture and over a recognises test
    assert table.detect({"model_type": "dream", "architectures": ["X"], "mine": True}).name == "dream"
    assert table.detect({"model_type": "llama", "architectures": ["X"], "mine": True}).name == "by-arch"
    # a plugin's test comes after the built-in causal-lm test, before the catch-all
    assert table.detect({"model_type": "llama", "mask_token_id": 1, "mine": True}).name == "mine"
    assert table.detect({"model_type": "llama", "mine": True}).name == "causal-lm"
    assert table.detect({"model_type": "llama", "mask_token_id": 1}).profile is TRANSFORMERS


def test_without_a_catch_all_an_unrecognised_config_is_an_error():
    table = FamilyTable()
    table.add(collect_families([lambda register: register(BUILTIN_FAMILIES[0])], "families", table))
    with pytest.raises(ModelError, match="no registered model family recognises model_type 'gpt2'; registered: llada"):
        table.detect({"model_type": "gpt2"})


@pytest.mark.parametrize(
    "registration, message",
    [
        (FamilyRegistration(ModelProfile(name="dream", family="x", model_types=("dreamier",))),
         "family 'dream' is already registered as the family 'dream' of plugin 'families'"),
        (FamilyRegistration(ModelProfile(name="x", family="x", architectures=("LLaDAModelLM",))),
         "family 'x' claims architecture 'LLaDAModelLM', which the family 'llada' of plugin 'families'"),
        (FamilyRegistration(ModelProfile(name="x", family="x", code_modules=("modeling_dream",))),
         "family 'x' claims code module 'modeling_dream', which the family 'dream'"),
        (FamilyRegistration(ModelProfile(name="x", family="x")),
         "family 'x' has no identifiers and no recognises test, so it would recognise every config, "
         "as the family 'transformers' of plugin 'families' already does"),
        (FamilyRegistration(ModelProfile(name="x", family="x", model_types=("x",)), DREAM_LAYOUT),
         "family 'x' has the layout of family 'dream'; a layout's family must be its profile's name"),
        (FamilyRegistration(ModelProfile(name="x", family="x", model_types=("x",)), recognises=bool),
         "family 'x' has identifiers (model_type x) and a recognises test; give one or the other"),
        (FamilyRegistration(ModelProfile(name="x", family="x", model_types=("MyModel",))),
         "family 'x' lists model_type 'MyModel'; model_types must be lower-case"),
    ],
    ids=["name", "architecture", "code-module", "second-catch-all", "layout", "both", "upper-case"],
)
def test_a_conflicting_or_inconsistent_registration_is_refused(registration, message):
    with pytest.raises(PluginLoadError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        table_with(registration)


def test_families_may_share_a_native_class_and_converter():
    """A layout's native ``model_type`` is no identifier: two families may load onto Qwen2."""
    layout = NativeLayout("dream-like", "qwen2", DREAM_LAYOUT.convert)
    registration = FamilyRegistration(ModelProfile(name="dream-like", family="x", model_types=("dl",)), layout)
    assert check_registration(registration, "third", list(table_with())).layout is layout
    table = table_with(registration)
    assert table.detect({"model_type": "DL"}).layout is layout  # configs' model_type compared lower-cased
    assert table.detect({"model_type": "dream"}).profile is DREAM
