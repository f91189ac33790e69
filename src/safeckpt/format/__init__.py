"""The on-disk format: what a checkpoint is, byte for byte, and how it is checked.

Manifest (versions 2 and 3), per-file indexes, safetensors data files, state trees and their
validation. Pure data and local file I/O: nothing here talks to other ranks or knows about
storage backends beyond a path's spelling (:mod:`.locations`). Imports only ``errors``.
"""
