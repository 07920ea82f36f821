"""Speculative decoding: proposers (n-gram, draft model) and verification."""
