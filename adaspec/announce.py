"""One line for a startup step a user waits for (profiling, graph capture)."""
from __future__ import annotations

import logging
import sys

log = logging.getLogger("adaspec")


def announce(message: str) -> None:
    """To the adaspec log when logging is set up (the server), else one line on stderr (the
    offline LLM and the CLI), so a wait of seconds is never silent."""
    if log.hasHandlers() and log.isEnabledFor(logging.INFO):
        log.info(message)
    else:
        print(f"adaspec: {message}", file=sys.stderr, flush=True)
