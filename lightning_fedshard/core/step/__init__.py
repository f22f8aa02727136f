"""The outer step on local shards: the pseudo-gradient, the merge, the outer optimizers and their state."""
