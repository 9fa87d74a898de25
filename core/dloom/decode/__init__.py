"""Decoding a dLLM: the decoder, its session's step loop and the speculation SDK.

* :mod:`dloom.decode.decoder`: :class:`~dloom.decode.decoder.DiffusionDecoder`.
* :mod:`dloom.decode.decoders`: what every decoder offers and which one a strategy runs in.
* :mod:`dloom.decode.session`: :class:`~dloom.decode.session.DecodeSession`, a running batch
  and its plain and speculative steps.
* :mod:`dloom.decode.kernel`, :mod:`dloom.decode.speculation`: drafting, verifying and
  committing several steps in one forward.
* :mod:`dloom.decode.commit`, :mod:`dloom.decode.logprobs`: commit rules and the log
  probabilities of what was committed.
* :mod:`dloom.decode.prompts`: checks on the prompts, before any forward.
* :mod:`dloom.decode.generation`: the steps every decoder takes around its loop (padding,
  random streams, ids to texts).
* :mod:`dloom.decode.batching`: batch sizes that fit a memory budget.
* :mod:`dloom.decode.oracle`: the oracle NFE, the fewest forwards any commit rule could need.
"""
