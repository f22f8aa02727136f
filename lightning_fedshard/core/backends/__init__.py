"""The sharding backends (FSDP1, FSDP2): the local shards the outer step reads and writes."""
