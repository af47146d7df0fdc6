"""Make the pack importable as `toma_pack` for every test (see pack_loader.py), and the tests'
shared reference modules (plan_reference.py) importable by name."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))      # plan_reference

import pack_loader

pack_loader.load_pack()
