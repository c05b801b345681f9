"""Code2Wav benchmark (``python -m bench.code2wav``)."""
