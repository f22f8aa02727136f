"""The harness: an emulated cluster on one machine, and what runs on it and measures each run."""
