"""`python -m kvtopo ...`: the kvtopo command line (see kvtopo.cli)."""

from kvtopo.cli import main

raise SystemExit(main())
