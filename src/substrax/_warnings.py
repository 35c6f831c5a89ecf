"""The warning category substrax uses when it replicates what a user asked to shard."""

__all__ = ["ShardingWarning"]


class ShardingWarning(UserWarning):
    """A dimension that was asked to be sharded is replicated (not divisible, unknown name, ...).

    Filter it like any warning, or turn it into an error with
    ``warnings.simplefilter("error", ShardingWarning)``; the Flax adapter's ``strict=True``
    raises instead of warning.
    """
