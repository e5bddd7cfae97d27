"""FlexShard (issue #20): per-bucket parameter placement (Shard, Owned, BlockShard) over the data-parallel ranks.

``layout``: placements, buckets and the per-parameter contract ``FlexParam``; ``buckets``: spec strings,
the muon preset and matching; ``group``: one (bucket, unit) group's gather and reduce; ``shard``:
``flex_shard`` (units, hooks, prefetch, reshard); ``state``: gradient norms and full state dicts.
"""

from lockstep.parallel.flex.buckets import buckets_from_config, parse_bucket, parse_buckets
from lockstep.parallel.flex.layout import BlockShard, Bucket, FlexParam, Owned, Shard
from lockstep.parallel.flex.shard import FlexShard, flex_shard, flex_state

__all__ = ["BlockShard", "Bucket", "FlexParam", "FlexShard", "Owned", "Shard", "buckets_from_config", "flex_shard",
           "flex_state", "parse_bucket", "parse_buckets"]
