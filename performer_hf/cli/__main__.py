"""`python -m performer_hf.cli` (used by `accelerate launch -m performer_hf.cli finetune ...`)."""

import sys

from . import main

sys.exit(main())
