"""The transition-kernel seam: what a decode session asks of the kernel that moves a row's
active block from one state to the next, and which kernel a model decodes with.

A kernel takes one step of every decoding row's block from the block's logits
(:meth:`TransitionKernel.__call__`), and says when a block is settled
(:meth:`TransitionKernel.settle`): when its row has ended, and when the block is complete so
that its row moves on to the next one. The session knows nothing else of the process: a
token becomes final when its row leaves the block, so streaming, caches, per-row block
progression and continuous batching hold for any kernel that keeps that contract.

A model's profile names its kernel (:attr:`dloom.model.profiles.ModelProfile.kernel`, carried
on the adapter as :attr:`dloom.model.adapter.ModelAdapter.kernel`); :data:`KERNELS` maps that
name to the implementation: ``"absorbing"`` (:class:`dloom.decode.kernel.KernelStep`), where
a position is the mask token until a step commits it and a committed token never changes, and
``"revisable"`` (:class:`dloom.decode.revisable.RevisableKernel`), where an editing rule may
also rewrite filled positions until the block settles (LLaDA2.1), and ``"uniform"``
(:class:`dloom.decode.uniform.UniformKernel`), where a canvas of random tokens is denoised and
every position the rule does not accept is renoised (DiffusionGemma). A strategy states the kernels it supports
(:attr:`dloom.types.StrategyRegistration.kernels`); the decoder refuses a pairing outside
them when it is built (:func:`check_kernel`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dloom.decode.kernel import KernelStep, Settlement
from dloom.decode.revisable import RevisableKernel
from dloom.decode.uniform import UniformKernel, UniformSettings
from dloom.errors import ConfigurationError, ModelError

if TYPE_CHECKING:
    from dloom.hooks.composition import Component, Composition
    from dloom.model.adapter import ModelAdapter

ABSORBING = "absorbing"
REVISABLE = "revisable"
UNIFORM = "uniform"

#: Kernel implementations by the name a model profile gives (their constructor takes the
#: arguments of :class:`dloom.decode.kernel.KernelStep`, and the options of
#: :func:`kernel_options`).
KERNELS: dict[str, type[KernelStep]] = {ABSORBING: KernelStep, REVISABLE: RevisableKernel, UNIFORM: UniformKernel}


class TransitionKernel(Protocol):
    """One step of a row's active block, for every row of a batch (``B`` rows, blocks of
    ``K`` positions, ``V`` logits), and the per-row state the kernel carries between steps.

    The kernel records contract violations on the device (:attr:`idle`, :attr:`non_finite`)
    for its caller to read at its next host synchronisation: it never synchronises itself.

    :ivar idle: ``()`` bool, some row that could step committed nothing.
    :ivar non_finite: ``()`` bool, some stepping row's logits held NaN or inf.
    :ivar edits: the commit rule may rewrite filled positions (the session then counts edits
        and drafts, :mod:`dloom.decode.edit_ledger`).
    """

    idle: torch.Tensor
    non_finite: torch.Tensor
    edits: bool

    def __call__(self, block: torch.Tensor, logits: torch.Tensor, advance: torch.Tensor) -> torch.Tensor:
        """The next ``(B, K)`` blocks from ``block`` ``(B, K)`` and its ``(B, K, V)`` logits; rows
        where ``advance`` (``(B,)`` bool) is ``False`` are returned unchanged and take no step."""
        ...

    def restrict(self, generated: torch.Tensor | None) -> None:
        """The positions of each row's active block that are generated (``(B, K)`` bool, or
        ``None`` when all are): no step changes the others."""
        ...

    def pending(self, block: torch.Tensor) -> torch.Tensor:
        """``(B,)`` bool, rows whose block ``(B, K)`` has a position a step may still change."""
        ...

    def settle(self, block: torch.Tensor) -> Settlement:
        """Where each row stands with its block ``(B, K)`` after a step."""
        ...

    def unchanged_post_steps(self) -> torch.Tensor | None:
        """``(B,)`` bool, rows whose last step began with no mask in their block and left the
        block unchanged; ``None`` when the kernel takes no such step."""
        ...

    def start_block(self, moving: torch.Tensor, block: torch.Tensor) -> None:
        """Rows ``moving`` (``(B,)`` bool) start the block ``block`` (``(B, K)``, their new one)."""
        ...

    def select(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (``(B',)`` long), in that order."""
        ...

    def join(self, block: torch.Tensor, streams: torch.Tensor) -> None:
        """Append rows at the start of their first block ``block`` (``(J, K)``), drawing from
        the random streams ``streams`` (``(J,)`` long)."""
        ...


def kernel_class(model: ModelAdapter) -> type[KernelStep]:
    """The kernel ``model`` decodes with (:data:`KERNELS`).

    :raises ModelError: for a kernel name no implementation has.
    """
    try:
        return KERNELS[model.kernel]
    except KeyError:
        raise ModelError(
            f"model {model.name!r} decodes with the {model.kernel!r} kernel; dloom has "
            f"{', '.join(KERNELS)}"
        ) from None


def kernel_options(composition: Composition, model: ModelAdapter, block_length: int) -> dict[str, Any]:
    """The keyword arguments the kernel of ``model`` takes for ``composition``: on the uniform
    kernel, the canvas ``width`` (``block_length``), the vocabulary size and the
    :class:`~dloom.decode.uniform.UniformSettings` of the checkpoint's generation config; for
    a commit rule that edits (:attr:`dloom.types.StrategyRegistration.edits`), ``edits=True``
    and its ``post_step_budget`` (the value of its ``edit_budget`` parameter, or ``None``);
    else none."""
    if model.kernel == UNIFORM:
        from dloom.decode.prompts import vocabulary_size

        size = vocabulary_size(model)
        if size is None:
            raise ModelError(f"model {model.name!r} declares no vocabulary size; the uniform kernel draws from it")
        return {"width": block_length, "vocab_size": size, "settings": UniformSettings.from_generation(model.generation)}
    editing = editing_rule(composition)
    if editing is None:
        return {}
    assert editing.strategy is not None  # an editing rule is a registered strategy
    budget = editing.strategy.registration.edit_budget
    return {"edits": True, "post_step_budget": None if budget is None else editing.params[budget]}


def editing_rule(composition: Composition) -> Component | None:
    """The component of ``composition`` answering ``dloom_select_commit`` when its strategy
    edits (:attr:`dloom.types.StrategyRegistration.edits`); ``None`` for a fill rule."""
    rule = composition.provider("dloom_select_commit")
    for component in composition.components:
        if component.name == rule and component.strategy is not None and component.strategy.registration.edits:
            return component
    return None


def common_kernel(composition: Composition) -> str:
    """The first kernel of :data:`KERNELS` that every strategy of ``composition`` supports
    (what a check decodes it with on a model of its own choosing).

    :raises ConfigurationError: when no kernel suits every strategy.
    """
    for kernel in KERNELS:
        if unsupported(composition, kernel) is None:
            return kernel
    raise ConfigurationError(f"no kernel suits every strategy of {composition.name!r}")


def unsupported(composition: Composition, kernel: str) -> tuple[str, Sequence[str]] | None:
    """The first strategy of ``composition`` that does not support ``kernel``, with the
    kernels it supports; ``None`` when every one does."""
    for component in composition.components:
        if component.strategy is not None and kernel not in component.strategy.registration.kernels:
            return component.name, component.strategy.registration.kernels
    return None


def check_kernel(composition: Composition, kernel: str) -> None:
    """Refuse a composition one of whose strategies does not support ``kernel``.

    :raises ConfigurationError: naming the strategy, its kernels and the model's kernel.
    """
    refused = unsupported(composition, kernel)
    if refused is not None:
        name, supported = refused
        raise ConfigurationError(
            f"strategy {name!r} supports the {', '.join(map(repr, supported))} "
            f"kernel(s), not the model's {kernel!r} kernel"
        )
