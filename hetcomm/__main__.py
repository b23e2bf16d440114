"""`python -m hetcomm ...` runs the hetcomm command."""

from .cli import main

raise SystemExit(main())
