"""The fast engine's Python API: a thin layer over the C++/CUDA extension."""
