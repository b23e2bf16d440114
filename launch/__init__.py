"""Launching: which MPI is installed, its flavour, and how to start ranks with it."""
