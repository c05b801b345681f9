"""Thinker stage: MiniCPM-o 4.5 understanding and text, exporting the hidden states of the spoken span."""
