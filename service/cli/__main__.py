"""`python -m service.cli COMMAND ...`: the `adaptive-spec` command without the console script."""

import sys

from service.cli import main

sys.exit(main())
