"""Scale-out on Ray (the optional extra ``pip install -e ".[ray]"`` in a clone of dloom).

:func:`decode_prompts` decodes a list of prompts with Ray Data: ``map_batches`` over a pool
of actors, each holding one model replica (one per GPU on a GPU cluster), with results
written as shards so that an interrupted run resumes where it stopped. Outputs are those of
decoding the request in one process, greedy or seeded sampling.
"""

from dloom.ray.batch import DecodeSpec, decode_prompts, iter_decoded, read_shards

__all__ = ["DecodeSpec", "decode_prompts", "iter_decoded", "read_shards"]
