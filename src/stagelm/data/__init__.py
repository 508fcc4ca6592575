"""From a corpus to packed rows: download (files, the hub, synthetic), the tokenizer and chat
format, packing into Arrow shards, and the Grain loader that reads them.
"""
