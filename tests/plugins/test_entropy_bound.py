"""The entropy bound (EB-sampler) as a fill rule on the absorbing kernel: hand-worked profiles
and the toy zoo's dLLM. On DiffusionGemma's uniform kernel it is tested against transformers'
``generate`` (``tests/model/test_diffusion_gemma.py``)."""

from __future__ import annotations

import pytest
import torch

from dloom import DiffusionDecoder, load_model
from dloom.decode.kernel import without_mask
from dloom_plugins.baselines import EntropyBoundCommit


def commit(gamma, entropy, selectable):
    rule = EntropyBoundCommit(gamma)
    return rule.dloom_select_commit(
        selectable=torch.tensor(selectable, dtype=torch.bool),
        signals={"entropy": torch.tensor(entropy, dtype=torch.float64)},
    ).tolist()


def test_commits_in_ascending_entropy_while_the_sum_before_the_last_is_within_gamma():
    # sorted 0.01, 0.05, 0.2, 0.3: entropies before each 0, 0.01, 0.06, 0.26
    assert commit(0.1, [[0.05, 0.3, 0.01, 0.2]], [[1, 1, 1, 1]]) == [[True, False, True, True]]
    assert commit(0.05, [[0.05, 0.3, 0.01, 0.2]], [[1, 1, 1, 1]]) == [[True, False, True, False]]


def test_only_selectable_positions_count_and_one_always_passes():
    assert commit(0.1, [[0.05, 0.3, 0.01, 0.2]], [[1, 1, 0, 1]]) == [[True, False, False, True]]
    assert commit(0.1, [[2.0, 3.0, 1.5, 4.0]], [[1, 1, 1, 1]]) == [[False, False, True, False]]
    assert commit(0.1, [[0.0, 0.0], [0.5, 0.5]], [[0, 0], [1, 1]]) == [[False, False], [True, False]]


@pytest.fixture(scope="module")
def toy():
    return load_model("toy-dllm")


@pytest.mark.parametrize("gamma", [0.05, 1.0])
def test_on_the_toy_dllm_every_step_commits_within_the_bound(toy, gamma):
    records = []
    decoder = DiffusionDecoder(toy, "entropy_bound", gamma=gamma, gen_length=16, block_length=8)
    decoder.generate([[5, 6, 7], [8, 9]], observer=records.append)
    assert records
    for record in records:
        logits = without_mask(record.logits, toy.mask_token_id)
        entropy = -(logits.softmax(-1) * logits.log_softmax(-1).nan_to_num(neginf=0.0)).sum(-1)
        committed = (record.before == toy.mask_token_id) & (record.after != toy.mask_token_id)
        assert committed.any(-1).all()  # at least one per step
        chosen = torch.where(committed, entropy, 0.0)
        assert ((chosen.sum(-1) - chosen.amax(-1)) <= gamma + 1e-12).all()
        unchosen = torch.where((record.after == toy.mask_token_id), entropy, torch.inf)
        assert (unchosen.amin(-1) >= chosen.amax(-1) - 1e-12).all()  # the lowest entropies first


def test_a_huge_bound_fills_a_block_per_forward_and_a_tiny_one_a_token(toy):
    prompts = [[5, 6, 7]]
    huge = DiffusionDecoder(toy, "entropy_bound", gamma=1e9, gen_length=16, block_length=8).generate(prompts)
    assert int(huge.nfe[0]) == -(-int(huge.generated_lengths[0]) // 8)  # one forward per block decoded
    records = []
    DiffusionDecoder(toy, "entropy_bound", gamma=1e-12, gen_length=16, block_length=8).generate(
        prompts, observer=records.append
    )
    committed = [int(((r.before == toy.mask_token_id) & (r.after != toy.mask_token_id)).sum()) for r in records]
    assert committed == [1] * len(records)
