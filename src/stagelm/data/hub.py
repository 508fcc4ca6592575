"""`hf:` corpora through `datasets`: a pinned hub dataset, or a dataset folder on disk, streamed.

The hub is unreachable on machines without internet: a TCP probe fails fast with one line
saying what to do instead, rather than a long retry inside `datasets`.
"""

import itertools
import socket
from collections.abc import Iterator
from pathlib import Path

from stagelm.data.corpus_files import BATCH_DOCUMENTS, first_line, require_text
from stagelm.infra.errors import StagelmError
from stagelm.pipeline.config import DataConfig

HUB_HOST = ("huggingface.co", 443)


def hf_batches(name: str, cfg: DataConfig) -> Iterator[list[str]]:
    """Column `data.text_field` of a streamed `datasets` dataset: a local dataset dir or a pinned hub id."""
    import datasets

    where = f"hf:{name}"
    if cfg.hf_revision is None:  # a dataset on disk (under data.inputs): no hub, no pin
        if not Path(name).is_dir():
            raise StagelmError(
                f"data.source: {where}: no such local dataset folder; give a folder under data.inputs, "
                f"or pin a hub dataset with data.hf_revision (a commit, tag or branch)"
            )
        kwargs = {}
    elif not hub_reachable():
        raise StagelmError(
            f"data.source: the Hugging Face hub is unreachable, so 'hf:{name}' cannot be read; "
            "download it elsewhere and use 'hf:<local dir>' or 'files:<glob>'"
        )
    else:
        kwargs = {"revision": cfg.hf_revision}
    try:
        stream = datasets.load_dataset(name, split=cfg.hf_split, streaming=True, **kwargs)
        batches = stream.iter(batch_size=BATCH_DOCUMENTS)
        first = next(batches, None)
    except Exception as err:  # datasets raises many types for a missing or malformed dataset
        raise StagelmError(f"data.source: could not read {where!r}: {first_line(err)}") from None
    if first is None:
        return iter(())
    if cfg.text_field not in first:
        raise StagelmError(f"data.text_field: {where} has no column {cfg.text_field!r}; columns: {sorted(first)}")
    return hf_texts(itertools.chain([first], batches), cfg.text_field, where)


def hf_texts(batches: Iterator[dict[str, list]], field: str, where: str) -> Iterator[list[str]]:
    try:
        for batch in batches:
            texts = batch[field]
            if any(t is not None and not isinstance(t, str) for t in texts):
                raise StagelmError(f"data.text_field: column {field!r} of {where} is not text")
            yield [require_text(t or "", f"{where}, a {field!r} value") for t in texts]
    except StagelmError:
        raise
    except Exception as err:
        raise StagelmError(f"data.source: reading {where!r} failed: {first_line(err)}") from None


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub opens within `timeout` seconds (so offline fails fast)."""
    try:
        socket.create_connection(HUB_HOST, timeout=timeout).close()
        return True
    except OSError:
        return False
