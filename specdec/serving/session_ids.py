"""The one rule for session ids, applied by the coordinator (client ids) and the workers (the
coordinator's internal ids: a caller's namespace prefix + the client id, or a one-shot id)."""

from __future__ import annotations

import re

from specdec.serving.errors import InvalidRequest

SESSION_ID_MAX = 128  # characters a client's session id may have
INTERNAL_SESSION_ID_MAX = 192  # room for the caller namespace prefix the coordinator adds
_ALLOWED = re.compile(r"[A-Za-z0-9._:\-]+")


def check_session_id(session_id: str, max_len: int = SESSION_ID_MAX, field: str = "session_id") -> None:
    """Raises InvalidRequest unless ``session_id`` is 1..max_len letters, digits and ``. _ : -``.

    ``fullmatch``: a pattern ending in ``$`` would also accept a trailing newline.
    """
    if not 0 < len(session_id) <= max_len or _ALLOWED.fullmatch(session_id) is None:
        raise InvalidRequest(f"{field} must be 1-{max_len} characters of letters, digits and . _ : -")
