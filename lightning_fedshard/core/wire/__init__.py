"""What crosses the groups at a sync: the codecs, the reducers that sum over the groups, error feedback."""
