"""`python -m tiermem ...`: the `tiermem` command without its console script."""

from tiermem.tools.cli import main

raise SystemExit(main())
