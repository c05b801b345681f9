"""``python -m services.common.checkpoint_tool`` == ``minicpmo-checkpoint``."""

import sys

from .cli import main

sys.exit(main())
