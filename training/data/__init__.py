"""Dataset readers, deduplication, splits, vocabulary and encoding."""
