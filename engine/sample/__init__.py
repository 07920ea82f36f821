"""Sampling: the sampler, penalties, row-wise argmax and the rejection sampler for speculation."""
