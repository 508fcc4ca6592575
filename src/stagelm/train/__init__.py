"""The one training loop: the jitted train step, Orbax checkpoints keyed by a fingerprint, batches
on the mesh, metrics.
"""
