"""The worker: everything on the device. ``worker`` (model load, KV allocation, warm-up,
tensor-parallel ranks), ``model_runner`` (a scheduled step -> ``BatchLayout`` -> forward ->
sample), ``sampler``, ``cuda_graphs``, and the per-step helpers the core and runner share:
``speculative`` (drafts, who speculates), ``draft_model``, ``structured`` (grammars and
token masks)."""
