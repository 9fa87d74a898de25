"""Scale-out on Ray (the optional extra ``pip install -e ".[ray]"`` in a clone of dloom).

:func:`decode_prompts` decodes a list of prompts with Ray Data: ``map_batches`` over a pool
of actors, each holding one model replica (one per GPU on a GPU cluster), with results
written as shards so that an interrupted run resumes where it stopped; :func:`evaluate_on_ray`
runs ``dloom eval --ray N`` that way. Outputs are those of
decoding the request in one process, greedy or seeded sampling.
"""

from dloom.ray.batch import DecodeSpec, decode_prompts, iter_decoded, read_shards
from dloom.ray.evaluate import evaluate_on_ray

__all__ = ["DecodeSpec", "decode_prompts", "evaluate_on_ray", "iter_decoded", "read_shards"]
