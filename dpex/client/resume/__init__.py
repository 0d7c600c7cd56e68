"""Exact mid-epoch resume: ``DpexDataLoader.state_dict()`` and ``load_state_dict()``, for
torch's loader and dpex's alike (docs/RESUME.md).

The sampler runs in the trainer, so the position in an epoch is the number of index
batches already yielded, and the rest of the epoch is what the sampler draws after
them: index batches are exactly an uninterrupted run's whatever ``num_workers`` is.
The iterator's base seed (its workers' seeds) is drawn again from the state it was
drawn from. The pieces:

- ``_state``: :class:`ResumeState`, the typed state, and its plain (JSON) form.
- ``_view``: :class:`LoaderView`, what resuming reads of a loader.
- ``_position``: :class:`IteratorPosition`, what every iterator reports of where it
  stands, and the adapter that reads it off torch's iterators.
- ``_save``: :func:`capture`, the state of a position (pure).
- ``_load``: :func:`loaded`, a state checked against the loader and kept for its next
  iterator.
- ``_replay``: each epoch's draws (:class:`Drawing`) and how a loaded state replays them.
- ``_reshard``: an epoch of torch's DistributedSampler on another number of ranks.
- ``_identity``: what a position depends on, compared on loading.
- ``_trainer``: ``num_workers=0``, where the dataset runs in the trainer.
"""

from dpex.client.resume._load import loaded, replaying, starting
from dpex.client.resume._position import IteratorPosition, position_of
from dpex.client.resume._replay import Drawing, IndexView, distributed_seed
from dpex.client.resume._save import Saving, capture, mid_epoch_state
from dpex.client.resume._state import STATE_VERSION, ResumeState
from dpex.client.resume._trainer import in_trainer
from dpex.client.resume._view import LoaderView

__all__ = ["STATE_VERSION", "Drawing", "IndexView", "IteratorPosition",
           "LoaderView", "ResumeState", "Saving", "capture",
           "distributed_seed", "in_trainer", "loaded", "mid_epoch_state", "position_of",
           "replaying", "starting"]
