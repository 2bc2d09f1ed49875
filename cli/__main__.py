"""`python -m cli COMMAND ...`: the `adaptive-spec` command without the console script."""

import sys

from cli import main

sys.exit(main())
