"""`python -m backend.cli`: the `backend` command."""

import sys

from backend.cli.main import main

sys.exit(main())
