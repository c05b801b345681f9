"""Code2Wav stage: streaming Step-Audio2 Token2wav (flow matching + HiFT) behind a gRPC front."""
