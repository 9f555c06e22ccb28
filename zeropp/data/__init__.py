from .stdlib_corpus import ByteCorpus, load_stdlib_corpus

__all__ = ["ByteCorpus", "load_stdlib_corpus"]
