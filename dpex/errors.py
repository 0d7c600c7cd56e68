"""Exceptions raised by dpex.

    DpexError
     ├── RayConnectionError      the Ray cluster named by ``head_address`` cannot be reached
     ├── DatasetNotPicklableError the dataset / sampler / collate_fn cannot be shipped to workers
     ├── WorkerStartupError      workers could not be placed or started within the start-up limit
     ├── WorkerDiedError         a worker actor exited while its iterator still needed it
     │    └── WorkerHungError    dpex killed a worker as hung (or for a lost batch) more
     │                           often than it does: the batch or the worker is named
     ├── FleetError              a worker fleet (``worker_pool``, ``dpex fleet``) cannot be
     │                           started, found or used
     ├── BatchTooLargeError      (raised inside a worker, in its batch's slot) a batch is
     │                           over ``max_message_bytes``
     ├── IteratorClosedError     the iterator was closed (``loader.close()``, a fatal error)
     ├── EventLoopError          the iterator's event-loop thread failed or stopped; the
     │                           cause is chained
     ├── DpexTimeoutError        (also a ``TimeoutError``) an operation on the event-loop
     │                           thread did not finish in time
     ├── UnsupportedError        a combination dpex cannot stand in for (named, with what
     │                           to use instead)
     ├── ResumeStateError        (also a ``ValueError``) ``load_state_dict()`` got a state
     │                           this loader cannot resume from (what differs is named)
     └── ProtocolError           a message failed validation (counted and dropped, never raised
                                 to the training loop)

A ``DataLoader timed out after N seconds`` stays torch's ``RuntimeError``, as torch
raises it.

Warnings::

    DpexWarning (UserWarning)
     ├── PlacementWarning        workers wait for resources they reserve and that are not
     │                           free now (named, with who holds them)
     └── DpexDroppedWarning      a framework is about to rebuild a DpexDataLoader as a
                                 plain torch DataLoader, so dpex's workers are not used

Exceptions raised by user code inside a worker (``__getitem__``, ``collate_fn``,
``worker_init_fn`` ...) are re-raised in the training loop with torch's own rules
(``torch._utils.ExceptionWrapper``): same type, message starting with
"Caught X in DataLoader worker process N", followed by the remote traceback.
"""

from __future__ import annotations

__all__ = [
    "DpexError",
    "RayConnectionError",
    "DatasetNotPicklableError",
    "WorkerStartupError",
    "WorkerDiedError",
    "WorkerHungError",
    "BatchTooLargeError",
    "FleetError",
    "IteratorClosedError",
    "EventLoopError",
    "DpexTimeoutError",
    "UnsupportedError",
    "ResumeStateError",
    "ProtocolError",
    "DpexWarning",
    "PlacementWarning",
    "DpexDroppedWarning",
]


class DpexError(RuntimeError):
    """Base class of every error dpex raises itself."""


class RayConnectionError(DpexError, ConnectionError):
    """The Ray cluster at the given address cannot be reached."""


class DatasetNotPicklableError(DpexError, TypeError):
    """An object that must travel to the workers cannot be pickled."""


class WorkerStartupError(DpexError):
    """Workers could not be placed or did not start within the start-up limit."""


class WorkerDiedError(DpexError):
    """A worker actor exited while its iterator still needed it."""


class WorkerHungError(WorkerDiedError):
    """dpex killed a worker as hung (silent, or one batch past ``hung_batch_timeout``)
    or for a lost batch of its shard, more often than it does (per worker, per batch):
    the message says which, and after how long."""


class BatchTooLargeError(DpexError):
    """A batch is larger than the loader's ``max_message_bytes``."""


class ProtocolError(DpexError):
    """A message failed validation; carries the reason it was rejected."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class FleetError(DpexError):
    """A worker fleet cannot be started, found or used; the message says why."""


class IteratorClosedError(DpexError):
    """The iterator was closed; iterate the loader again for a new one."""


class EventLoopError(DpexError):
    """The iterator's event-loop thread failed (the cause is chained) or stopped."""


class DpexTimeoutError(DpexError, TimeoutError):
    """An operation on dpex's event-loop thread did not finish within its limit."""


class UnsupportedError(DpexError):
    """A combination dpex cannot stand in for; the message names what to use instead."""


class ResumeStateError(DpexError, ValueError):
    """``load_state_dict()`` got a state this loader cannot resume from, or
    ``state_dict()`` cannot take one (a worker's state over ``max_message_bytes``);
    the message says what differs."""


class DpexWarning(UserWarning):
    """Base class of every warning dpex gives."""


class PlacementWarning(DpexWarning):
    """Workers wait for resources they reserve (``ray_remote_args``) that are not free."""


class DpexDroppedWarning(DpexWarning):
    """A framework rebuilds a DpexDataLoader as a plain DataLoader: dpex is not used."""
