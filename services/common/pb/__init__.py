"""Generated protobuf/gRPC stubs for ``protos/minicpmo/v1`` (regenerate with ``generate.py``)."""
