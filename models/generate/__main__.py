"""`python -m models.generate`: the command line (models/generate/__init__.py, main)."""

import sys

from . import main

sys.exit(main())
