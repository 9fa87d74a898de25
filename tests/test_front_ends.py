"""The library below its front-ends: one decoder factory that raises, front-ends that print;
a decode session that reaches its decoder only through :class:`SessionCalls`; names that
moved still found at their old paths."""

from __future__ import annotations

import warnings

import pytest
import torch
from typer.testing import CliRunner

import dloom
from dloom import factory
from dloom.cli import commands as cli
from dloom.decode.session import DecodeSession, SessionCalls
from dloom.errors import ConfigurationError


def test_the_factory_raises_and_prints_nothing(capsys):
    with pytest.raises(ConfigurationError, match="--param takes NAME=VALUE, got 'tau'"):
        factory.build_decoder("toy-dllm", "threshold", ["tau"])
    assert factory.parse_params(["tau = 0.8", "spiffy.budget=3"]) == {"tau": "0.8", "spiffy.budget": "3"}
    assert capsys.readouterr() == ("", "")


def test_every_front_end_builds_with_the_one_factory(monkeypatch):
    from dloom.ray import DecodeSpec

    assert (cli.build_decoder, cli.parse_params, cli.DEFAULT_MODEL) == (
        factory.build_decoder, factory.parse_params, factory.DEFAULT_MODEL,
    )
    built = []
    monkeypatch.setattr(factory, "build_decoder", lambda *args, **kwargs: built.append((args, kwargs)) or "decoder")
    assert DecodeSpec(strategy="threshold", params=("tau=0.5",), settings={"seed": 3}).build() == "decoder"
    assert built == [((None, "threshold", ["tau=0.5"]), dict(
        device="cpu", dtype="float32", target=None, drafter=None, seed=3,
    ))]
    from dloom.ray import serve
    from dloom.serve import decoders

    # the server's decoders, and the models of Ray Serve's replicas, come from the factory
    assert (decoders.decoder_over, serve.select_models) == (factory.decoder_over, factory.select_models)


def test_dloom_serve_prints_the_library_error_and_exits_2():
    result = CliRunner().invoke(cli.app, ["serve", "--param", "tau"])
    assert result.exit_code == 2, result.output
    assert "error: --param takes NAME=VALUE, got 'tau'" in result.output
    assert "Traceback" not in result.output


def test_the_serve_command_itself_raises():
    from dloom.serve.command import serve

    with pytest.raises(ConfigurationError, match="--param takes NAME=VALUE"):
        serve(param=["tau"])


class RecordingDecoder(dloom.DiffusionDecoder):
    """Hands its sessions calls that record their use, and no other way in."""

    def session_calls(self) -> SessionCalls:
        calls = super().session_calls()
        self.used: list[str] = []

        def recorded(name, call):
            def run(*args, **kwargs):
                self.used.append(name)
                return call(*args, **kwargs)
            return run

        clock = calls.clock
        clock.timed = recorded("forward", clock.timed)  # type: ignore[method-assign]
        return SessionCalls(
            layout=recorded("layout", calls.layout), check=recorded("check", calls.check), clock=clock,
            plain_step=recorded("plain", calls.plain_step),
            speculative_step=None if calls.speculative_step is None else recorded("speculate", calls.speculative_step),
            speculator=calls.speculator,
        )


@pytest.mark.filterwarnings("ignore:no built-in draft graph")  # an uncalibrated graph drafts at a fixed budget
@pytest.mark.parametrize("strategy, params", [("quota", {}), ("spiffy+quota", {"budget": 2})])
def test_a_session_reaches_its_decoder_through_session_calls_only(sharp_adapter, strategy, params):
    decoder = RecordingDecoder(sharp_adapter, strategy, params=params, gen_length=8, block_length=4)
    decoder.forward_clock.seconds = 99.0  # left from an earlier session: the decoder resets it for the new one
    decoder.timer.seconds["select_commit"] = 99.0
    session = DecodeSession(decoder)
    assert not decoder.timer.seconds
    assert session.calls.clock is decoder.forward_clock and decoder.forward_seconds == 0.0
    session.admit([[5, 6, 7]])
    while session.size:
        session.step()
    assert decoder.used[0] == "layout" and "check" in decoder.used and "plain" in decoder.used
    assert ("speculate" in decoder.used) == (strategy != "quota")
    assert decoder.forward_seconds > 0.0  # the session's forwards, read back by the decoder


def test_generate_reports_the_forward_time_of_its_session(sharp_adapter):
    decoder = dloom.DiffusionDecoder(sharp_adapter, "quota", gen_length=8, block_length=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = decoder.generate(torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long))
    assert result.hook_seconds["forward"] == decoder.forward_seconds > 0.0


def test_a_named_bound_comes_from_the_claim_that_supplies_it():
    """``dloom check`` finds ``frechet`` through the frechet strategy's claim, not a name in
    the core, and a third-party claim's bound by its own name."""
    from dloom.check.bounds import known_bounds, resolve_bound
    from dloom.hooks.registry import Registry, Strategy, get_registry
    from dloom.types import Claim, StrategyRegistration

    base = get_registry()
    assert resolve_bound("frechet") is base.get("frechet").registration.claim.bound_function

    def mine(profile):
        return profile, profile, profile

    claim = Claim("bound", bound="mine", bound_function=mine)
    extra = Strategy("mine", "test", StrategyRegistration("mine", object, claim=claim))
    registry = Registry(strategies={**base.strategies, "mine": extra}, plugins=dict(base.plugins))
    assert resolve_bound("mine", registry) is mine and set(known_bounds(registry)) == {"frechet", "mine"}
    with pytest.raises(ConfigurationError, match="unknown bound 'mine'; known bounds: frechet"):
        resolve_bound("mine")  # not registered there
