"""Generator and checker for MiniCPM-o 4.5 checkpoints (the ``minicpmo-checkpoint`` console script).

``make`` writes a random-weight checkpoint in the real ``openbmb/MiniCPM-o-4_5`` layout (``tiny`` for tests,
``full`` for GPU benchmarks); ``check`` validates any checkpoint directory against the contract that
:mod:`services.common.checkpoint` loads.
"""
