"""Make the pack importable as `toma_pack` for every test (see pack_loader.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pack_loader

pack_loader.load_pack()
