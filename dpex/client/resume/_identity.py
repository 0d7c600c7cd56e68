"""What a saved position depends on (the sampler's kind and settings, the batching,
the dataset's length, the sampler's epoch), recorded with ``state_dict()`` and
compared by ``load_state_dict()``: a state of another loader is refused by name."""

from __future__ import annotations

from typing import Any

import torch

from dpex.client.resume._view import LoaderView
from dpex.errors import ResumeStateError

__all__ = ["check_epoch", "check_identity", "identity", "sampler_epoch"]

# What a position depends on, besides the batches per epoch: the sampler's kind and
# settings, the batching, the dataset's length. (Not the rank: a framework under DDP
# saves rank 0's state and every rank loads it; each rank resumes its own part.)
_SAMPLER_SETTINGS = ("num_replicas", "shuffle", "seed", "drop_last", "replacement",
                     "num_samples")


def identity(view: LoaderView) -> dict:
    """What a loader's positions depend on, as plain data (compared by
    :func:`check_identity`; a mismatch is refused by name)."""
    sampler = view.sampler
    if view.batch_sampler is not None and not isinstance(
            view.batch_sampler, torch.utils.data.BatchSampler):
        sampler = view.batch_sampler  # the user's own batch sampler
    settings = {name: getattr(sampler, name) for name in _SAMPLER_SETTINGS
                if isinstance(getattr(sampler, name, None), (bool, int))}
    try:
        length = None if view.iterable else len(view.dataset)
    except TypeError:
        length = None
    return {"sampler": f"{type(sampler).__module__}.{type(sampler).__qualname__}",
            "sampler_settings": settings, "batch_size": view.batch_size,
            "drop_last": bool(view.drop_last), "dataset_length": length}


def check_identity(saved: dict | None, ours: dict, reshard: bool = False) -> None:
    """``reshard``: both deal by torch's DistributedSampler, so another rank count or
    batch size resumes exactly (``_reshard``)."""
    if saved is None:  # (a state saved before dpex recorded it)
        return
    differ = []
    for key in ("sampler", "batch_size", "drop_last", "dataset_length"):
        if reshard and key == "batch_size":
            continue
        if saved.get(key) != ours[key]:
            differ.append(f"{key} {saved.get(key)!r} there, {ours[key]!r} here")
    for name in sorted(set(saved.get("sampler_settings", {})) | set(ours["sampler_settings"])):
        theirs, mine = saved.get("sampler_settings", {}).get(name), ours["sampler_settings"].get(name)
        if theirs != mine and not (reshard and name in ("num_replicas", "num_samples")):
            differ.append(f"sampler.{name} {theirs!r} there, {mine!r} here")
    if differ:
        raise ResumeStateError(
            "this loader state belongs to another loader: " + "; ".join(differ) + ". A "
            "position means something only for the same dataset, sampler and batching: "
            "build the loader as the run that saved the state did")


def sampler_epoch(sampler: Any) -> int | None:
    epoch = getattr(sampler, "epoch", None)
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


def check_epoch(saved_epoch: int | None, sampler: Any) -> None:
    """Before a resumed epoch's iterator is made: a sampler that counts epochs
    (``DistributedSampler.set_epoch``) must be at the one the state was taken in."""
    epoch = sampler_epoch(sampler)
    if saved_epoch is not None and epoch is not None and epoch != saved_epoch:
        raise ResumeStateError(
            f"this loader state was taken in epoch {saved_epoch} of its sampler, and "
            f"this loader's sampler is at epoch {epoch}: call sampler.set_epoch("
            f"{saved_epoch}) before iterating, as the run that saved it did")
