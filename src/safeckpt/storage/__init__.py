"""Where checkpoint bytes live: the storage interface (:mod:`.base`), its backends (POSIX,
fsspec object stores, S3) and the storage-level steps of a commit and of reading a root.

Imports the format below it; never coordination or torch.distributed. A new backend
subclasses :class:`.base.Storage` and is registered with :func:`.base.register_backend`.
"""
