"""The executor's one owner: the scheduler session whose sequences it holds.

A scheduler names its session in the metadata of every call (protos/session.py: a random id and
a human-readable name). The session that calls Reset becomes the owner, if no other owner is
live; Reset and Step are then the owner's alone. An owner is live while it holds an open Step
stream, and for `lease_s` after its last call or its last stream closed (which covers the gap
between a scheduler's Reset and its first plan, and an idle scheduler, whose Describe heartbeat
refreshes the lease). Anyone else is refused with FAILED_PRECONDITION naming the owner:

- Reset from another session, or from a caller without a session (grpcurl, an older scheduler),
  while the owner is live. Once it is not, Reset hands the executor over (a clean takeover).
- A Step stream, or a plan on one, from a session that is not the owner: another scheduler, or
  the owner of before a takeover (its plans would run on the new owner's sequences).
- A Step stream without a session is served only while no owner is live, and never makes its
  caller the owner. A session's Step stream on an executor that nobody owns yet claims it.

A scheduler that stops calls Release: the executor is unowned at once (no lease to wait for).

Describe stays open to all (it reads only). With LocalExecutor in-process there is one caller
and nothing of this applies.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import grpc

from protos.session import MAX_OWNER_CHARS, SESSION_ID, SESSION_OWNER

logger = logging.getLogger(__name__)

DEFAULT_OWNER_LEASE_SECONDS = 10.0


class LogThrottle:
    """True at most once per key every `interval_s`: a refusal that a waiting scheduler (or an
    attacker) repeats every few seconds is logged once a minute, not each time."""

    def __init__(self, interval_s: float = 60.0, max_keys: int = 1024) -> None:
        self.interval_s = interval_s
        self._max_keys = max_keys
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def __call__(self, key: str) -> bool:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                return False
            if len(self._last) >= self._max_keys:
                self._last.clear()
            self._last[key] = now
            return True


class NotOwner(Exception):
    """The caller may not drive the executor now (FAILED_PRECONDITION); the message names the owner."""


class TooManyStreams(Exception):
    """A caller without a session holds its Step streams already (RESOURCE_EXHAUSTED)."""


# Step streams open at once of callers without a session (served while nobody owns the executor):
# each holds a server thread while open, and idle ones once held them all (Describe, health and the
# scheduler's Reset then waited forever).
MAX_ANONYMOUS_STEP_STREAMS = 1


@dataclass(frozen=True)
class Session:
    """Who makes a call: `session_id` is empty for a caller that names no session."""

    session_id: str
    name: str

    @property
    def anonymous(self) -> bool:
        return not self.session_id

    def __str__(self) -> str:
        return f"{self.name} (session {self.session_id[:8]})" if self.session_id else self.name


def session_of(context: grpc.ServicerContext) -> Session:
    metadata = dict(context.invocation_metadata() or ())
    session_id = str(metadata.get(SESSION_ID, "")).strip()[:64]
    if not session_id:
        return Session("", f"a caller without a session at {context.peer()}")
    name = (
        str(metadata.get(SESSION_OWNER, "")).strip()[:MAX_OWNER_CHARS] or f"a scheduler at {context.peer()}"
    )
    return Session(session_id, name)


@dataclass
class _Owner:
    session: Session
    last_seen: float = 0.0  # monotonic time of its last call, plan or stream close


class Ownership:
    """Who owns the executor; every method is thread-safe and raises NotOwner to refuse."""

    def __init__(self, lease_s: float = DEFAULT_OWNER_LEASE_SECONDS) -> None:
        if lease_s < 0:
            raise ValueError(f"the owner lease ({lease_s} s) must be >= 0")
        self.lease_s = lease_s
        self._lock = threading.Lock()
        self._owner: _Owner | None = None
        # Step streams open now, per session id ("": callers without a session, all together). Kept
        # by session, not by owner: an owner claimed anew (Release, then Reset) while a stream of its
        # was open still counts it.
        self._open_streams: dict[str, int] = {}

    @property
    def owner(self) -> Session | None:
        with self._lock:
            return self._owner.session if self._owner is not None else None

    def touch(self, session: Session) -> None:
        """A call of `session` (Describe, say): refreshes its lease if it is the owner."""
        with self._lock:
            if self._is_owner(session):
                self._owner.last_seen = time.monotonic()

    def claim(self, session: Session) -> None:
        """Reset: `session` becomes the owner, unless another owner is live. A caller without a
        session may reset an executor that no live owner holds; the executor is then unowned."""
        with self._lock:
            self._refuse_unless_free(session, "Reset")
            previous = self._owner
            if session.anonymous:
                self._owner = None
            elif previous is None or previous.session.session_id != session.session_id:
                self._owner = _Owner(session)
            if self._owner is not None:
                self._owner.last_seen = time.monotonic()
        if previous is not None and not self._is_owner_of(previous, session):
            logger.warning("%s took over the executor from %s", session, previous.session)
        elif previous is None and not session.anonymous:
            logger.info("%s owns the executor", session)

    def release(self, session: Session) -> bool:
        """The owner gives the executor up; False (and nothing changes) for anyone else."""
        with self._lock:
            if not self._is_owner(session):
                return False
            self._owner = None
        logger.info("%s released the executor", session)
        return True

    def open_stream(self, session: Session) -> None:
        """A Step stream begins; pair with close_stream."""
        with self._lock:
            open_now = self._open_streams.get(session.session_id, 0)
            if session.anonymous:
                self._refuse_unless_unowned(session, "Step")
                if open_now >= MAX_ANONYMOUS_STEP_STREAMS:
                    raise TooManyStreams(
                        f"{session}: a caller without a session may hold one Step stream at a time "
                        f"({MAX_ANONYMOUS_STEP_STREAMS} open); close it, or name a session "
                        "(tandem-session-id)"
                    )
            else:
                if self._owner is None:  # nobody has claimed this executor yet
                    self._owner = _Owner(session)
                    logger.info("%s owns the executor (its Step stream claimed it)", session)
                self._refuse_unless_owner(session, "Step")
                self._owner.last_seen = time.monotonic()
            self._open_streams[session.session_id] = open_now + 1

    def close_stream(self, session: Session) -> None:
        with self._lock:
            if (left := self._open_streams.pop(session.session_id, 0) - 1) > 0:
                self._open_streams[session.session_id] = left
            if self._is_owner(session):
                self._owner.last_seen = time.monotonic()

    def check_plan(self, session: Session, step_id: int) -> None:
        """A plan on a Step stream of `session`: refused when the session no longer owns the executor."""
        with self._lock:
            what = f"step {step_id}"
            if session.anonymous:
                self._refuse_unless_unowned(session, what)
            else:
                self._refuse_unless_owner(session, what)
                self._owner.last_seen = time.monotonic()

    # -- with the lock held -------------------------------------------------------------------

    def _is_owner(self, session: Session) -> bool:
        return self._owner is not None and self._is_owner_of(self._owner, session)

    @staticmethod
    def _is_owner_of(owner: _Owner, session: Session) -> bool:
        return not session.anonymous and owner.session.session_id == session.session_id

    def _streams_of(self, owner: _Owner) -> int:
        """Its Step streams open now."""
        return self._open_streams.get(owner.session.session_id, 0)

    def _live(self) -> bool:
        owner = self._owner
        return owner is not None and (
            self._streams_of(owner) > 0 or time.monotonic() - owner.last_seen < self.lease_s
        )

    def _refuse_unless_free(self, session: Session, what: str) -> None:
        """Refuse `what` unless `session` owns the executor or no owner is live."""
        if self._live() and not self._is_owner(session):
            raise NotOwner(self._message(session, what))

    def _refuse_unless_unowned(self, session: Session, what: str) -> None:
        """A caller without a session steps only an executor nobody owns (after a Reset or a
        Release): the sequences an owner left, live or not, are not its to drive."""
        if self._live():
            raise NotOwner(self._message(session, what))
        if self._owner is not None:
            raise NotOwner(
                f"{what} refused: the executor holds the sequences of {self._owner.session}; "
                f"{session} must call Reset first"
            )

    def _refuse_unless_owner(self, session: Session, what: str) -> None:
        if self._is_owner(session):
            return
        if self._live():
            raise NotOwner(self._message(session, what))
        if self._owner is None:
            raise NotOwner(f"{what} refused: {session} does not own the executor any more; call Reset first")
        raise NotOwner(
            f"{what} refused: the executor holds the sequences of {self._owner.session}, not of "
            f"{session}; call Reset first to take it over"
        )

    def _message(self, session: Session, what: str) -> str:
        owner = self._owner
        state = (
            "its Step stream is open"
            if self._streams_of(owner)
            else f"lease of {self.lease_s:g} s after its last call"
        )
        return (
            f"{what} refused: the executor is owned by {owner.session} ({state}); it accepts Reset and "
            f"Step only from its owner until the owner's streams close and --owner-lease-seconds "
            f"({self.lease_s:g}) pass. Caller: {session}"
        )
