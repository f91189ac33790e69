"""Preemption for Lightning: a signal on any rank becomes the same save on every rank.

Lightning's own SIGTERM handler (2.6) runs a ``dist.broadcast`` inside the signal handler and
each step propagates only rank 0's flag, so a signal to another rank alone makes ranks stop at
different steps or hang. Here the handler only sets a flag; the ranks agree on it once per batch.
"""

from __future__ import annotations

import os
import signal
import threading
import warnings
from collections.abc import Iterable
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from safeckpt.coord.dist import Coordinator
from safeckpt.errors import SafeckptWarning


class SafeckptPreemption(Callback):
    """SIGTERM (or SIGUSR1) on any rank: every rank saves the same step, then training stops.

    Lightning's own SIGTERM handler runs a collective inside the signal handler and only
    propagates rank 0's signal; this callback replaces it while training runs. The handler only
    sets a flag; at the end of each training batch every rank agrees on it (one tiny all-reduce
    on safeckpt's gloo group); if set, all save ``dirpath/filename.ckpt`` (default: next to
    ModelCheckpoint's checkpoints, ``last-preempted.ckpt``, which ``ckpt_path="last"`` finds)
    and raise Lightning's ``SIGTERMException`` (a ``SystemExit``) together.
    """

    def __init__(self, dirpath: str | os.PathLike[str] | None = None, filename: str = "last-preempted",
                 signals: Iterable[int] = (signal.SIGTERM, signal.SIGUSR1), timeout: float | None = None) -> None:
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self.filename = filename
        self.signals = tuple(signals)
        self.timeout = timeout
        self.flag = False
        self.saved_path: str | None = None
        self._previous: dict[int, Any] = {}

    def path(self, trainer: Trainer) -> str:
        d = self.dirpath
        if d is None:
            cb = trainer.checkpoint_callback
            d = getattr(cb, "dirpath", None) or os.path.join(trainer.default_root_dir, "checkpoints")
        return os.path.join(os.fspath(d), self.filename + ".ckpt")

    def _handle(self, signum: int, frame: Any) -> None:
        self.flag = True

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.flag = False
        if threading.current_thread() is not threading.main_thread():
            warnings.warn("SafeckptPreemption: not in the main thread, signals are not watched",
                          SafeckptWarning, stacklevel=2)
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not Coordinator(self.timeout, what="preemption check").any_true(self.flag, "preempted"):
            return
        path = self.path(trainer)
        rank_zero_info(f"safeckpt: preemption signal received; every rank saves step {trainer.global_step} to {path}")
        trainer.save_checkpoint(path)
        self.saved_path = path
        raise SIGTERMException()

    def _restore(self) -> None:
        for sig, prev in self._previous.items():
            try:
                if signal.getsignal(sig) == self._handle:
                    signal.signal(sig, prev)
            except (ValueError, TypeError):
                pass
        self._previous.clear()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore()
