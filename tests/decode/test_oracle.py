"""The oracle NFE (dloom.decode.oracle): it reproduces the greedy output in no more forwards than any
commit rule that also reproduces it, and a broken oracle is caught by its output check."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import EOS_ID, MASK_ID, PAD_ID
from dloom import DiffusionDecoder, ModelAdapter, hookimpl, load_model
from dloom.decode.oracle import OneTokenPerStep, OracleCommit, oracle_nfe
from dloom.errors import ConfigurationError, OracleMismatchError
from dloom.evaluation import select_examples

RULES = (
    ("quota", {}), ("quota", {"steps": 8}), ("threshold", {"tau": 0.9}), ("threshold", {"tau": 0.5}),
    ("factor", {"f": 1.0}), ("frechet", {"delta": 0.0}),
)


class WrongCommit(OracleCommit):
    """Broken on purpose: also commits one selectable position whose candidate is not the final
    token."""

    @hookimpl
    def dloom_select_commit(self, confidence, selectable, schedule):
        commit = super().dloom_select_commit(confidence, selectable, schedule)
        wrong = selectable & ~self.matches(selectable)
        first = wrong & (wrong.cumsum(-1) == 1)
        return commit | first




def tiny_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 39, (int(n),), generator=generator).tolist() for n in (4, 6, 5, 7)]


def check_bound(model, prompts, lengths, others: int) -> torch.Tensor:
    """The oracle's result, asserting its NFE per prompt is at most that of every rule whose
    output equals quota's on that prompt (at least ``others`` such rows besides quota's)."""
    oracle = oracle_nfe(DiffusionDecoder(model, "quota", **lengths), prompts)
    reference = DiffusionDecoder(model, "quota", steps=lengths["gen_length"], **lengths).generate(prompts)
    assert oracle.reference_nfe.tolist() == reference.nfe.tolist()  # the oracle's reference is this decode
    assert oracle.reached.sum() >= len(prompts) // 2
    assert (oracle.nfe >= 1).all()
    assert (oracle.nfe[oracle.reached] <= oracle.reference_nfe[oracle.reached]).all()
    compared = 0
    for name, params in RULES:
        params = dict(params)
        steps = params.pop("steps", None)
        result = DiffusionDecoder(model, name, steps=steps, params=params, **lengths).generate(prompts)
        for row, (got, want) in enumerate(zip(result.token_lists, reference.token_lists)):
            if got == want and oracle.reached[row]:
                compared += 1
                assert oracle.nfe[row] <= result.nfe[row], (name, params, row)
    # quota itself, on every reached row, and ``others`` more comparisons with other rules
    assert compared >= int(oracle.reached.sum()) + others
    return oracle


def test_oracle_bounds_every_rule_on_tiny_model(sharp_adapter):
    oracle = check_bound(sharp_adapter, tiny_prompts(), dict(gen_length=16, block_length=8), others=0)
    assert (oracle.nfe[oracle.reached] < 16).any()  # the oracle commits several tokens per forward somewhere


def test_oracle_bounds_every_rule_on_toy_dllm():
    model = load_model("toy-dllm")
    prompts = [e.prompt for e in select_examples("all", 6)]
    oracle = check_bound(model, prompts, dict(gen_length=32, block_length=32), others=len(prompts))
    assert oracle.reached.all()  # a trained model: no dead end
    assert oracle.nfe.float().mean() < 4


@pytest.mark.parametrize("lengths", [dict(gen_length=16, block_length=8), dict(gen_length=16, block_length=16)])
def test_the_oracle_reference_decodes_as_quota_with_one_step_per_position(sharp_adapter, lengths):
    """The core's own reference rule commits what quota with ``steps == gen_length`` does."""
    own = DiffusionDecoder(sharp_adapter, OneTokenPerStep(), steps=16, **lengths).generate(tiny_prompts())
    quota = DiffusionDecoder(sharp_adapter, "quota", steps=16, **lengths).generate(tiny_prompts())
    assert own.token_lists == quota.token_lists and own.nfe.tolist() == quota.nfe.tolist()


def test_broken_oracle_is_caught(sharp_adapter):
    decoder = DiffusionDecoder(sharp_adapter, "quota", gen_length=16, block_length=8)
    with pytest.raises(OracleMismatchError, match="must commit only final tokens"):
        oracle_nfe(decoder, tiny_prompts(), oracle=WrongCommit)


def test_oracle_refuses_sampling(tiny_adapter):
    decoder = DiffusionDecoder(tiny_adapter, "quota", gen_length=8, block_length=8, temperature=0.5)
    with pytest.raises(ConfigurationError, match="temperature=0.5"):
        oracle_nfe(decoder, [[5, 6]])


def test_eval_reports_the_oracle_nfe_only_when_asked():
    from typer.testing import CliRunner

    from dloom.cli.commands import app

    def summary(*extra):
        result = CliRunner().invoke(app, ["eval", "--model", "toy-dllm", "-n", "3", "--json", *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.output.strip().splitlines()[-1])

    plain, with_oracle = summary(), summary("--oracle")
    assert "oracle_nfe_mean" not in plain
    assert with_oracle["oracle_reached_share"] == 1.0
    assert 1 <= with_oracle["oracle_nfe_mean"] <= with_oracle["nfe_mean"]


def test_eval_refuses_the_oracle_under_sampling_before_decoding():
    from typer.testing import CliRunner

    from dloom.cli.commands import app

    args = ["eval", "--model", "toy-dllm", "-n", "3", "--oracle", "--temperature", "0.7"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0
    assert "temperature=0.7" in result.output


def test_oracle_follows_absolute_block_alignment(sharp_adapter):
    """Block-causal, ``block_alignment="absolute"``: the first block holds the prompt's last
    ``len % K`` tokens and the last one is completed; the oracle's targets follow that layout
    (a target misplaced by one block or column would fail the output check)."""
    adapter = ModelAdapter(
        sharp_adapter.model, mask_token_id=MASK_ID, eos_token_ids=(), pad_token_id=PAD_ID,
        attention="block-causal", block_alignment="absolute", max_context=96, name="absolute",
    )
    prompts = [[5], [5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15, 16, 17], [18, 19, 20, 21, 22]]
    oracle = check_bound(adapter, prompts, dict(gen_length=8, block_length=4), others=0)
    lengths = [8 + (-len(p)) % 4 for p in prompts]
    assert oracle.generated_lengths.tolist() == lengths  # no EOS: every completed block decoded
    assert oracle.reached.any()


def test_an_eos_id_in_the_prompts_last_partial_block_does_not_end_the_oracles_block(sharp_adapter):
    """With blocks aligned at position 0 the first block starts with the prompt's last partial
    block; an EOS id there (a chat template's end-of-turn) is prompt, not output, so the
    oracle's block stays open: it reaches the reference within every rule's NFE. Reading it as
    the row's EOS (the negative control) makes the oracle match the next block's targets
    while the engine is still on the first, and it needs more forwards than the bound."""
    adapter = ModelAdapter(
        sharp_adapter.model, mask_token_id=MASK_ID, eos_token_ids=(EOS_ID,), pad_token_id=PAD_ID,
        attention="block-causal", block_alignment="absolute", max_context=96, name="absolute",
    )
    prompts = [[33, 7, 36, 34, 33, 33, 12, 31, 6, 32, EOS_ID], [15, 25, 21, 10, 29, 22, 38, 26, 5, EOS_ID],
               [4, 22, 4, 6, 35, 23, 18, 36, EOS_ID]]
    lengths = dict(gen_length=16, block_length=8)
    oracle = check_bound(adapter, prompts, lengths, others=0)
    assert oracle.reached.all()

    class PromptBlind(OracleCommit):
        """Broken on purpose: counts every position of a block as generated."""

        def __init__(self, targets, mask_token_id, eos_ids, generated=None):
            super().__init__(targets, mask_token_id, eos_ids)

    blind = oracle_nfe(DiffusionDecoder(adapter, "quota", **lengths), prompts, oracle=PromptBlind)
    assert (blind.nfe > oracle.nfe).all()
