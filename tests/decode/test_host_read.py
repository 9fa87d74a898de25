"""A step's one host synchronisation, read back by name."""

from __future__ import annotations

import torch

from dloom.decode.host_read import read_on_host
from dloom.decode.session import StepStatus
from dloom.decode.step import ForwardPlan


def test_values_come_back_under_their_names_in_one_read(monkeypatch):
    reads = []
    original = torch.Tensor.tolist

    def counted(self):
        reads.append(self.shape)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    out = read_on_host({
        "flag": torch.tensor(True), "count": torch.tensor(7), "plan": torch.tensor([2, 3, 4]),
        "empty": torch.zeros(0, dtype=torch.long),
    })
    assert out == {"flag": [1], "count": [7], "plan": [2, 3, 4], "empty": []}
    assert reads == [torch.Size([5])]


def test_a_step_status_names_every_field_and_defaults_the_optional_ones():
    status = StepStatus.read({
        "non_finite": torch.tensor(False), "idle": torch.tensor(1), "leaving": torch.tensor(2),
        "plan": torch.tensor([1, 0, 5]), "can_draft": torch.tensor(False),
    })
    assert status == StepStatus(non_finite=False, idle=1, leaving=2, plan=ForwardPlan(1, 0, 5), can_draft=False)
    assert (status.accepted, status.verifications, status.primed, status.blocks_done) == (0, 0, False, 0)
    assert isinstance(status.non_finite, bool) and status.idle == 1 and isinstance(status.plan, ForwardPlan)
