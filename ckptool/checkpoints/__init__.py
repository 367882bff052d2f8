"""Checkpoints of any format, through the registry of :mod:`converters`: finding them
under a run root and opening them (:mod:`~ckptool.checkpoints.open`), checking that one is
whole (:mod:`~ckptool.checkpoints.verify`), choosing the newest valid one
(:mod:`~ckptool.checkpoints.latest`).

The layer between the formats and their users: the training hook (``training/``, whose
restart needs the newest valid checkpoint) and the top floor (``ckptool/ops``, the CLI)
import it; it imports the formats' registry and the core only.
"""
