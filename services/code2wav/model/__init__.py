"""Pure model code of the Code2Wav stage: flow + vocoder loading, streaming steps, reference voice."""
