"""Checkpoints: the committed demo (demo-python/, trained by scripts/train_demo.py) and the
seeded random ones tests and benchmarks build locally (checkpoints.py).
"""
