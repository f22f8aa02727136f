"""Reports by topic, from the results JSON: throughput, sync options, the race to perplexity, the targets."""
