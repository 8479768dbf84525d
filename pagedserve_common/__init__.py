"""Helpers both services share (their command lines). Standard library only: the scheduler
imports it and stays CPU-only."""
