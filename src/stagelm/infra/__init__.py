"""What every layer stands on: one-line errors, atomic files, memory checks, the devices, the mesh and
JAX's multi-process runtime. Imports no other stagelm package.
"""
