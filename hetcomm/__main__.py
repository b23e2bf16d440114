"""`python -m hetcomm ...` runs the hetcomm command."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
