"""Cache policies: what a :class:`~dloom.model.runner.BlockForward` reuses between forwards.

A policy is the user-facing value of a decoder's ``cache`` (``"none"``, ``"prefix"``,
``"dual"``, or a plugin's) and answers the runner's questions about its cache; the runner
itself names no policy. The mechanics are the runner's and shared by every policy: a full
forward records the keys and values of every position at a row's block start (and every
``refresh`` forwards), and a cached forward recomputes each row's *window*, the columns
``[window_start, window_start + W)`` (``window_start`` is the block's first column, one
before it for a shifted model), reading every other column from the record. A policy
chooses:

* :attr:`~CachePolicy.records`: whether forwards read a record at all (``False``: every
  forward is a full forward over the whole sequence that records nothing);
* :meth:`~CachePolicy.window_width`: ``W``, at least the block (and the column before it,
  shifted), clamped into the sequence, the columns past the last being invisible padding;
* :meth:`~CachePolicy.static_slack`: with static shapes, the record columns past ``L``
  where a window's invisible columns write (at least ``W`` when a window may run past the
  last column, else ``0``);
* :attr:`~CachePolicy.fixed_context`: whether the keys and values of the columns outside
  the block never depend on the block's tokens in a cached forward, which makes a packed
  verification layout exact on a bidirectional model
  (:func:`dloom.decode.speculation.layout_is_exact`).

Policies are registered through the :func:`dloom.hooks.specs.dloom_register_cache_policies`
hook: the built-in ones below (:data:`BUILTIN_POLICIES`) by the core's implementation of it,
a plugin's from its ``dloom`` entry point; :mod:`dloom.hooks.cache_policies` runs the hook
and looks the registered ones up by name.

Shapes: ``L`` sequence length, ``K`` block length, ``W`` window width, ``S`` static width.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class CachePolicy(Protocol):
    """What a cache keeps and recomputes, as the runner asks it (see the module docstring).

    :ivar name: the value of ``cache`` that selects it (``"prefix"``).
    :ivar help: one line for the command line's and the server's help.
    :ivar records: forwards read recorded keys and values (``False``: every forward is full).
    :ivar fixed_context: a cached forward's columns outside the block read the record only.
    """

    name: str
    help: str
    records: bool
    fixed_context: bool

    def window_width(
        self, length: int, block_length: int, shift: int, first_window: int, static_width: int | None
    ) -> int:
        """``W``, the columns one row's cached forward computes (also a verification
        forward's, :meth:`dloom.model.runner.BlockForward.query_width`).

        :param length: ``L``.
        :param block_length: ``K``.
        :param shift: 1 for a shifted model, else 0.
        :param first_window: the earliest window start of any row this step.
        :param static_width: ``S`` with static shapes (the width must then not depend on
            ``first_window``), else ``None``.
        :return: ``>= K + shift``; ``L`` when :attr:`records` is ``False``.
        """
        ...

    def static_slack(self, block_length: int, shift: int, static_width: int) -> int:
        """Record columns past ``L`` for a static record: ``W`` (with static shapes) when a
        window may run past the last column, else ``0``."""
        ...


class NoCache:
    """``"none"``: every forward is a full forward of the whole sequence; nothing is kept."""

    name = "none"
    help = "every forward recomputes the whole sequence"
    records = False
    fixed_context = False

    def window_width(
        self, length: int, block_length: int, shift: int, first_window: int, static_width: int | None
    ) -> int:
        return length

    def static_slack(self, block_length: int, shift: int, static_width: int) -> int:
        return 0


class PrefixCache:
    """``"prefix"`` (Fast-dLLM): a cached forward recomputes the block and everything after
    it (from the earliest window start of any row, or the last ``S`` columns with static
    shapes), reading the columns before it from the record."""

    name = "prefix"
    help = "reuse the keys and values before the block"
    records = True
    fixed_context = False

    def window_width(
        self, length: int, block_length: int, shift: int, first_window: int, static_width: int | None
    ) -> int:
        return length - first_window if static_width is None else static_width

    def static_slack(self, block_length: int, shift: int, static_width: int) -> int:
        return static_width


class DualCache:
    """``"dual"`` (Fast-dLLM): a cached forward recomputes the block alone (and the column
    before it, shifted), reading every other column from the record."""

    name = "dual"
    help = "also reuse the keys and values after the block"
    records = True
    fixed_context = True

    def window_width(
        self, length: int, block_length: int, shift: int, first_window: int, static_width: int | None
    ) -> int:
        return block_length + shift

    def static_slack(self, block_length: int, shift: int, static_width: int) -> int:
        return 0


BUILTIN_POLICIES: tuple[CachePolicy, ...] = (NoCache(), PrefixCache(), DualCache())
"""The core's policies, in the order they are listed."""

BUILTIN_CACHE_MODES: tuple[str, ...] = tuple(policy.name for policy in BUILTIN_POLICIES)
"""Their names: ``("none", "prefix", "dual")``."""
