"""Thinker engine benchmark (``python -m bench.thinker``): decode/prefill throughput vs transformers and roofline."""
