"""The C kernels a worker builds for its CPU (``kernels.c``) and their Python side: attention, a
step's layers in one call, and the 4-bit and 8-bit groups their products read."""
