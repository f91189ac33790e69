"""``safeckpt``: look at, check, clean up, compare and export checkpoints from a shell.

Commands (``safeckpt COMMAND --help`` for options)::

    ls ROOT              what is under a checkpoint root: committed steps, leftovers, the writer lease
    inspect CKPT         metadata and every tensor (dtype, shape, size, scope)
    verify CKPT          exit 0 only when sound (--deep, the default, checks every byte's checksum)
    gc ROOT              remove staging/trash leftovers of crashed runs; optional retention rules
    diff A B             per-tensor max |A-B|, keys only on one side, shape/dtype/value differences
    consolidate CKPT -o OUT.safetensors
                         one full (unsharded) state dict in a plain safetensors file
    convert SRC DST      import DCP / torch.save (--from), export to Hugging Face (--to hf)

Exit codes (``EXIT_CODES`` in ``safeckpt.cli.common``, docs/cli.md's table): 0 success; 1 ``diff`` found
differences, or a safeckpt error with no more specific code; 2 usage error or no checkpoint (file,
directory) of the needed kind at a path; 3 an import's save failed; 5 corrupt; 7 a live writer
holds the root; 8 the output exists; 70 internal error (a bug); 74 the system or the object
store refused (permission, disk full, credentials); 130 interrupted; 141 the output pipe closed.
Every error is one line on stderr (:mod:`safeckpt.cli.exit_codes`); ``--debug`` adds the traceback.

The CLI reads checkpoints without a process group and never takes the writer lease, except
``gc``, which holds it while it deletes so that no job starts saving into what it cleans. It
deletes only what it recognises: staging/trash leftovers (by their markers) and, when asked,
committed ``step-*`` checkpoints that the retention rules do not keep (never the newest).

ROOT, CKPT, A and B may be fsspec URLs (``s3://bucket/prefix``; see ``safeckpt.storage.base``);
on an object store, leftovers are token-named objects that no manifest names, and the
extra files an interrupted save's ``.extras.<token>.json`` sidecar lists.

``rich`` (``pip install 'safeckpt[cli]'``) draws tables and progress bars when the output is a
terminal; without it, or when piped, output is plain aligned text. Progress bars appear only
when stderr is a terminal (``SAFECKPT_PROGRESS=1``/``0`` forces them on or off).
"""

from .app import main

__all__ = ["main"]
