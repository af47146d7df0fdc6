"""`python -m bench.quality`: the quality section alone (see section.main)."""

from .section import main

main()
