"""`python -m hetcomm.bench [options]` runs `hetcomm bench [options]` (main.py)."""

from .main import main

raise SystemExit(main())
