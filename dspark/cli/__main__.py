"""`python -m dspark.cli ...`, the same as `python -m dspark ...`."""

from dspark.cli import main

raise SystemExit(main())
