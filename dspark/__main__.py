"""`python -m dspark ...` is the `dspark` command."""

from dspark.cli import main

raise SystemExit(main())
