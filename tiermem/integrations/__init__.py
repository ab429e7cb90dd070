"""Glue between `tiermem.offload` and training frameworks: one module per framework.

Importing `tiermem.integrations` imports no framework; `tiermem.integrations.lightning`
needs `lightning`, `tiermem.integrations.transformers` needs `transformers`. Accelerate
needs no module: `tiermem.offload` takes its `AcceleratedOptimizer` as it is
(tiermem/optim/wrappers.py). docs/guide/integrations/ has one page per framework.
"""
