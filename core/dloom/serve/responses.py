"""The JSON a client receives: choices, usage with dloom's figures, stream chunks, errors.

``usage`` carries OpenAI's three counts and dloom's: ``nfe`` (forwards the request's rows
were decoding in), ``tokens_per_forward`` (the decode's generated tokens, up to and
including EOS, per forward), ``guarantee`` (what the strategy promises about these outputs),
``strategy`` and ``batch_rows`` (rows of the largest batch the request was decoded in).
"""

from __future__ import annotations

import json
from typing import Any

from dloom.decode.decoders import ComposedDecoder
from dloom.serve.scheduler import Finished


def guarantee(decoder: ComposedDecoder, speculation: dict[str, Any] | None) -> str:
    """The guarantee of a decode, as ``benchmarks/report.py`` states it: a speculative run's
    measured one (``lossless`` or ``near-lossless``) against its commit rule (an AR-target
    decoder's: against its target, which has none), else the commit rule's declared claim."""
    rule = decoder.composition.provider("dloom_select_commit")
    if speculation is not None:
        return f"{speculation['guarantee']} against {rule or f'the AR target {decoder.model.name}'}"
    component = next(c for c in decoder.composition.components if c.name == rule)
    if component.strategy is None:
        return "undeclared (a plugin object without a registration)"
    claim = component.strategy.claim
    return claim.describe(conditions=False) if claim is not None else component.strategy.guarantee


def usage(
    decoder: ComposedDecoder, prompt_tokens: int, completion_tokens: int, rows: list[Finished]
) -> dict[str, Any]:
    """The ``usage`` object of a response whose rows finished as ``rows``."""
    nfe = sum(row.nfe for row in rows)
    generated = sum(len(row.tokens) for row in rows)
    speculation = next((row.speculation for row in rows if row.speculation is not None), None)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "nfe": nfe,
        "tokens_per_forward": generated / nfe if nfe else 0.0,
        "guarantee": guarantee(decoder, speculation),
        "strategy": decoder.composition.name,
        "batch_rows": max(row.batch_rows for row in rows),
    }


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object (the ``openai`` client raises it with ``message``)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event carrying ``data`` (JSON unless a plain string)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
