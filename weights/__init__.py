"""Checkpoints: the committed demo (demo-python/, trained by scripts/train_demo.py on the corpus
python_corpus.py lists, measured on held_out/) and the seeded random ones tests and benchmarks
build locally (checkpoints.py).
"""
