"""The DVC side of the lab: params.yaml's typed sections, the frame every stage script shares,
provenance, the deps `stagelm deps` computes, lineage and the params reference.
"""
