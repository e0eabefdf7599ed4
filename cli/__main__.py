"""`python -m actorserve.cli ...`: the same commands as the `actorserve` entry point."""

import sys

from .main import main

sys.exit(main())
