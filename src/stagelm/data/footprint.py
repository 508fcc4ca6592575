"""What the data stages cost in memory, by arithmetic on params.yaml's sections: the download's
synthetic corpus, generated whole in memory, and pack's shard buffers. `stagelm check` holds
these, beside the model stages' (`stagelm.model.footprint.stage_estimates`), against this
machine; the stages themselves check the same figures before they start
(`download.require_synthetic_room`, `pack_splits`).
"""

from typing import Any

from stagelm.data.download import synthetic_corpus_bytes
from stagelm.data.pack import pack_buffer_bytes


def data_stage_estimates(sections: dict[str, Any]) -> dict[str, tuple[int, str]]:
    """The memory each data stage will ask for, by what it is spent on: (bytes, the key that sizes them).
    Each figure is one process's, however many `stagelm launch` starts."""
    pack = sections["pack"]
    estimates = {}
    if sections["data"].source == "synthetic":
        memory, _ = synthetic_corpus_bytes(sections["data"])
        estimates["download (the synthetic corpus, generated in memory)"] = (memory, "data.num_documents")
    key = "pack.seq_len" if pack.seq_len + 1 >= pack.rows_per_shard else "pack.rows_per_shard"
    estimates["pack (a shard's buffers)"] = (pack_buffer_bytes(pack.rows_per_shard, pack.seq_len + 1), key)
    return estimates
