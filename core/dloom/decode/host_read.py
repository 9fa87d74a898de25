"""Named values read back to the host in one synchronisation.

A decode step learns what it must know on the host (contract violations, rows leaving, the
next forward's plan, acceptance counts) from device tensors. Reading each would synchronise
once per value; :func:`read_on_host` concatenates them and reads once, then hands each back
under its name, so that no caller indexes positional slots.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def read_on_host(values: Mapping[str, torch.Tensor]) -> dict[str, list[int]]:
    """Every tensor of ``values`` (integer or bool, any shape: flattened), read in one host
    synchronisation.

    :param values: tensors by name, all on one device.
    :return: each name's values as a list of Python ints (bools read as 0 and 1 beside integers), in the
        tensor's flattened order.
    """
    flat = [value.reshape(-1) for value in values.values()]
    read = torch.cat(flat).tolist() if flat else []  # mixed bool and long: promoted to long
    out: dict[str, list[int]] = {}
    start = 0
    for name, value in zip(values, flat):
        out[name] = read[start:start + value.numel()]
        start += value.numel()
    return out
