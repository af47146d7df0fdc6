"""Benchmarks for the ToMA pack (scripts, not tests): `python -m bench` runs the suite."""
