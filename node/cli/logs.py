"""Logging for the commands that run a node: our lines at INFO, the libraries' at WARNING.

    configure_logging(verbose=args.verbose)   # before hivemind is imported

Without `-v` a volunteer sees the node's own lines (joined, a line per round, outages) and the
progress bar, not one `HTTP Request: ...` line per coordinator call from httpx nor hivemind's
chatter. `-v` lets the libraries' INFO lines through. `LOCOSWARM_LOG_LEVEL=DEBUG` lowers our own
loggers' level (a line per packet fetched), independently of `-v`.
"""

from __future__ import annotations

import logging
import os
import sys

OWN_LOGGERS = ("locoswarm", "node", "protocol")
LIBRARY_LOGGERS = ("httpx", "httpcore", "hivemind", "asyncio", "urllib3", "filelock")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(verbose: bool = False) -> None:
    """Root handler on stderr; our loggers at INFO (or LOCOSWARM_LOG_LEVEL), libraries at WARNING
    (INFO with `verbose`)."""
    library_level = logging.INFO if verbose else logging.WARNING
    # hivemind installs its own handler and sets its logger's level from this variable when it is
    # first imported, which is after this call: a setLevel here alone would be undone.
    os.environ.setdefault("HIVEMIND_LOGLEVEL", logging.getLevelName(library_level))
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(library_level)
    own = os.environ.get("LOCOSWARM_LOG_LEVEL", "INFO").upper()
    own_level = own if isinstance(logging.getLevelName(own), int) else "INFO"
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(own_level)
