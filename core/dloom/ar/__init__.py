"""Speculation against an autoregressive target: a dLLM drafts token chains, the target verifies.

* :mod:`dloom.ar.target`: :class:`~dloom.ar.target.ARTarget`, a causal LM with its KV cache.
* :mod:`dloom.ar.decoder`: :class:`~dloom.ar.decoder.ARTargetDecoder`, the decode loop.
* :mod:`dloom.ar.chains`: sampling the target, laying chains out for one target forward,
  greedy-match verification.
* :mod:`dloom.ar.result`: what one AR-target generation returns.
"""
