"""Unit tests run on the CPU, where Triton only ever runs under its interpreter.

Triton decides when it is imported whether its own language functions (tl.argmax, tl.sum, ...)
are interpreted, so TRITON_INTERPRET=1 has to be in the environment before anything imports it:
test_plan_op.py's kernel checks need it, and nothing else in the unit tests uses Triton.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
