"""`python -m gradlab.check`: `gradlab check` without the CLI (gradlab/check/run.py)."""

import sys

from .run import main

sys.exit(main())
