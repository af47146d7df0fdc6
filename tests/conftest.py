"""Make the pack importable as `toma_pack` for every test (see toma_dev.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import toma_dev

toma_dev.load_pack()
