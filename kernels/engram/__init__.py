"""Engram: hashed n-gram memory ops (see :mod:`kernels.engram.reference`, the specification)."""

from kernels.engram.reference import HashConfig, gate, make_hash_config, ngram_hash, short_conv

__all__ = ["HashConfig", "gate", "make_hash_config", "ngram_hash", "short_conv"]
