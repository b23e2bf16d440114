"""`python -m hetcomm.bench [options]` runs `hetcomm bench [options]` (main.py)."""

from .main import main

if __name__ == "__main__":
    raise SystemExit(main())
