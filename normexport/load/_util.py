"""Small helpers shared by the load modules (imports nothing else from normexport.load)."""

from __future__ import annotations

import contextlib
import logging
import warnings

from ..errors import first_line


def short(e: BaseException) -> str:
    return first_line(e, 160)


@contextlib.contextmanager
def quiet():
    """torch.export.load / from_pretrained log whole tracebacks (logger.warning(exc_info=True)) and
    warn about legacy formats: the user gets our one-line error instead."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)
