"""Training data: the Shakespeare corpus, a byte-level BPE tokenizer and packed, resumable loaders.

``DataConfig(...).build(seq_len=..., batch_size=..., seed=...)`` gives a :class:`DataBundle`;
``prepare(DataConfig())`` (or ``python -m lockstep.data.prepare``) fills the cache ahead of time.
"""

from lockstep.data.config import DataBundle, DataConfig, prepare
from lockstep.data.loader import PackedLoader
from lockstep.data.tokenizer import Tokenizer

__all__ = ["DataBundle", "DataConfig", "PackedLoader", "Tokenizer", "prepare"]
