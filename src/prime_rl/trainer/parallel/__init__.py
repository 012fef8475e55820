"""Processes, ranks and device meshes (`distributed.py`); context parallelism (`context_parallel.py`)."""
