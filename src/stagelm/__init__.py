"""stagelm: a reproducible language-model lab laid out as a DVC pipeline of JAX stages.

This package imports nothing on purpose: each stage imports exactly the modules it
needs, and dvc.yaml lists exactly those files as the stage's code deps.
"""
