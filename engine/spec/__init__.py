"""Speculative decoding: the proposers (n-gram and draft model) and the rejection sampler that
keeps the target's distribution."""
